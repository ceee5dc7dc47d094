# Usage:
#   python tools/fidelity.py REF.gguf [OTHER.gguf ...] [--chunks 16] [--ctx 256]
#       [--threads 2] [--out docs/results/NAME.json]
"""How far an arithmetic setting moves a GGUF model's predictions: the
statistics llama.cpp's ``llama-perplexity --kl-divergence`` reports.

Text: ``tools/tiny_corpus/docstrings.txt`` (English prose from Python's
docstrings), tokenized by the first file's tokenizer (every file must give
the same ids) and cut into its first CHUNKS windows of CTX tokens. Each
window is one prefill, scored as ``llama-perplexity`` scores it: at each
position of its second half (every token predicted from at least CTX/2
tokens), the next-token distribution against the reference's.

The reference is the first file with float activations and a float32 KV
cache: the float32 product with its exactly dequantized weights, which the
real-model tier checks against transformers at 1e-4. Every file is run
with float and q8 activations (``quantized_activations``) over a float32
and a float16 cache. Per setting: perplexity, the mean and 99th percentile
of KL(reference || setting), how often both pick the same top token, and
the KL and top-token agreement against the same file's own float32 run
("own"; for another file of the same model, what its weights' quantization
moved is in the first columns and not in these).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from structllm.core.runner import ModelInput, run_forward
from structllm.model import quantized
from structllm.model._paddle import set_num_threads
from structllm.model.loader import load_model
from structllm.text.tokenizer import load_tokenizer

CORPUS = Path(__file__).parent / "tiny_corpus" / "docstrings.txt"
SETTINGS = (
    ("float", "float32"),
    ("float", "float16"),
    ("q8", "float32"),
    ("q8", "float16"),
)


def windows(path: Path, chunks: int, ctx: int) -> list[list[int]]:
    """The corpus's first CHUNKS windows of CTX tokens (``llama-perplexity``'s)."""
    ids = load_tokenizer(path).encode(CORPUS.read_text(), add_special_tokens=False)
    if len(ids) < chunks * ctx:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than {chunks * ctx}")
    return [ids[i * ctx : (i + 1) * ctx] for i in range(chunks)]


def log_probs(model: Any, ids: list[int], acts: str, kv: str) -> np.ndarray:
    """Every position's next-token log-probabilities (float64) for one prefill,
    run as the engine runs a step (``runner.run_forward``)."""
    quantized.set_activations(model.weights.linears(), acts)
    model.set_kv_cache_dtype(kv)
    blocks = (len(ids) + 15) // 16
    step = ModelInput(
        np.array(ids, np.int64).tobytes(),
        np.arange(len(ids), dtype=np.int64).tobytes(),
        ((0, len(ids), tuple(range(blocks))),),
    )
    hidden = run_forward(model, model.allocate_kv_cache(blocks), step)
    logits = model.compute_logits(hidden).numpy().astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def kl_divergence(ref: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """KL(ref || lp) per row of two (rows, vocab) log-probability arrays."""
    return (np.exp(ref) * (ref - lp)).sum(axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    set_num_threads(args.threads)
    texts = windows(args.files[0], args.chunks, args.ctx)
    models = {
        f: load_model(f, num_threads=args.threads, max_model_len=args.ctx).model
        for f in args.files
    }
    for f in args.files[1:]:
        if windows(f, args.chunks, args.ctx) != texts:
            raise SystemExit(f"{f} tokenizes the corpus otherwise than {args.files[0]}")
    keys = [(f, acts, kv) for f in args.files for acts, kv in SETTINGS]
    nll: dict[Any, list[float]] = {k: [] for k in keys}
    kld: dict[Any, list[np.ndarray]] = {k: [] for k in keys}
    same: dict[Any, list[np.ndarray]] = {k: [] for k in keys}
    own_kld: dict[Any, list[np.ndarray]] = {k: [] for k in keys}
    own_same: dict[Any, list[np.ndarray]] = {k: [] for k in keys}
    half = args.ctx // 2
    for n, ids in enumerate(texts, 1):
        ref = own = None
        for key in keys:
            lp = log_probs(models[key[0]], ids, key[1], key[2])
            if ref is None:
                ref = lp
            if key[1:] == SETTINGS[0]:
                own = lp
            assert own is not None
            targets = np.array(ids[half + 1 :])
            nll[key].extend(-lp[np.arange(half, len(ids) - 1), targets])
            lp, r, o = lp[half:-1], ref[half:-1], own[half:-1]
            kld[key].append(kl_divergence(r, lp))
            same[key].append(r.argmax(axis=1) == lp.argmax(axis=1))
            own_kld[key].append(kl_divergence(o, lp))
            own_same[key].append(o.argmax(axis=1) == lp.argmax(axis=1))
        print(f"window {n}/{len(texts)}", flush=True)
    rows = []
    for key in keys:
        k = np.concatenate(kld[key])
        rows.append(
            {
                "file": key[0].name,
                "activations": key[1],
                "kv_cache": key[2],
                "ppl": math.exp(float(np.mean(nll[key]))),
                "kld_mean": float(k.mean()),
                "kld_p99": float(np.quantile(k, 0.99)),
                "same_top": float(np.concatenate(same[key]).mean()),
                "kld_mean_own": float(np.concatenate(own_kld[key]).mean()),
                "same_top_own": float(np.concatenate(own_same[key]).mean()),
            }
        )
    print(f"{len(texts)} windows of {args.ctx} tokens; reference: {keys[0]}")
    print("own: against the same file with float activations and a float32 cache")
    print(
        f"{'file':40} {'acts':5} {'kv':7} {'PPL':>8} {'KLD mean':>9} {'KLD p99':>8} "
        f"{'same top':>8} {'own KLD':>9} {'own top':>8}"
    )
    for r in rows:
        print(
            f"{r['file']:40} {r['activations']:5} {r['kv_cache']:7} {r['ppl']:8.4f} "
            f"{r['kld_mean']:9.6f} {r['kld_p99']:8.5f} {100 * r['same_top']:7.2f}% "
            f"{r['kld_mean_own']:9.6f} {100 * r['same_top_own']:7.2f}%"
        )
    if args.out:
        meta = {"chunks": args.chunks, "ctx": args.ctx, "corpus": CORPUS.name}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
