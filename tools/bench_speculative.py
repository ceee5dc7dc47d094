"""Speculative decoding against none, side by side: ``structllm bench
speculative`` (:mod:`structllm.bench.speculative`), kept under its old name
for the commands in docs/benchmarks.md.

    PYTHONPATH=src python tools/bench_speculative.py single [--rounds 3]
    PYTHONPATH=src python tools/bench_speculative.py batch [--clients 1 4 16]
    PYTHONPATH=src python tools/bench_speculative.py crossover [--model smollm2]
"""

from __future__ import annotations

import argparse

from structllm.bench.speculative import add_speculative_args, run_speculative


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_speculative_args(p)
    return run_speculative(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
