"""Prefill steps of a model, offline: tokens a second for each batch shape.

    python tools/bench_prefill_steps.py MODEL [SPEC ...] [--threads 2] [--rounds 2]
        [--quantized-activations q8]

A SPEC is ``NxL``: N prompts of L random token ids, prefilled in one
``LLM.generate`` (``max_tokens=1``, greedy, prefix caching off, so every
round computes every token). Default specs: ``1x136 8x128 16x136 1x1024``,
the first of each shape a warm-up that is also printed. Prints the wall
time and tokens a second of each round.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("specs", nargs="*", default=["1x136", "8x128", "16x136", "1x1024"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quantized-activations", default="float", choices=["float", "q8"])
    ns = p.parse_args()
    from structllm import LLM, SamplingParams

    llm = LLM(
        ns.model,
        show_progress=False,
        num_threads=ns.threads,
        enable_prefix_caching=False,
        quantized_activations=ns.quantized_activations,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    for spec in ns.specs:
        n, length = map(int, spec.split("x"))
        for round_ in range(ns.rounds):
            prompts = [
                {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]}
                for _ in range(n)
            ]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            took = time.perf_counter() - start
            print(
                f"{spec} round {round_}: {took * 1000:.0f} ms, "
                f"{n * length / took:.0f} tokens/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
