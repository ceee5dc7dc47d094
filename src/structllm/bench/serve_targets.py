"""The servers ``structllm bench serve`` compares: running ones and launched ones.

A target is ``NAME=URL`` (``--server``: a server already running) or
``NAME=COMMAND`` (``--launch``: the benchmark starts it, one at a time).
A launched command is split like a shell line (no shell runs it) and
``{port}`` in it becomes a free port on 127.0.0.1; it runs in a session of
its own, its output goes to a log file, whose tail is shown if it fails to
start. It counts as up once ``GET /v1/models`` lists a model. It is stopped
with SIGTERM (then SIGKILL to its process group, after a grace period)
before the next target starts, or when the benchmark gets SIGTERM or SIGHUP
(:func:`until_signalled`).

Memory, measured after each run:

- of a launched server, every process of its tree (the command and its
  descendants) from ``/proc``: each one's peak (``VmHWM``) and current
  (``VmRSS``) resident memory; so llama.cpp and structllm's core process are
  measured the same way. Linux only; elsewhere the figures are absent.
- of any server, what its ``/metrics`` says: structllm's
  ``structllm_kv_cache_bytes`` and ``structllm_engine_core_peak_rss_bytes``,
  and the ``process_resident_memory_bytes`` that Prometheus clients export.

Speculative decoding's counters (:func:`scrape_spec_decode`) come from
``/metrics`` too: structllm's ``structllm_spec_decode_num_*_total`` and
vLLM's ``vllm:spec_decode_num_*_total`` (summed over their labels); a
server without them (llama.cpp) has none.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import anyio.abc
import attrs
import httpx
from prometheus_client.parser import text_string_to_metric_families

from structllm.bench.serve_results import SpecDecodeCounts

__all__ = [
    "LaunchError",
    "MemoryReport",
    "ProcessMemory",
    "Running",
    "Target",
    "check_lora_targets",
    "open_target",
    "process_tree",
    "scrape_memory",
    "scrape_spec_decode",
    "spec_decode_counts",
    "tree_memory",
    "until_signalled",
]

#: the /metrics samples read into :class:`MemoryReport`, and their fields
_SCRAPED = {
    "structllm_kv_cache_bytes": "kv_cache_bytes",
    "structllm_engine_core_peak_rss_bytes": "engine_core_peak_rss_bytes",
    "process_resident_memory_bytes": "server_rss_bytes",
}

#: the speculative decoding counters (sample names less their server's
#: prefix) in :class:`SpecDecodeCounts`' order
_SPEC_COUNTERS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)
_SPEC_PREFIXES = ("structllm_", "vllm:")


T = TypeVar("T")

#: seconds for a GET of /metrics or /v1/models (the client has no timeout)
_GET_TIMEOUT = 30.0


class LaunchError(Exception):
    """A launched server exited, or did not come up in time."""


def _check_name(self: Target, attribute: attrs.Attribute[str], name: str) -> None:
    if not name or name != name.strip():
        raise ValueError(f"a target needs a name: NAME=URL or NAME=COMMAND, {name!r}")


@attrs.frozen
class Target:
    """A server to benchmark: at ``url``, or started by ``command``."""

    name: str = attrs.field(validator=_check_name)
    url: str | None = None
    command: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.url is None) == (self.command is None):
            raise ValueError(f"target {self.name!r} needs a url or a command, not both")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"target {self.name!r}: {self.url!r} is not an http URL")
        if self.command is not None:
            if "{port}" not in self.command:
                raise ValueError(
                    f"target {self.name!r}: the command must contain {{port}}, where "
                    "the benchmark puts the port it listens on"
                )
            shlex.split(self.command)  # ValueError on unbalanced quotes

    @classmethod
    def parse(cls, text: str, *, launch: bool) -> Target:
        """``NAME=URL`` (``launch=False``) or ``NAME=COMMAND``."""
        name, sep, value = text.partition("=")
        if not sep or not value.strip():
            what = "COMMAND" if launch else "URL"
            raise ValueError(f"expected NAME={what}, got {text!r}")
        if launch:
            return cls(name, command=value.strip())
        return cls(name, url=value.strip().rstrip("/"))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "command": self.command}


def check_lora_targets(
    lora_targets: Collection[str] | None, names: Sequence[str], modules: Sequence[str]
) -> None:
    """ValueError unless ``lora_targets`` (if any) are among the targets'
    ``names`` and there are ``modules`` to send them."""
    if lora_targets is None:
        return
    if not modules:
        raise ValueError("--lora-targets needs --lora-modules: the adapters' names")
    if unknown := sorted(set(lora_targets) - set(names)):
        raise ValueError(f"--lora-targets names no target {unknown}: {list(names)}")


@attrs.frozen
class ProcessMemory:
    pid: int
    name: str  # the kernel's short name (/proc/PID/comm)
    peak_rss_bytes: int  # VmHWM
    rss_bytes: int  # VmRSS when read


@attrs.frozen
class MemoryReport:
    """A server's memory after a run; ``None`` where it could not be known."""

    #: a launched server's processes (empty for a running one, or off Linux)
    processes: tuple[ProcessMemory, ...] = ()
    kv_cache_bytes: float | None = None
    engine_core_peak_rss_bytes: float | None = None
    server_rss_bytes: float | None = None

    @property
    def peak_rss_bytes(self) -> int | None:
        """The sum of the processes' peaks: at least the tree's peak."""
        return sum(p.peak_rss_bytes for p in self.processes) or None

    @property
    def rss_bytes(self) -> int | None:
        return sum(p.rss_bytes for p in self.processes) or None

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_rss_bytes": self.peak_rss_bytes,
            "rss_bytes": self.rss_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "engine_core_peak_rss_bytes": self.engine_core_peak_rss_bytes,
            "server_rss_bytes": self.server_rss_bytes,
            "processes": [attrs.asdict(p) for p in self.processes],
        }


# -- memory -------------------------------------------------------------------


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and its living descendants, parents first (empty if it is gone)."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    if not (proc / str(pid)).exists():
        return []
    order, i = [pid], 0
    while i < len(order):
        order += sorted(children.get(order[i], ()))
        i += 1
    return order


def _status(pid: int, proc: Path) -> ProcessMemory | None:
    try:
        lines = (proc / str(pid) / "status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in lines if ":" in line)

    def kib(key: str) -> int:  # "  1234 kB"; absent for a zombie
        return 1024 * int(fields.get(key, "0 kB").split()[0])

    return ProcessMemory(
        pid, fields.get("Name", "?").strip(), kib("VmHWM"), kib("VmRSS")
    )


def tree_memory(pid: int, proc: Path = Path("/proc")) -> tuple[ProcessMemory, ...]:
    """Every living process of ``pid``'s tree, with its peak and current RSS."""
    if not proc.is_dir():
        return ()
    found = (_status(p, proc) for p in process_tree(pid, proc))
    return tuple(m for m in found if m is not None)


def _scraped(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in _SCRAPED:
                    out[_SCRAPED[sample.name]] = sample.value
    except (ValueError, IndexError):  # not Prometheus text
        return {}
    return out


def spec_decode_counts(text: str) -> SpecDecodeCounts | None:
    """The speculative decoding counters of a ``/metrics`` text; None unless
    all three are there."""
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for prefix in _SPEC_PREFIXES:
                    name = sample.name.removeprefix(prefix)
                    if name != sample.name and name in _SPEC_COUNTERS:
                        found[name] = found.get(name, 0.0) + sample.value
    except (ValueError, IndexError):  # not Prometheus text
        return None
    if len(found) < len(_SPEC_COUNTERS):
        return None
    return SpecDecodeCounts(*(found[name] for name in _SPEC_COUNTERS))


async def _get_metrics(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        resp = await client.get(f"{url}/metrics", timeout=_GET_TIMEOUT)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


async def scrape_spec_decode(
    client: httpx.AsyncClient, url: str
) -> SpecDecodeCounts | None:
    """The speculative decoding counters ``GET {url}/metrics`` gives (None
    if it has none)."""
    text = await _get_metrics(client, url)
    return None if text is None else spec_decode_counts(text)


async def scrape_memory(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The memory figures ``GET {url}/metrics`` gives (none if it has none)."""
    text = await _get_metrics(client, url)
    return {} if text is None else _scraped(text)


# -- launching ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(log: IO[bytes], lines: int = 20) -> str:
    """The log's last lines; read with ``pread``, since the server may still be
    writing through the file offset it shares with us."""
    size = os.fstat(log.fileno()).st_size
    start = max(0, size - 65536)
    text = os.pread(log.fileno(), size - start, start).decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


async def _wait_up(
    client: httpx.AsyncClient, url: str, process: anyio.abc.Process
) -> None:
    """Poll ``GET /v1/models`` until it lists a model; raise if the process exits."""
    while True:
        if process.returncode is not None:
            raise LaunchError(f"exited with code {process.returncode} before serving")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = await client.get(f"{url}/v1/models", timeout=5.0)
            models = resp.json() if resp.status_code == 200 else None
            if isinstance(models, dict) and models.get("data"):
                return
        await anyio.sleep(0.2)


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _stop(process: anyio.abc.Process, grace: float) -> None:
    """SIGTERM to the server (it stops its own children), then SIGKILL to its
    process group for whatever is left; shielded, it always runs."""
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            with anyio.move_on_after(grace):
                await process.wait()
        _kill_session(process.pid)  # stragglers of the tree, and a hung leader
        with anyio.move_on_after(10.0):
            await process.wait()


@attrs.frozen
class Running:
    """A target that is up: where to send, and its process when launched."""

    target: Target
    url: str
    process: anyio.abc.Process | None = None

    async def memory(self, client: httpx.AsyncClient) -> MemoryReport:
        processes = () if self.process is None else tree_memory(self.process.pid)
        scraped = await scrape_memory(client, self.url)
        return MemoryReport(processes, **scraped)


@contextlib.asynccontextmanager
async def open_target(
    target: Target,
    client: httpx.AsyncClient,
    *,
    startup_timeout: float,
    grace: float = 30.0,
) -> AsyncIterator[Running]:
    """``target`` up and serving for the block; a launched one stops after it."""
    if target.command is None:
        assert target.url is not None
        yield Running(target, target.url)
        return
    port = _free_port()
    argv = [a.replace("{port}", str(port)) for a in shlex.split(target.command)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(prefix="structllm-bench-") as log:
        try:
            process = await anyio.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its tree can be killed as one
            )
        except OSError as exc:
            raise LaunchError(
                f"{target.name}: cannot start {argv[0]!r}: {exc}"
            ) from exc
        try:
            try:
                with anyio.fail_after(startup_timeout):
                    await _wait_up(client, url, process)
            except (LaunchError, TimeoutError) as exc:
                why = str(exc) or f"not serving after {startup_timeout:g} s"
                raise LaunchError(
                    f"{target.name}: {why}; the end of its output:\n{_tail(log)}"
                ) from None
            yield Running(target, url, process)
        finally:
            await _stop(process, grace)


async def until_signalled(run: Callable[[], Awaitable[T]]) -> T | None:
    """``run()``, cancelled by SIGTERM or SIGHUP (None then) as Ctrl-C cancels
    it: a launched server runs in a session of its own, which a terminal's or
    a CI runner's signals do not reach, so only our cleanup stops it."""
    if threading.current_thread() is not threading.main_thread():
        return await run()  # only the main thread receives signals
    done: list[T] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
                async for signum in signals:
                    print(f"{signal.Signals(signum).name}: stopping", file=sys.stderr)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        done.append(await run())
        tg.cancel_scope.cancel()
    return done[0] if done else None
