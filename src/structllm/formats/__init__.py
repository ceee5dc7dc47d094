"""Model file formats read without Paddle: GGUF (llama.cpp's format).

:class:`GGUFFile` reads a GGUF file's metadata and tensor infos from a memory
map; :mod:`structllm.formats.quants` holds the GGML block layouts, and
:mod:`structllm.formats.blocks` their numpy dequantizers. Only attrs and the
standard library until a tensor is read (then numpy), so both the text and
the model layers may import this package, and the server's process reads a
file's tokenizer without numpy.
"""

from structllm.formats.gguf import GGUFFile, GGUFTensor, GGUFValueType
from structllm.formats.quants import (
    DEQUANTIZABLE,
    GGMLType,
    block_layout,
    dequantize,
    tensor_nbytes,
)

__all__ = [
    "DEQUANTIZABLE",
    "GGMLType",
    "GGUFFile",
    "GGUFTensor",
    "GGUFValueType",
    "block_layout",
    "dequantize",
    "tensor_nbytes",
]
