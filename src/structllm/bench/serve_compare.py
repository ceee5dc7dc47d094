"""``structllm bench serve --server/--launch``: one workload, several servers.

Each target gets the same workload (:class:`~structllm.bench.serve.ServeConfig`
with its url, and its model unless ``--model`` names one), one target at a
time, in ``--rounds`` rounds. Round ``r`` (from 0) sends the workload of
seed ``seed + r`` to every target, starting with target ``r mod n``: a
slow drift of the machine's speed then falls on every target alike, and no
server sees a prompt twice (a prefix cache would make a repeat cheap).
Before each run a target gets ``--warmup`` short requests that are not
counted. ``--lora-modules`` spreads the requests over LoRA adapters on
the targets ``--lora-targets`` names (all by default; ``lora_targets`` of
:func:`run_comparison`); the others get the same prompts on their base
model. The warm-up requests go round the adapters (``--warmup`` at least
their number puts each in the engine's slots before the run). A launched
target is started for its run and stopped after it
(:mod:`structllm.bench.serve_targets`, which also measures memory); one
that does not come up ends the comparison, whose finished runs are still
printed and written. With ``--keep-up`` (``keep_up``) every launched target
starts once, before the first round, and stays up until the last one ends:
rounds then cost no start-up, so many short ones put each target's runs
seconds apart rather than minutes, and a machine whose speed wanders (a
VM's vCPUs moving between the host's cores) moves every target's figures
alike; its memory figures are then each process's peak over all its runs.

The table gives, per target, each figure's median over the rounds, then the
ratios to the first target: in each round a figure over the first target's
in that round, the median of those. Where any target speculated, it also
gives each one's acceptance rate and proposed / accepted tokens, from its
``/metrics`` before and after each run (n/a for a server without those
counters); they are not compared. ``--json`` writes::

    {"config":  ServeConfig fields but url and model (they are per run),
     "rounds":  R,
     "targets": [{"name", "url", "command"}],
     "runs":    [{"target", "round", "url", "model", "lora_modules", "seed",
                  "summary", "memory", "requests"}],
     "median":  {target: {figure: value}},
     "ratio":   {target: {figure: ratio to the first target}}}
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import anyio
import attrs
import httpx

from structllm.bench.serve import (
    ServeConfig,
    make_requests,
    request_body,
    run_benchmark,
)
from structllm.bench.serve_client import (
    Progress,
    discover_model,
    open_client,
    stream_request,
)
from structllm.bench.serve_results import BenchmarkResult
from structllm.bench.serve_table import FIGURES, Comparison, Run
from structllm.bench.serve_targets import (
    LaunchError,
    MemoryReport,
    Running,
    Target,
    check_lora_targets,
    open_target,
    until_signalled,
)

__all__ = [
    "FIGURES",
    "Comparison",
    "ComparisonStopped",
    "Run",
    "add_compare_args",
    "run_compare",
    "run_comparison",
]

# -- running --------------------------------------------------------------------


async def _warm_up(
    client: httpx.AsyncClient, config: ServeConfig, model: str, count: int
) -> str | None:
    """``count`` short requests (prompts of their own seed), not measured,
    going round the LoRA adapters; the first error, if any."""
    warm = attrs.evolve(config, num_prompts=count, seed=config.seed + 2**31)
    names = config.lora_modules
    for i, spec in enumerate(make_requests(warm)):
        adapter = names[i % len(names)] if names else None
        body = request_body(
            attrs.evolve(spec, max_tokens=4, model=adapter), config, model
        )
        seen = Progress()
        await stream_request(client, config.url + config.endpoint, body, 0.0, seen)
        if seen.error is not None:
            return seen.error
    return None


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ComparisonStopped(Exception):
    """The comparison could not go on; ``partial`` holds the runs it finished."""

    def __init__(self, message: str, partial: Comparison) -> None:
        super().__init__(message)
        self.partial = partial


async def run_comparison(
    config: ServeConfig,
    targets: Sequence[Target],
    *,
    rounds: int = 1,
    warmup: int = 1,
    startup_timeout: float = 600.0,
    lora_targets: Collection[str] | None = None,
    keep_up: bool = False,
    log: Callable[[str], None] = _log,
) -> Comparison:
    """Run ``config``'s workload against every target, ``rounds`` times;
    ``config.lora_modules`` only on ``lora_targets`` (None: on all);
    launched targets started for each run, or with ``keep_up`` once for all.

    Request failures are counted in the runs. A launched target that does
    not come up, or a server whose model cannot be found, stops the
    comparison: :class:`ComparisonStopped`, with the runs finished so far.
    """
    if not targets or len({t.name for t in targets}) != len(targets):
        raise ValueError(f"targets need distinct names: {[t.name for t in targets]}")
    check_lora_targets(lora_targets, [t.name for t in targets], config.lora_modules)
    configs = {
        t.name: config
        if lora_targets is None or t.name in lora_targets
        else attrs.evolve(config, lora_modules=())
        for t in targets
    }
    runs: list[Run] = []
    try:
        await _run_rounds(
            configs, targets, runs, rounds, warmup, startup_timeout, keep_up, log
        )
    except (LaunchError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        partial = Comparison(tuple(targets), rounds, tuple(runs))
        raise ComparisonStopped(str(exc) or repr(exc), partial) from exc
    return Comparison(tuple(targets), rounds, tuple(runs))


async def _run_rounds(
    configs: dict[str, ServeConfig],
    targets: Sequence[Target],
    runs: list[Run],
    rounds: int,
    warmup: int,
    startup_timeout: float,
    keep_up: bool,
    log: Callable[[str], None],
) -> None:
    """Every round's runs, appended to ``runs`` as each one ends."""
    n = len(targets)
    async with open_client() as client, contextlib.AsyncExitStack() as stack:
        up: dict[str, Running] = {}
        if keep_up:  # all up before the first round, stopped after the last
            for target in targets:
                # a --server target is already running: only checked here
                what = "checking" if target.url else "starting"
                log(f"{what} {target.name} ({target.url or target.command})")
                up[target.name] = await stack.enter_async_context(
                    open_target(target, client, startup_timeout=startup_timeout)
                )
        for r in range(rounds):
            order = [*targets[r % n :], *targets[: r % n]]
            for target in order:
                config = configs[target.name]
                where = target.url or target.command
                log(f"round {r + 1}/{rounds}: {target.name} ({where})")
                if config.lora_modules:
                    log(f"  requests over adapters {' '.join(config.lora_modules)}")
                started = time.perf_counter()
                async with contextlib.AsyncExitStack() as run_stack:
                    running = up.get(target.name)
                    if running is None:  # started for this run, stopped after it
                        running = await run_stack.enter_async_context(
                            open_target(target, client, startup_timeout=startup_timeout)
                        )
                    result, memory = await _run(client, running, config, r, warmup, log)
                s = result.summary
                log(
                    f"  {s.completed} ok, {s.failed} failed, "
                    f"{s.output_throughput:.1f} output tok/s "
                    f"({time.perf_counter() - started:.0f} s"
                    f"{'' if keep_up else ' with start and stop'})"
                )
                if errors := [q.error for q in result.requests if q.error]:
                    top = max(set(errors), key=errors.count)  # the commonest
                    log(f"  {errors.count(top)} x {top}")
                runs.append(Run(target.name, r, result, memory))


async def _run(
    client: httpx.AsyncClient,
    up: Running,
    config: ServeConfig,
    r: int,
    warmup: int,
    log: Callable[[str], None],
) -> tuple[BenchmarkResult, MemoryReport]:
    """Round ``r``'s run on a target that is up: its warm-up requests, the
    workload of seed ``config.seed + r``, then its memory."""
    cfg = attrs.evolve(config, url=up.url, seed=config.seed + r)
    model = cfg.model or await discover_model(client, up.url)
    cfg = attrs.evolve(cfg, model=model)
    if warmup:
        error: str | None = f"timed out after {cfg.timeout:g} s"
        with anyio.move_on_after(cfg.timeout):
            error = await _warm_up(client, cfg, model, warmup)
        if error:
            log(f"  warm-up request failed: {error}")
    result = await run_benchmark(cfg)
    return result, await up.memory(client)


# -- the command ----------------------------------------------------------------


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """``bench serve``'s flags for several servers (:func:`run_compare`)."""
    g = p.add_argument_group(
        "comparing servers",
        "The same workload against several servers, one at a time, in one table "
        "(instead of --url); see docs/benchmarks.md.",
    )
    g.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a running server to compare (repeatable)",
    )
    g.add_argument(
        "--launch",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="a server command line to start for each run and stop after it, "
        "{port} replaced by a free port (repeatable); its processes' memory is "
        "measured",
    )
    g.add_argument(
        "--lora-targets",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the targets whose requests go to --lora-modules' adapters; the "
        "others get the base model (default: every target)",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every target, rotating who goes first (round r: seed + r)",
    )
    g.add_argument(
        "--keep-up",
        action="store_true",
        help="start each launched server once and keep it up through every "
        "round (short rounds then run the targets seconds apart; its memory is "
        "its peak over all its runs)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="short requests, not measured, before each run",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a launched server may take to list its model",
    )


def _targets(ns: argparse.Namespace) -> list[Target]:
    """The targets the flags name; ValueError naming the flag if they cannot work."""
    targets = [Target.parse(t, launch=False) for t in ns.server]
    targets += [Target.parse(t, launch=True) for t in ns.launch]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"targets need distinct names: {names}")
    check_lora_targets(ns.lora_targets, names, ns.lora_modules)
    if ns.url != ServeConfig().url:
        raise ValueError("--url is one server; name each with --server NAME=URL")
    if ns.rounds < 1:
        raise ValueError(f"--rounds must be at least 1: {ns.rounds}")
    if ns.warmup < 0:
        raise ValueError(f"--warmup must be at least 0: {ns.warmup}")
    if not ns.startup_timeout > 0:
        raise ValueError(f"--startup-timeout must be positive: {ns.startup_timeout}")
    return targets


def run_compare(ns: argparse.Namespace, config: ServeConfig) -> int:
    """``bench serve`` with ``--server``/``--launch``: print the table, write
    ``--json`` and ``--plot``; 0 when every run completed a request."""
    try:
        targets = _targets(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    _log(
        f"{len(targets)} servers, {ns.rounds} round(s) of {config.num_prompts} "
        f"requests to {config.endpoint} at {rate} req/s, max concurrency "
        f"{config.max_concurrency or 'unbounded'}"
    )
    run = functools.partial(
        run_comparison,
        config,
        targets,
        rounds=ns.rounds,
        warmup=ns.warmup,
        startup_timeout=ns.startup_timeout,
        lora_targets=ns.lora_targets,
        keep_up=ns.keep_up,
    )
    try:
        comparison = anyio.run(until_signalled, run, backend="asyncio")
    except ComparisonStopped as exc:
        print(f"error: {exc}", file=sys.stderr)
        if not exc.partial.runs:
            return 1
        _log(f"the {len(exc.partial.runs)} run(s) finished before it:")
        comparison, status = exc.partial, 1
    else:
        if comparison is None:
            print(
                "error: interrupted; the launched servers are stopped", file=sys.stderr
            )
            return 1
        status = 0 if all(r.result.summary.completed for r in comparison.runs) else 1
    print(comparison.format())
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(comparison.to_json(config.to_json()), indent=2)
        )
    if ns.plot:
        from structllm.bench.serve_compare_plot import plot_comparison

        plot_comparison(comparison, ns.plot)
    return status
