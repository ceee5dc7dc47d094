"""structllm's greedy tokens against llama.cpp's, on the same GGUF file.

    python tools/compare_llamacpp_tokens.py --work /work/peers --type Q4_1 \\
        [--type Q8_0 --type Q4_K_M] [--prompts 16] [--max-tokens 64] \\
        [--threads 2] [--llama-variant "-fa off"] [--json OUT.json]

For each ``--type`` the file is SmolLM2-135M-Instruct in that type: the
shipped Q4_1 (the built-in ``smollm2``, ``structllm.models.resolve_model``)
or ``WORK/smollm2-TYPE.gguf`` (``tools/bench_peers.py --real TYPE`` makes
it with ``llama-quantize``). Both engines get the same prompt token ids
(16 chat prompts in the file's own ChatML template, tokenized by
structllm) and decode greedily up to ``--max-tokens`` tokens, stopping at
the end-of-sequence tokens as each does by default (``ignore_eos`` is not
symmetric: llama.cpp's bans the end-of-generation tokens with a -inf logit
bias, structllm's only keeps going past them):

- llama.cpp: ``llama-server`` (``WORK/llama_cpp_python-*/vendor/llama.cpp/
  build/bin/llama-server`` or ``--llama-server``; ``-t N -tb N -np 1 -c
  4096``), one ``/completion`` request a prompt with ``"prompt": [ids]``,
  ``temperature: 0``, ``cache_prompt: false`` and ``n_probs: 2`` (its two
  best log-probabilities a step, from the full distribution). Its
  arithmetic quantizes activations (Q8_0/Q8_1 for the 32-value types,
  Q8_K for the K-quants) before every quantized product.
- structllm: ``LLM(path, quantized_activations=...)`` offline, all prompts
  in one ``generate`` call, ``SamplingParams(temperature=0, logprobs=2)``,
  once with ``float`` activations and once with ``q8`` (llama.cpp's
  quantization: ``quant_kernels.Q8_TYPES`` on Q8_0/Q8_1 blocks, Q4_K and
  Q6_K on Q8_K blocks; Q5_K takes float activations in both runs).

Per prompt it prints where each structllm run first differs from
llama.cpp's tokens (``-`` when never), and at that step the margin between
the two best logits in structllm's run (a log-probability difference is a
logit difference) and in llama.cpp's: both runs have read the same tokens up
to that step, so a small margin there is a near-tie that any reordering of
a float sum may flip. Then, per type and mode: the share of prompts whose
tokens equal llama.cpp's, the share of llama.cpp's token positions matched
before the first difference, and how many first differences were near-ties
(structllm's margin below ``--near-tie``). ``--llama-variant FLAGS`` adds
a second llama.cpp run with those flags, compared with the first the same
way: how far llama.cpp's tokens move under a change of its own arithmetic
(``-fa off``: attention products in float32, not float16), the yardstick
for the q8 run. ``--json`` writes it all, tokens and margins included.
docs/models.md ("Checked against llama.cpp") has the results: SmolLM2's
greedy path runs at margins of a tenth of a logit, so no run, llama.cpp's
second included, keeps llama.cpp's tokens on more than 4 prompts of 16.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

PROMPTS = [
    # tests/data/smollm2_oracle.json's eight (transformers' tokens there)
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to code.",
    "Who wrote Romeo and Juliet?",
    # and eight whose answers run longer
    "Describe how a rainbow forms.",
    "Write a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?",
    "Explain the difference between weather and climate.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "Write a limerick about a cat.",
    "Summarize the plot of Cinderella in three sentences.",
]


# -- the analysis (pure: tests/test_compare_tokens.py) --------------------------


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first step at which ``ours`` and ``theirs`` differ, or None when
    they are equal. When one is a prefix of the other, the step after the
    shorter one: there one engine stopped (end of sequence) and the other
    went on."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    if len(ours) == len(theirs):
        return None
    return min(len(ours), len(theirs))


def top2_margin(step: Mapping[int, float] | None) -> float | None:
    """The gap between the two best log-probabilities of one step (equal to
    the gap between their logits), or None without two of them."""
    if step is None or len(step) < 2:
        return None
    best, second = sorted(step.values(), reverse=True)[:2]
    return best - second


def strip_stop(tokens: Sequence[int], stop_ids: frozenset[int]) -> list[int]:
    """``tokens`` without a final end-of-sequence token (structllm returns
    it; llama.cpp's ``tokens`` may not)."""
    if tokens and tokens[-1] in stop_ids:
        return list(tokens[:-1])
    return list(tokens)


@attrs.frozen
class PromptComparison:
    """One prompt: structllm's tokens against llama.cpp's."""

    divergence: int | None
    """first differing step (None: the same tokens)"""
    matched: int
    """llama.cpp's tokens matched before ``divergence`` (all when None)"""
    total: int
    """llama.cpp's token count"""
    margin: float | None
    """structllm's top-2 margin at ``divergence``"""
    llama_margin: float | None
    """llama.cpp's top-2 margin at ``divergence``"""


def compare_prompt(
    ours: Sequence[int],
    theirs: Sequence[int],
    our_steps: Sequence[Mapping[int, float] | None],
    their_steps: Sequence[Mapping[int, float] | None],
) -> PromptComparison:
    """Compare one prompt's tokens (end-of-sequence stripped); ``*_steps``
    hold each engine's best log-probabilities a step (the stop step
    included, so a step at which one engine stopped has a margin)."""
    at = first_divergence(ours, theirs)

    def margin(steps: Sequence[Mapping[int, float] | None]) -> float | None:
        return top2_margin(steps[at]) if at is not None and at < len(steps) else None

    return PromptComparison(
        divergence=at,
        matched=len(theirs) if at is None else at,
        total=len(theirs),
        margin=margin(our_steps),
        llama_margin=margin(their_steps),
    )


@attrs.frozen
class Agreement:
    """How one structllm run agreed with llama.cpp over all prompts."""

    prompts: int
    identical: int
    """prompts whose tokens equal llama.cpp's"""
    positions: float
    """share of llama.cpp's token positions matched before the first
    difference"""
    near_ties: int
    """first differences where structllm's top-2 margin < the threshold"""
    margins: tuple[float | None, ...]
    """structllm's margin at each first difference, prompt order"""

    @property
    def divergent(self) -> int:
        return self.prompts - self.identical


def agreement(rows: Sequence[PromptComparison], near_tie: float) -> Agreement:
    """Sum ``rows`` up; a first difference is a near-tie when structllm's
    margin there is below ``near_tie``."""
    total = sum(r.total for r in rows)
    margins = tuple(r.margin for r in rows if r.divergence is not None)
    return Agreement(
        prompts=len(rows),
        identical=sum(r.divergence is None for r in rows),
        positions=sum(r.matched for r in rows) / total if total else 1.0,
        near_ties=sum(m is not None and m < near_tie for m in margins),
        margins=margins,
    )


# -- llama.cpp -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post(url: str, body: dict[str, Any], timeout: float = 600) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@contextmanager
def open_llama_server(
    binary: Path, gguf: Path, threads: int, extra: Sequence[str] = ()
) -> Iterator[str]:
    """``llama-server`` on ``gguf``, one slot, until its /health answers; its
    base URL. Stopped (terminate, then kill) on exit."""
    port = free_port()
    t = str(threads)
    cmd = [str(binary), "-m", str(gguf), "-t", t, "-tb", t, "-np", "1"]
    cmd += ["-c", "4096", "--host", "127.0.0.1", "--port", str(port), *extra]
    log = open(Path(f"/tmp/llama-server-{port}.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({proc.returncode}): {log.name}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def llama_greedy(
    url: str, prompts: Sequence[list[int]], max_tokens: int
) -> list[tuple[list[int], list[dict[int, float] | None]]]:
    """llama.cpp's greedy tokens and each step's two best log-probabilities."""
    out = []
    for ids in prompts:
        body = {
            "prompt": ids,
            "n_predict": max_tokens,
            "temperature": 0,
            "cache_prompt": False,
            "n_probs": 2,
            "return_tokens": True,
        }
        reply = post(f"{url}/completion", body)
        steps: list[dict[int, float] | None] = [
            {int(p["id"]): float(p["logprob"]) for p in step["top_logprobs"]}
            for step in reply["completion_probabilities"]
        ]
        out.append(([int(t) for t in reply["tokens"]], steps))
    return out


# -- structllm -------------------------------------------------------------------


def structllm_greedy(
    gguf: Path,
    prompts: Sequence[list[int]],
    max_tokens: int,
    activations: str,
    threads: int,
) -> tuple[list[tuple[list[int], list[dict[int, float] | None]]], frozenset[int]]:
    """structllm's greedy tokens and two best log-probabilities a step, all
    prompts in one batch; and its end-of-sequence ids."""
    from structllm import LLM, SamplingParams

    llm = LLM(
        str(gguf),
        quantized_activations=activations,
        max_model_len=256,
        max_num_seqs=len(prompts),
        num_threads=threads,
        show_progress=False,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    runs = []
    for request in outputs:
        out = request.outputs[0]
        steps: list[dict[int, float] | None] = [
            None if s is None else {i: lp.logprob for i, lp in s.items()}
            for s in out.logprobs or ()
        ]
        runs.append((list(out.token_ids), steps))
    return runs, llm.eos_token_ids


def q8_share(gguf: Path) -> tuple[int, int]:
    """(projections whose weights q8 activations reach, all quantized
    projections) in ``gguf``: Q5_K takes float activations."""
    from structllm.formats.gguf import GGUFFile
    from structllm.model.quant_kernels import MATMUL_TYPES, Q8_TYPES, Q8K_TYPES

    with GGUFFile.open(gguf) as f:
        kinds = [t.type for n, t in f.tensors.items() if n.startswith("blk.")]
    quantized = [k for k in kinds if k in MATMUL_TYPES and k.name != "F32"]
    return sum(k in Q8_TYPES or k in Q8K_TYPES for k in quantized), len(quantized)


# -- the run ---------------------------------------------------------------------


def llama_server_binary(work: Path) -> Path:
    found = sorted(
        work.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server")
    )
    if not found:
        raise SystemExit(
            f"no llama-server under {work} (tools/bench_peers.py builds it)"
        )
    return found[-1]


def gguf_for(kind: str, work: Path) -> Path:
    if kind == "Q4_1":
        from structllm.models import SMOLLM2, resolve_model

        shipped = resolve_model(SMOLLM2)
        assert shipped is not None
        return shipped
    path = work / f"smollm2-{kind}.gguf"
    if not path.is_file():
        raise SystemExit(f"{path} is missing (tools/bench_peers.py --real {kind})")
    return path


def chat_prompts(gguf: Path, n: int) -> list[list[int]]:
    from structllm.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gguf)
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}]),
            add_special_tokens=False,
        )
        for text in PROMPTS[:n]
    ]


def fmt(margin: float | None) -> str:
    return "-" if margin is None else f"{margin:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/work/peers"))
    parser.add_argument("--type", action="append", dest="types", required=True)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--near-tie", type=float, default=1e-2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--llama-variant",
        default="",
        help="llama-server flags of a second llama.cpp run compared with the "
        "first (e.g. '-fa off'): llama.cpp's tokens against its own",
    )
    parser.add_argument(
        "--llama-arg", action="append", default=[], help="a flag for llama-server"
    )
    ns = parser.parse_args()
    if not 1 <= ns.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be 1 to {len(PROMPTS)}")
    binary = ns.llama_server or llama_server_binary(ns.work)
    report: dict[str, Any] = {"near_tie": ns.near_tie, "prompts": PROMPTS[: ns.prompts]}
    summary = []
    for kind in ns.types:
        gguf = gguf_for(kind, ns.work)
        prompts = chat_prompts(gguf, ns.prompts)
        with open_llama_server(binary, gguf, ns.threads, ns.llama_arg) as url:
            theirs = llama_greedy(url, prompts, ns.max_tokens)
        reached, quantized = q8_share(gguf)
        entry: dict[str, Any] = {
            "file": str(gguf),
            "q8_projections": [reached, quantized],
        }
        entry["llama.cpp"] = [tokens for tokens, _ in theirs]
        runs: dict[str, list[tuple[list[int], list[dict[int, float] | None]]]] = {}
        stop: frozenset[int] = frozenset()
        for activations in ("float", "q8"):
            runs[activations], stop = structllm_greedy(
                gguf, prompts, ns.max_tokens, activations, ns.threads
            )
        if ns.llama_variant:
            # llama.cpp against itself: how far its own tokens move when
            # only its attention's precision does
            variant = shlex.split(ns.llama_variant)
            with open_llama_server(binary, gguf, ns.threads, variant) as url:
                runs[f"llama.cpp {ns.llama_variant}"] = llama_greedy(
                    url, prompts, ns.max_tokens
                )
        for label, ours in runs.items():
            rows = [
                compare_prompt(
                    strip_stop(o, stop), strip_stop(t, stop), o_steps, t_steps
                )
                for (o, o_steps), (t, t_steps) in zip(ours, theirs, strict=True)
            ]
            total = agreement(rows, ns.near_tie)
            print(f"\n{kind} ({reached}/{quantized} projections q8-able), {label}:")
            for text, row in zip(PROMPTS, rows, strict=False):
                where = "-" if row.divergence is None else str(row.divergence)
                print(
                    f"  {where:>3}/{row.total:<3} margin {fmt(row.margin):>6} "
                    f"llama.cpp {fmt(row.llama_margin):>6}  {text}"
                )
            print(
                f"  identical {total.identical}/{total.prompts}, positions "
                f"{total.positions:.1%}, near-ties {total.near_ties}/{total.divergent}"
            )
            entry[label] = {
                "tokens": [o for o, _ in ours],
                "rows": [attrs.asdict(r) for r in rows],
                "agreement": attrs.asdict(total),
            }
            summary.append((kind, label, reached, quantized, total))
        report[kind] = entry
    print(
        "\n| file | run | q8 reaches | identical | positions | "
        f"near-ties (< {ns.near_tie:g}) | median margin |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, label, reached, quantized, total in summary:
        known = [m for m in total.margins if m is not None]
        median = fmt(statistics.median(known)) if known else "-"
        print(
            f"| {kind} | {label} | {reached}/{quantized} | "
            f"{total.identical}/{total.prompts} | {total.positions:.1%} | "
            f"{total.near_ties}/{total.divergent} | {median} |"
        )
    if ns.json is not None:
        ns.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
