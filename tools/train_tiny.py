"""Train the built-in ``tiny`` model with structllm's own Paddle model code.

Reads the committed corpus (tools/tiny_corpus/, see its SOURCES.md), trains
a byte-level BPE tokenizer and a small Llama on it, and writes a Hugging Face
checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) plus training.json (settings, losses, held-out
perplexity, the corpus digest). Seeded and single-process: the same corpus,
settings and Paddle build give the same weights.

Every 20th document is held out; ``training.json`` reports the perplexity
on it per token of the model, and of the same architecture with random
weights, as a reference.

Usage: python tools/train_tiny.py [--out src/structllm/models/tiny] [--steps N]
(``nox -s train-tiny``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).parent / "tiny_corpus"
DEFAULT_OUT = Path(__file__).parent.parent / "src" / "structllm" / "models" / "tiny"


def documents() -> tuple[list[str], list[str], str]:
    """(training documents, held-out documents, sha256 of the corpus)."""
    licences = (CORPUS / "licences.txt").read_text()
    docstrings = (CORPUS / "docstrings.txt").read_text()
    digest = hashlib.sha256((licences + docstrings).encode()).hexdigest()
    docs = [d.strip() for d in licences.split("\n\n\n") if d.strip()]
    docs += [d.strip() for d in docstrings.split("\n\n") if d.strip()]
    train = [d for i, d in enumerate(docs) if i % 20 != 7]
    held_out = [d for i, d in enumerate(docs) if i % 20 == 7]
    return train, held_out, digest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--context", type=int, default=128, help="training sequence length")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    ns = p.parse_args(argv)

    import safetensors.numpy
    import tokenizers

    from structllm.model._paddle import paddle
    from structllm.model.config import ModelConfig
    from structllm.model.loader import build_model
    from structllm.model.training import (
        causal_lm_loss,
        hf_tensors,
        initial_hf_tensors,
        trainable_weights,
    )
    from structllm.text.training import SPECIAL_TOKENS, write_byte_level_bpe_tokenizer

    paddle.seed(ns.seed)
    paddle.base.core.set_num_threads(ns.threads)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, held_out, digest = documents()

    write_byte_level_bpe_tokenizer(
        out,
        vocab_size=ns.vocab_size,
        corpus=train_docs,
        eos_token=SPECIAL_TOKENS[0],
        model_max_length=2048,
    )
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = SPECIAL_TOKENS.index("<|endoftext|>")

    def encode(docs: list[str]) -> np.ndarray:
        ids: list[int] = []
        for e in tok.encode_batch(docs):
            ids += [*e.ids, eot]
        return np.asarray(ids, dtype=np.int64)

    train_ids, held_ids = encode(train_docs), encode(held_out)
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=tok.get_vocab_size(),
        hidden_size=ns.hidden,
        intermediate_size=ns.intermediate,
        num_hidden_layers=ns.layers,
        num_attention_heads=ns.heads,
        num_key_value_heads=ns.kv_heads,
        head_dim=ns.hidden // ns.heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_ids=(eot,),
    )
    model = build_model(
        config, initial_hf_tensors(config, ns.seed), max_model_len=ns.context + 1
    )
    params = trainable_weights(model)
    warmup = max(1, ns.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine down to 10%
        if step < warmup:
            return ns.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, ns.steps - warmup)
        return ns.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    opt = paddle.optimizer.AdamW(
        learning_rate=ns.lr,
        parameters=params,
        weight_decay=0.1,
        beta2=0.98,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
    )
    rng = np.random.default_rng(ns.seed)
    t = ns.context + 1

    def held_out_ppl() -> float:
        n = (len(held_ids) - 1) // ns.context
        rows = [held_ids[i * ns.context : i * ns.context + t] for i in range(n)]
        total = 0.0
        with paddle.no_grad():
            for i in range(0, n, ns.batch):
                batch = paddle.to_tensor(np.stack(rows[i : i + ns.batch]))
                total += float(causal_lm_loss(model, batch)) * len(batch)
        return math.exp(total / n)

    random_ppl = held_out_ppl()
    print(
        f"{config.describe()['parameters']} parameters; {len(train_ids):,} training "
        f"tokens, {len(held_ids):,} held out; random weights: ppl {random_ppl:.1f}",
        flush=True,
    )
    losses = []
    start = time.perf_counter()
    for step in range(ns.steps):
        opt.set_lr(lr_at(step))
        starts = rng.integers(0, len(train_ids) - t, size=ns.batch)
        batch = paddle.to_tensor(np.stack([train_ids[s : s + t] for s in starts]))
        loss = causal_lm_loss(model, batch)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        if step % 25 == 0 or step == ns.steps - 1:
            recent = float(np.mean(losses[-25:]))
            print(
                f"step {step:4d}  loss {recent:.3f}  {time.perf_counter() - start:6.0f} s",
                flush=True,
            )
    seconds = time.perf_counter() - start
    ppl = held_out_ppl()
    print(
        f"held-out perplexity {ppl:.1f} (random weights {random_ppl:.1f})", flush=True
    )

    hf = config.to_hf()
    hf["dtype"] = ns.dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {n: w.astype(ns.dtype) for n, w in hf_tensors(config, model).items()}
    safetensors.numpy.save_file(
        tensors, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    record = {
        "command": "python tools/train_tiny.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": vars(ns) | {"out": None},
        "corpus_sha256": digest,
        "training_tokens": len(train_ids),
        "held_out_tokens": len(held_ids),
        "parameters": int(sum(x.size for x in tensors.values())),
        "seconds": round(seconds, 1),
        "loss_first_25": float(np.mean(losses[:25])),
        "loss_last_25": float(np.mean(losses[-25:])),
        "held_out_perplexity": ppl,
        "random_weights_held_out_perplexity": random_ppl,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
