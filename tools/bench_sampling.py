# Usage:
#   python tools/bench_sampling.py MODEL [--streams 16] [--tokens 100]
#       [--threads 2]
"""What sampling costs a decode step next to the model, under the settings
clients send (the serving benchmarks are greedy).

``LLM.generate`` of STREAMS prompts, TOKENS tokens each, once per setting
(greedy; temperature 1; temperature 1 with top-p 0.95; temperature 0.7
with top-p 0.9 and top-k 50; top-k 40; temperature 0.8 with top-p 0.95
and min-p 0.05; greedy with the top 20 logprobs). Over the steps that
sample every stream: the median of the runner's model time (the forward
and the logits) and of its sampling time (``RunnerOutput.forward_s`` and
``sample_s``), and the sampling's share of the two.
"""

from __future__ import annotations

import argparse

import numpy as np

from structllm import LLM, SamplingParams
from structllm.core import runner as runner_module

SETTINGS = {
    "greedy": {"temperature": 0},
    "T=1": {"temperature": 1.0},
    "T=1 top_p=0.95": {"temperature": 1.0, "top_p": 0.95},
    "T=0.7 top_p=0.9 top_k=50": {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
    "T=1 top_k=40": {"temperature": 1.0, "top_k": 40},
    "T=0.8 top_p=0.95 min_p=0.05": {"temperature": 0.8, "top_p": 0.95, "min_p": 0.05},
    "greedy, logprobs=20": {"temperature": 0, "logprobs": 20},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, num_threads=args.threads, max_model_len=1024)
    steps: list[tuple[float, float, int]] = []
    execute = runner_module.ModelRunner.execute

    def timed(self: runner_module.ModelRunner, step: object) -> object:
        out = execute(self, step)  # type: ignore[arg-type]
        steps.append((out.forward_s, out.sample_s, len(out.sampled)))
        return out

    runner_module.ModelRunner.execute = timed  # type: ignore[assignment]
    prompts = [f"Write a story, number {i}, about a lighthouse." for i in range(16)]
    prompts = (prompts * -(-args.streams // 16))[: args.streams]
    print(f"{args.model}: {args.streams} streams, {args.tokens} tokens each")
    for name, setting in SETTINGS.items():
        params = SamplingParams(
            max_tokens=args.tokens, ignore_eos=True, seed=1, **setting
        )
        steps.clear()
        llm.generate(prompts, params, use_tqdm=False)
        full = np.array([s[:2] for s in steps if s[2] == args.streams])
        model, sample = 1e3 * np.median(full, axis=0)
        print(
            f"{name:30} model {model:6.2f} ms  sampling {sample:6.2f} ms "
            f"({100 * sample / (model + sample):4.1f}% of the two)",
            flush=True,
        )


if __name__ == "__main__":
    main()
