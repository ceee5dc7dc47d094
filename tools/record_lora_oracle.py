"""Record transformers + peft logits of LoRA adapters for tests/test_lora.py.

    /work/oracle/venv/bin/python tools/record_lora_oracle.py

(any environment with torch, transformers, peft and safetensors: the JSON
records the versions used). structllm's code is not imported.

Writes under ``tests/data/lora/``:

- two small random base checkpoints (hidden 64, 2 layers, vocab 128):
  ``llama-base`` (GQA, tied embeddings) and ``qwen2-base`` (q/k/v biases,
  untied head), weights stored as float16 (half the bytes; both sides run
  them as float32, so they compute the same numbers);
- adapters made with peft's ``get_peft_model`` on them, their LoRA weights
  set random (peft starts B at zero: a no-op adapter would test nothing),
  saved with ``save_pretrained`` (``adapter_config.json`` +
  ``adapter_model.safetensors``): ranks 4 and 8, q/v only, k/o/gate/down,
  k/v/up, ``"all-linear"``, ``use_rslora`` on two;
- ``oracle.json``: float32 logits ``(T, V)`` of a fixed prompt for each base
  alone and each adapter on its base.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import peft
import safetensors.torch
import torch
import transformers

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "lora"

#: a fixed prompt (token ids under the bases' vocab of 128)
PROMPT = [3, 17, 92, 45, 8, 127, 64, 33, 5, 71, 12, 100]

_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

BASES: dict[str, tuple[type[Any], dict[str, Any]]] = {
    "llama-base": (
        transformers.LlamaConfig,
        {**_COMMON, "tie_word_embeddings": True, "head_dim": 16},
    ),
    "qwen2-base": (
        transformers.Qwen2Config,
        {**_COMMON, "tie_word_embeddings": False},
    ),
}

#: adapter -> (base, LoraConfig arguments)
ADAPTERS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-qv-r4": (
        "llama-base",
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    ),
    "llama-all-r8": (
        "llama-base",
        {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    ),
    "llama-kogd-r8-rslora": (
        "llama-base",
        {
            "r": 8,
            "lora_alpha": 4,
            "use_rslora": True,
            "target_modules": ["k_proj", "o_proj", "gate_proj", "down_proj"],
        },
    ),
    "qwen2-all-r8": (
        "qwen2-base",
        {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    ),
    "qwen2-kvup-r4-rslora": (
        "qwen2-base",
        {
            "r": 4,
            "lora_alpha": 2,
            "use_rslora": True,
            "target_modules": ["k_proj", "v_proj", "up_proj"],
        },
    ),
}


def _random_base(cls: type[Any], kwargs: dict[str, Any], seed: int) -> Any:
    """A float32 model whose weights are float16 values, scaled as structllm's
    ``random_hf_tensors`` scales them (logits well separated)."""
    config = cls(**kwargs)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    model = transformers.AutoModelForCausalLM.from_config(
        config, torch_dtype=torch.float32
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape, generator=g)
            elif name.endswith(".bias"):
                t = 0.1 * torch.randn(shape, generator=g)
            elif name == "model.embed_tokens.weight":
                t = torch.randn(shape, generator=g)
            elif name == "lm_head.weight":
                t = 8.0 * torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                t = 3.0 * torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            else:
                t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            p.copy_(t.half().float())
    model.eval()
    return model


def _save_base(model: Any, directory: Path) -> None:
    directory.mkdir(parents=True)
    model.config.save_pretrained(directory)
    tensors = {
        n: t.detach().half().contiguous()
        for n, t in model.state_dict().items()
        if not (model.config.tie_word_embeddings and n == "lm_head.weight")
    }
    safetensors.torch.save_file(
        tensors, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )


def _logits(model: Any) -> list[list[float]]:
    with torch.no_grad():
        out = model(torch.tensor([PROMPT])).logits[0].float()
    return [[float(f"{v:.8g}") for v in row] for row in out.tolist()]


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    record: dict[str, Any] = {
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "prompt": PROMPT,
        "bases": {},
        "adapters": {},
    }
    bases = {}
    for i, (name, (cls, kwargs)) in enumerate(BASES.items()):
        model = _random_base(cls, kwargs, seed=100 + i)
        _save_base(model, OUT / name)
        bases[name] = model
        record["bases"][name] = {"logits": _logits(model)}
    for i, (name, (base, kwargs)) in enumerate(ADAPTERS.items()):
        lora = peft.get_peft_model(
            bases[base], peft.LoraConfig(lora_dropout=0.0, **kwargs)
        )
        g = torch.Generator().manual_seed(200 + i)
        with torch.no_grad():
            for pname, p in lora.named_parameters():
                if "lora_A" in pname:  # (r, in)
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
                elif "lora_B" in pname:  # (out, r)
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        lora.eval()
        lora.save_pretrained(OUT / name)
        (OUT / name / "README.md").unlink()  # peft's model card template
        record["adapters"][name] = {
            "base": base,
            "config": dict(kwargs),
            "logits": _logits(lora),
        }
        # peft changed the base in place: take its LoRA layers out again
        bases[base] = lora.unload()
    (OUT / "oracle.json").write_text(json.dumps(record) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
