"""structllm side by side with llama.cpp, on one checkpoint, in one command.

    python tools/bench_peers.py [--work DIR] [--rounds 3] [--threads 2]
        [--num-prompts 80] [--input-len 16 256] [--out docs/results/peers]
        [--skip llama.cpp]

``nox -s bench-peers`` runs it. llama.cpp is a comparison here, never a
dependency; the steps:

1. ``pip download`` the source distribution of ``llama-cpp-python``
   (``--llama-cpp-python``, default 0.3.36) and build its vendored
   llama.cpp's ``llama-server`` (cmake, ``GGML_NATIVE=ON``, Release).
2. Write the 27.8M-parameter bench checkpoint (``write_bench_checkpoint``:
   hidden 512, 8 layers, float32) and convert it with that llama.cpp's
   ``convert_hf_to_gguf.py --outtype f32`` (it needs torch and
   transformers). The bench tokenizer is a random byte-level BPE whose
   pre-tokenizer the converter does not know: it is told "gpt-2".
3. Two ``structllm bench serve`` comparisons of three launched servers,
   one at a time, ``--rounds`` rounds: llama.cpp (``-np 16``, its default
   float16 KV cache), ``structllm serve`` under asyncio, and under trio
   (its default KV cache: float16 for a quantized GGUF, as llama.cpp's,
   float32 for the float bench checkpoint), all with ``--threads`` threads.
   First 16 concurrent clients (``--num-prompts`` requests), then one
   stream (``--single-prompts`` requests a round, 10 by default, in
   ``--single-rounds`` rounds, ``--rounds`` by default) with every server
   kept up through its rounds (``bench serve --keep-up``: the servers'
   runs seconds apart, where this VM's speed wanders 1.5x over minutes).
   ``--variant NAME=FLAGS`` adds a structllm
   server with more flags (llama.cpp's numerics: ``like-llamacpp=
   --quantized-activations q8 --kv-cache-dtype float16``). Each writes ``OUT_c16.json/png`` and
   ``OUT_single.json/png`` (the JSON without its per-request records,
   which stay in ``--work``).

Every step is skipped when its output is already in ``--work`` (default
``~/.cache/structllm-peers``).

``--real TYPE`` (repeatable; ``nox -s bench-peers -- --real Q4_1 --real
Q8_0 --real Q4_K_M``) compares on the real model instead: SmolLM2-135M-
Instruct's shipped Q4_1 GGUF (the built-in ``smollm2``), and other types
made from it by the same llama.cpp's ``llama-quantize
--allow-requantize``; both engines serve the same file, the workload is
random words (``--prompt-kind text``), and a ``structllm-q8`` server
(``--quantized-activations q8``, llama.cpp's own arithmetic) runs beside
the default float activations unless a ``q8`` variant is given. llama.cpp is built with
``GGML_NATIVE=OFF`` and the ISA flags of /proc/cpuinfo, AMX off (these VMs
report AMX and kill its code with SIGILL).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path


def q(path: str | Path) -> str:
    """A path as one word of a command line that ``bench serve`` splits."""
    return shlex.quote(str(path))


def run(*cmd: str | Path, **kw: object) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)  # type: ignore[call-overload]


def build_llama_server(work: Path, version: str) -> Path:
    source = work / f"llama_cpp_python-{version}"
    llama = source / "vendor" / "llama.cpp"
    binary = llama / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    sdist = work / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        run(
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
            ":all:", f"llama-cpp-python=={version}", "-d", work,
        )  # fmt: skip
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    build = llama / "build"
    run(
        "cmake", "-S", llama, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", *cpu_flags(),
    )  # fmt: skip
    run(
        "cmake", "--build", build, "--target", "llama-server", "llama-quantize",
        "-j", str(os.cpu_count()),
    )  # fmt: skip
    return binary


def cpu_flags() -> list[str]:
    """llama.cpp's ISA switches from /proc/cpuinfo, AMX off: these VMs report
    AMX but kill AMX code with SIGILL (seen on a Q4_1 file with
    ``GGML_NATIVE=ON``), so the build names what it may use instead."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(text.split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        flags = set()
    want = {
        "GGML_AVX": "avx",
        "GGML_AVX2": "avx2",
        "GGML_FMA": "fma",
        "GGML_F16C": "f16c",
        "GGML_BMI2": "bmi2",
        "GGML_AVX512": "avx512f",
        "GGML_AVX512_VBMI": "avx512vbmi",
        "GGML_AVX512_VNNI": "avx512_vnni",
        "GGML_AVX512_BF16": "avx512_bf16",
        "GGML_AVX_VNNI": "avx_vnni",
    }
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in want.items()]
    out += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return out


def convert(llama: Path, model: Path, gguf: Path) -> None:
    """``convert_hf_to_gguf.py --outtype f32``, told what the bench tokenizer is."""
    sys.path[:0] = [str(llama / "gguf-py"), str(llama)]
    import conversion.base as base  # type: ignore[import-not-found]
    import conversion.llama as llama_model  # type: ignore[import-not-found]

    # a byte-level BPE (tokenizer.json) with an unknown pre-tokenizer hash
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    llama_model.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", "f32"]
    sys.argv += ["--outfile", str(gguf)]
    runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_work = Path.home() / ".cache" / "structllm-peers"
    p.add_argument("--work", type=Path, default=default_work)
    p.add_argument("--llama-cpp-python", default="0.3.36", metavar="VERSION")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--single-rounds",
        type=int,
        default=None,
        help="rounds of the one-stream comparison (default: --rounds)",
    )
    p.add_argument(
        "--single-prompts",
        type=int,
        default=10,
        help="requests a round of the one-stream comparison (default 10)",
    )
    p.add_argument(
        "--only",
        choices=["c16", "single"],
        default=None,
        help="run only this comparison (16 clients, or one stream)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[16, 256],
        metavar=("LO", "HI"),
        help="prompt lengths, uniform in LO..HI tokens (default 16 256)",
    )
    p.add_argument("--out", default="docs/results/peers", metavar="PREFIX")
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["llama.cpp", "asyncio", "trio"],
        help="leave a server out",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more structllm server (asyncio), named structllm-NAME, with "
        "these serve flags added; e.g. 'like-llamacpp=--quantized-activations "
        "q8 --kv-cache-dtype float16' (llama.cpp's q8 activations and float16 "
        "KV cache); repeatable",
    )
    p.add_argument(
        "--real",
        action="append",
        default=[],
        metavar="TYPE",
        help="the real model instead (smollm2's GGUF, fetched once): Q4_1 as "
        "shipped, other types (Q8_0, Q4_K_M) made with llama.cpp's "
        "llama-quantize from it; repeatable",
    )
    ns = p.parse_args()
    work: Path = ns.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    if ns.real:
        return real_model(ns, work)
    model, gguf = work / "bench-model", work / "bench-f32.gguf"
    if not (model / "model.safetensors").exists():
        from structllm.bench.model import write_bench_checkpoint

        write_bench_checkpoint(model)
    binary = gguf_file = None
    if "llama.cpp" not in ns.skip:
        binary = build_llama_server(work, ns.llama_cpp_python)
        if not gguf.exists():
            # in a child process: the converter imports torch
            run(sys.executable, __file__, "--convert", binary, model, gguf)
        gguf_file = gguf
    compare(ns, work, model, binary, gguf_file, ["--vocab-size", "512"], "peers")
    return 0


def real_model(ns: argparse.Namespace, work: Path) -> int:
    """SmolLM2-135M-Instruct, the same GGUF file for both engines, per type."""
    from structllm.models import SMOLLM2, resolve_model

    if not any(v.partition("=")[0] == "q8" for v in ns.variant):
        ns.variant.append("q8=--quantized-activations q8")
    shipped = resolve_model(SMOLLM2)
    assert shipped is not None
    binary = build_llama_server(work, ns.llama_cpp_python)
    quantize = binary.with_name("llama-quantize")
    for kind in ns.real:
        gguf = shipped if kind == "Q4_1" else work / f"smollm2-{kind}.gguf"
        if not gguf.exists():
            # from the shipped Q4_1 (the only file there is): a speed and
            # memory comparison on the file both engines then read
            run(quantize, "--allow-requantize", shipped, gguf, kind)
        llama = None if "llama.cpp" in ns.skip else binary
        compare(
            ns, work, gguf, llama, gguf, ["--prompt-kind", "text"], f"smollm2_{kind}"
        )
    return 0


def compare(
    ns: argparse.Namespace,
    work: Path,
    model: Path,
    llama_server: Path | None,
    gguf: Path | None,
    prompts: list[str],
    tag: str,
) -> None:
    """Two ``bench serve`` comparisons (16 clients, one stream) of llama.cpp
    on ``gguf`` (unless ``llama_server`` is None) and ``structllm serve`` on
    ``model`` under each loop not skipped; writes ``{ns.out}_{tag}_{name}``."""
    t = str(ns.threads)
    # numba's disk cache filled before any measured server starts: a server
    # that compiles the kernels (the first after they change) holds LLVM's
    # ~800 MiB in its peak RSS and its first requests wait for it
    for variant in ["=", *ns.variant]:  # each variant's kernels too
        run(
            sys.executable, "-m", "structllm.cli", "generate", model,
            " ".join(["warm"] * 40), "--max-tokens", "2", "--num-threads", t,
            *shlex.split(variant.partition("=")[2]),
        )  # fmt: skip
    launch: dict[str, str] = {}
    if llama_server is not None and gguf is not None:
        launch["llama.cpp"] = (
            f"{q(llama_server)} -m {q(gguf)} -t {t} -tb {t} -np 16 -c 8192 "
            "--port {port}"
        )
    # the same KV cache in tokens: llama.cpp's -c 8192 is shared by its 16
    # slots; 512 blocks of 16 (structllm's default is what 512 MiB holds)
    serve = (
        f"{q(sys.executable)} -m structllm.cli serve {q(model)} --port {{port}} "
        f"--max-num-seqs 16 --max-model-len 4096 --num-blocks 512 --num-threads {t}"
    )
    for loop in ("asyncio", "trio"):
        if loop not in ns.skip:
            launch[f"structllm-{loop}"] = f"{serve} --loop {loop}"
    for variant in ns.variant:
        name, _, flags = variant.partition("=")
        launch[f"structllm-{name}"] = f"{serve} --loop asyncio {flags}"
    lo, hi = map(str, ns.input_len)
    workload = ["--input-len", lo, hi, "--output-len", "16", "128", *prompts]
    workload += ["--seed", "0"]
    targets = [a for item in launch.items() for a in ("--launch", "=".join(item))]
    c16 = ["--num-prompts", str(ns.num_prompts), "--max-concurrency", "16"]
    single = ["--num-prompts", str(ns.single_prompts), "--max-concurrency", "1"]
    single += ["--rounds", str(ns.single_rounds or ns.rounds), "--keep-up"]
    for name, flags in (
        ("c16", [*c16, "--rounds", str(ns.rounds)]),
        ("single", single),
    ):
        if ns.only and name != ns.only:
            continue
        full = work / f"{tag}_{name}.json"
        out = f"{ns.out}_{tag}_{name}" if tag != "peers" else f"{ns.out}_{name}"
        run(
            sys.executable, "-m", "structllm.cli", "bench", "serve", *targets,
            *workload, *flags, "--json", full, "--plot", f"{out}.png",
        )  # fmt: skip
        write_summary(full, Path(f"{out}.json"))


def write_summary(full: Path, out: Path) -> None:
    """The comparison without its per-request records (those stay in ``full``)."""
    data = json.loads(full.read_text())
    for run_ in data["runs"]:
        del run_["requests"]
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out} (every request: {full})", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--convert"]:
        binary, model, gguf = map(Path, sys.argv[2:5])
        convert(binary.parents[2], model, gguf)
        sys.exit(0)
    sys.exit(main())
