"""Record transformers' RoPE frequencies for tests/test_rope.py.

    /work/oracle/venv/bin/python tools/record_rope_oracle.py > tests/data/rope_transformers.json

(any environment with torch and transformers: the file records the versions
used). For each case, ``ROPE_INIT_FUNCTIONS[rope_type]`` of
``transformers.modeling_rope_utils`` on a ``LlamaConfig`` gives the inverse
frequencies and the attention factor (cos/sin scale) that transformers'
Llama applies; structllm's code is not imported.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

#: name -> (head_dim, rope_theta, max_position_embeddings, rope parameters)
CASES: dict[str, tuple[int, float, int, dict[str, Any]]] = {
    "linear": (16, 10000.0, 256, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (16, 10000.0, 256, {"rope_type": "dynamic", "factor": 2.0}),
    "llama3": (
        64,
        500000.0,
        8192,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "yarn": (
        32,
        10000.0,
        1024,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "yarn_untruncated_betas": (
        32,
        1000000.0,
        2048,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
    ),
    "yarn_mscale": (
        16,
        10000.0,
        1024,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    "yarn_mscale_ratio": (
        16,
        10000.0,
        1024,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ),
}


def record(head_dim: int, theta: float, max_pos: int, rope: dict[str, Any]) -> Any:
    heads = 4
    config = LlamaConfig(
        hidden_size=head_dim * heads,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters={**rope, "rope_theta": theta},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    return {
        "head_dim": head_dim,
        "rope_theta": theta,
        "max_position_embeddings": max_pos,
        "rope_scaling": rope,
        "inv_freq": inv_freq.double().tolist(),
        "attention_factor": float(attention_factor),
    }


def main() -> None:
    out = {
        "recorded_with": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "command": "python tools/record_rope_oracle.py",
        },
        "cases": {name: record(*case) for name, case in CASES.items()},
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
