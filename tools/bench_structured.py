"""Structured output in the engine: step time and first-token latency.

    PYTHONPATH=src python tools/bench_structured.py [--tokenizer DIR] [--rounds 5]

1. Decode step time, 16 constrained requests vs 16 unconstrained, in one
   process: two engine cores of the same model, one running the free batch
   and one the constrained batch, stepped in alternation (A B, B A, ...),
   so that both see the same machine load (it is shared and noisy; whole
   A and B runs one after the other differed by up to 1.5x either way).
   Per pair of decode steps (all 16 decoding): the ratio of wall times
   (``StepOutput.total_s``), and the engine's own work
   (``total_s - forward_s``: scheduling, mask fill and apply, sampling,
   grammar updates) over the free step. Each constrained request follows a
   JSON Schema of 24 required string fields, longer than ``--tokens``
   whatever the model writes, so all 16 decode to the end.
2. Time to first token of one request alone: a schema never seen (compile in
   the core's thread), the same schema again (the cache), no schema; and the
   engine's first constrained request (which also builds the vocabulary).

The model is the 27.8M bench checkpoint (``write_bench_checkpoint``, vocab
524). With ``--tokenizer DIR`` (a ``tokenizer.json`` directory, e.g. the
32k BPE ``tools/bench_grammar_libs.py --train`` writes) the same shape gets
that vocabulary, with random ("dummy") weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers

from structllm.bench.model import write_bench_checkpoint
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.params import SamplingParams
from structllm.structured import StructuredOutputs


def schema(tag: str, fields: int = 24) -> StructuredOutputs:
    names = [f"{tag}_{i:02d}" for i in range(fields)]
    return StructuredOutputs(
        json={
            "type": "object",
            "properties": {
                n: {"type": "string", "minLength": 8, "maxLength": 16} for n in names
            },
            "required": names,
            "additionalProperties": False,
        }
    )


def checkpoint(
    tmp: Path, tokenizer: Path | None, shape: dict[str, int] | None = None
) -> tuple[str, str]:
    """(model directory, load_format); ``shape``: write_bench_checkpoint's sizes."""
    model = tmp / "model"
    write_bench_checkpoint(model, **(shape or {}))
    if tokenizer is None:
        return str(model), "auto"
    config = json.loads((model / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    if eos is None:
        eos = tok.token_to_id("<|endoftext|>")
    config.update(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_token_id=eos,
        bos_token_id=None,
    )
    big = tmp / "big-vocab"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, big / name)
    return str(big), "dummy"


def add_batch(
    core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
) -> None:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(
            CoreRequest(request_id=f"r{i}", prompt_token_ids=tuple(p), params=sp)
        )


def paired_steps(
    free: EngineCore, constrained: EngineCore, n: int, first: str
) -> list[tuple[float, float, float, float]]:
    """Step both cores in alternation to the end; for each pair of steps
    that decode all ``n``: (free total, constrained total, free engine
    work, constrained engine work), seconds."""
    pairs = []
    order = [free, constrained] if first == "A" else [constrained, free]
    while free.has_unfinished_requests() or constrained.has_unfinished_requests():
        steps = {id(core): core.step() for core in order}
        order.reverse()
        a, b = steps[id(free)], steps[id(constrained)]
        if all(s.num_seqs == n == s.num_batched_tokens for s in (a, b)):
            pairs.append(
                (a.total_s, b.total_s, a.total_s - a.forward_s, b.total_s - b.forward_s)
            )
    return pairs


def first_token_s(core: EngineCore, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    core.add_request(
        CoreRequest(request_id="ttft", prompt_token_ids=tuple(prompt), params=params)
    )
    while True:
        step = core.step()
        if step.rejected:  # else this would wait for ever
            raise RuntimeError(step.rejected[0].message)
        if any(o.request_id == "ttft" for o in step.outputs):
            took = time.perf_counter() - start
            core.abort_requests(["ttft"])
            return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--shape",
        type=int,
        nargs=5,
        metavar=("HIDDEN", "LAYERS", "HEADS", "KV_HEADS", "INTERMEDIATE"),
        help="the model's sizes (default: the 27.8M bench model's; Qwen2-0.5B's "
        "are 896 24 14 2 4864)",
    )
    ns = parser.parse_args()
    shape = None
    if ns.shape:
        names = ("hidden", "layers", "heads", "kv_heads", "intermediate")
        shape = dict(zip(names, ns.shape, strict=True))
    with tempfile.TemporaryDirectory() as tmp:
        model, load_format = checkpoint(Path(tmp), ns.tokenizer, shape)
        config = EngineConfig(
            model=model,
            load_format=load_format,
            max_num_seqs=ns.requests,
            max_model_len=1024,
            num_threads=ns.threads,
        )
        core_a, core = EngineCore(config), EngineCore(config)
        vocab = core.vocab_size
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, vocab, 32).tolist() for _ in range(ns.requests)]
        free = [
            SamplingParams(max_tokens=ns.tokens, ignore_eos=True, seed=i)
            for i in range(ns.requests)
        ]
        so = schema("field")
        constrained = [
            SamplingParams(max_tokens=ns.tokens, seed=i, structured_outputs=so)
            for i in range(ns.requests)
        ]
        first = first_token_s(core, prompts[0], constrained[0])
        rows = []
        for r in range(ns.rounds + 1):  # the first round warms both up
            add_batch(core_a, prompts, free)
            add_batch(core, prompts, constrained)
            pairs = paired_steps(core_a, core, ns.requests, "AB"[r % 2])
            if r:
                rows.append(pairs)
        print(f"model {model} (vocab {vocab}), {ns.requests} requests")
        print(
            "round  free ms  constrained ms  ratio  engine work free/constr ms  pairs"
        )
        ratios, extra = [], []
        for r, pairs in enumerate(rows):
            a, b, wa, wb = (
                statistics.median(x) * 1e3 for x in zip(*pairs, strict=True)
            )
            ratios += [pb / pa for pa, pb, _, _ in pairs]
            extra += [(xb - xa) / pa for pa, _, xa, xb in pairs]
            print(
                f"{r:5d} {a:8.2f} {b:15.2f} {b / a:6.3f} {wa:15.2f} / {wb:5.2f} {len(pairs):6d}"
            )
        print(
            f"median over {len(ratios)} step pairs: constrained / free "
            f"{statistics.median(ratios):.3f}; engine work added by the grammars, "
            f"over the free step: {statistics.median(extra):.1%}"
        )

        new, cached, plain = [], [], []
        for r in range(2 * ns.rounds + 1):
            fresh = SamplingParams(max_tokens=4, structured_outputs=schema(f"n{r}"))
            new.append(first_token_s(core, prompts[1], fresh))
            cached.append(first_token_s(core, prompts[1], fresh))
            plain.append(first_token_s(core, prompts[1], SamplingParams(max_tokens=4)))
        print(
            "first token, ms (median of "
            f"{len(new)}): new schema {statistics.median(new) * 1e3:.2f}, "
            f"cached {statistics.median(cached) * 1e3:.2f}, "
            f"unconstrained {statistics.median(plain) * 1e3:.2f}; "
            f"the engine's first constrained request {first * 1e3:.1f}"
        )
        core.close()
        core_a.close()


if __name__ == "__main__":
    main()
