"""LoRA through the engine: 16 requests over 4 adapters against 16 on the
base model alone, side by side (issue 31's figure).

    PYTHONPATH=src .venv/bin/python tools/bench_lora_engine.py [--model smollm2]

Writes 4 random rank-``--rank`` PEFT adapters (every projection) for the
model into a temporary directory, then runs, ``--rounds`` times in turn,
``LLM.generate`` of ``--requests`` prompts of ``--prompt-len`` random
tokens and ``--max-tokens`` greedy outputs each (EOS ignored): once on the
base model, once with the requests spread over the adapters. Reports the
output tokens per second of each run and the ratio of the medians (after
one warm-up run of each: the kernels' first compiles, the adapters' slots).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from structllm import LLM, LoRARequest, SamplingParams
from structllm.bench.lora import write_random_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
        show_progress=False,
    )
    rng = np.random.default_rng(0)
    vocab = llm.core.vocab_size
    prompts = [
        rng.integers(100, vocab, size=args.prompt_len).tolist()
        for _ in range(args.requests)
    ]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(args.adapters):
            d = Path(tmp) / f"adapter-{i}"
            write_random_adapter(d, llm.core.model_config, rank=args.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(d)))
            llm.add_lora(loras[-1])
        spread = [loras[i % len(loras)] for i in range(args.requests)]
        runs: dict[str, list[float]] = {"base": [], "lora": []}
        # warm-up: the kernels' first compiles, every adapter in its slot
        for choice in (None, spread):
            llm.generate(prompts, params, lora_request=choice, use_tqdm=False)
        for _ in range(args.rounds):
            for kind, choice in (("base", None), ("lora", spread)):
                start = time.perf_counter()
                outs = llm.generate(
                    prompts, params, lora_request=choice, use_tqdm=False
                )
                took = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                runs[kind].append(tokens / took)
                print(f"{kind}: {tokens / took:.1f} output tok/s ({took:.2f} s)")
    base, lora = statistics.median(runs["base"]), statistics.median(runs["lora"])
    print(
        f"median: base {base:.1f} tok/s, {args.adapters} adapters {lora:.1f} tok/s "
        f"({lora / base:.2f}x)"
    )


if __name__ == "__main__":
    main()
