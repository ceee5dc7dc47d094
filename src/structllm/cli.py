"""The structllm command: generate, inspect, serve, make-tiny-model, bench."""

from __future__ import annotations

import argparse
import inspect
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from structllm.config import (
    EngineConfig,
    FrontendConfig,
    ServerConfig,
    add_arguments,
    add_grouped_arguments,
    from_arguments,
)
from structllm.params import SamplingParams

__all__ = ["main"]

_MODEL_HELP = "model directory, or a built-in name (tiny, tiny-random)"


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (not ``model``)."""
    return {
        f.name: getattr(ns, f.name)
        for f in attrs.fields(EngineConfig)
        if f.metadata.get("cli", True)
    }


#: generate's sampling flags: SamplingParams fields, greedy and longer by default
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    add_arguments(
        g,
        SamplingParams,
        only=_SAMPLING,
        defaults={"max_tokens": 64, "temperature": 0.0},
        help={
            "max_tokens": "tokens to generate at most",
            "temperature": "0 is greedy",
            "top_p": "nucleus sampling: keep the smallest set of this probability",
            "top_k": "keep the k most likely tokens; 0 keeps all",
            "min_p": "drop tokens below this fraction of the top probability",
            "seed": "seed of this request's sampling (default: random)",
            "stop": "a stop string",
        },
    )
    g.add_argument("--ignore-eos", action="store_true")


#: the subcommands, in --help's order
COMMANDS = ("generate", "inspect", "make-tiny-model", "serve", "bench", "completion")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``command`` only that subcommand's
    arguments (the others listed by name): ``structllm serve`` then
    imports neither the benchmarks nor the tiny-model writer, whose numpy
    and safetensors were ~16 MiB of the server process."""
    from structllm import __version__

    parser = argparse.ArgumentParser(prog="structllm", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"structllm {__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def wanted(name: str) -> bool:
        return command is None or command == name

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    if wanted("generate"):
        gen.add_argument("model", help=_MODEL_HELP)
        gen.add_argument("prompt")
        gen.add_argument(
            "--chat", action="store_true", help="wrap the prompt in the chat template"
        )
        add_grouped_arguments(gen, EngineConfig)
        _add_sampling_args(gen)

    insp = sub.add_parser(
        "inspect", help="print what structllm understands of a model's config.json"
    )
    if wanted("inspect"):
        insp.add_argument("model", help=_MODEL_HELP)

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight HF checkpoint")
    if wanted("make-tiny-model"):
        tiny.add_argument("directory")
        _add_tiny_model_args(tiny)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    if wanted("serve"):
        serve.add_argument("model", help=_MODEL_HELP)
        # grouped by topic (network, security, limits, ...), whichever config
        # holds the field; server.run.configs_from_args reads them back
        add_grouped_arguments(serve, ServerConfig, FrontendConfig, EngineConfig)

    bench = sub.add_parser("bench", help="benchmarks")
    comp = sub.add_parser("completion", help="print a shell completion script")
    if wanted("completion"):
        comp.add_argument(
            "shell", choices=["bash"], help="bash (zsh: via bashcompinit)"
        )
    if wanted("bench"):
        _add_bench_args(bench)
    return parser


def _add_bench_args(bench: argparse.ArgumentParser) -> None:
    bsub = bench.add_subparsers(dest="bench", required=True)
    thr = bsub.add_parser("throughput", help="offline throughput vs transformers")
    from structllm.bench.throughput import add_throughput_args

    add_throughput_args(thr)
    srv = bsub.add_parser("serve", help="load-test an OpenAI-compatible server")
    from structllm.bench.serve import add_serve_args as add_bench_serve_args

    add_bench_serve_args(srv)
    pfx = bsub.add_parser("prefix", help="TTFT/throughput, prefix caching on vs off")
    from structllm.bench.prefix import add_prefix_args

    add_prefix_args(pfx)
    scp = bsub.add_parser("scopes", help="deadlines (EDF vs FCFS) and pinned prefixes")
    from structllm.bench.scopes import add_scopes_args

    add_scopes_args(scp)
    spc = bsub.add_parser("speculative", help="speculative decoding vs none")
    from structllm.bench.speculative import add_speculative_args

    add_speculative_args(spc)


#: make-tiny-model's flags: make_tiny_model's keyword arguments, whose
#: signature gives each flag its type, choices and default
_TINY_FLAGS = {
    "arch": ("--arch", "architecture family"),
    "hidden_size": ("--hidden", "hidden size"),
    "num_layers": ("--layers", "decoder layers"),
    "num_heads": ("--heads", "attention heads"),
    "num_kv_heads": ("--kv-heads", "key/value heads"),
    "intermediate_size": ("--intermediate", "MLP width (default: 2 x hidden)"),
    "vocab_size": ("--vocab-size", "tokenizer vocabulary"),
    "max_position_embeddings": ("--max-position-embeddings", "context length"),
    "tie_word_embeddings": ("--tie", "tie the head to the embedding "),
    "dtype": ("--dtype", "weight dtype"),
    "shards": ("--shards", "safetensors files"),
    "seed": ("--seed", "weight seed"),
}


def _add_tiny_model_args(p: argparse.ArgumentParser) -> None:
    from structllm.testing.checkpoints import make_tiny_model

    params = inspect.signature(make_tiny_model).parameters
    hints = typing.get_type_hints(make_tiny_model)
    for name, (flag, text) in _TINY_FLAGS.items():
        default = params[name].default
        args = [a for a in typing.get_args(hints[name]) if a is not type(None)]
        kind = args[0] if args else hints[name]
        kw: dict[str, Any] = {"dest": name, "default": default}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
            text += "(default: the family's)" if default is None else ""
        elif typing.get_origin(hints[name]) is typing.Literal:
            kw["choices"] = args
        else:
            kw.update(type=kind, metavar=kind.__name__.upper())
        if default is not None and kind is not bool:
            text += " (default: %(default)s)"
        p.add_argument(flag, help=text, **kw)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    # the first word that names a subcommand (None: --help, --version)
    command = next((a for a in args if a in COMMANDS), None)
    ns = build_parser(command).parse_args(args)
    if ns.command == "make-tiny-model":
        from structllm.testing.checkpoints import make_tiny_model

        config = make_tiny_model(
            ns.directory, **{name: getattr(ns, name) for name in _TINY_FLAGS}
        )
        print(
            f"wrote {config.architecture} ({config.num_parameters / 1e6:.2f}M parameters) "
            f"to {ns.directory}"
        )
        return 0
    if ns.command == "completion":
        from structllm.completion import bash_script

        sys.stdout.write(bash_script(build_parser()))
        return 0
    if ns.command == "generate":
        return _generate(ns)
    if ns.command == "inspect":
        return _inspect(ns)
    if ns.command == "serve":
        return _serve(ns)
    if ns.command == "bench" and ns.bench == "serve":
        from structllm.bench.serve import run_serve

        return run_serve(ns)
    if ns.command == "bench" and ns.bench == "prefix":
        from structllm.bench.prefix import run_prefix

        return run_prefix(ns)
    if ns.command == "bench" and ns.bench == "scopes":
        from structllm.bench.scopes import run_scopes

        return run_scopes(ns)
    if ns.command == "bench" and ns.bench == "speculative":
        from structllm.bench.speculative import run_speculative

        return run_speculative(ns)
    if ns.command == "bench" and ns.bench == "throughput":
        from structllm.bench.throughput import run_throughput

        return run_throughput(ns)
    raise AssertionError(ns.command)  # pragma: no cover


def _serve(ns: argparse.Namespace) -> int:
    """``structllm serve``; its tokenizer is loaded before the HTTP server's
    modules are imported (FastAPI, pydantic, the API rooms): the lists it is
    built from (15 MiB of Python objects for a GGUF file's 49k tokens and
    merges) are freed into memory those imports then reuse, where loaded
    after them they left holes nothing filled (the server's peak 97 against
    76 MiB offline, 101 against 83 served; docs/benchmarks.md). A setting
    that cannot work is still told first (exit 2), then a tokenizer that
    cannot load (exit 1), both before anything listens."""
    from structllm.errors import EngineConfigError, StructLLMError
    from structllm.text.tokenizer import load_tokenizer

    try:
        engine = EngineConfig(model=ns.model, **engine_args(ns))
        front = from_arguments(FrontendConfig, ns)
    except EngineConfigError as exc:  # names the setting: no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed: StructLLMError | None = None
    try:
        tokenizer = load_tokenizer(front.tokenizer or engine.model)
    except StructLLMError as exc:  # told after the settings' own errors
        tokenizer, failed = None, exc
    from structllm.server.run import configs_from_args, run_server

    try:
        server, front = configs_from_args(ns, engine)
    except EngineConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if failed is not None:
        print(f"structllm: the engine failed to start: {failed}", file=sys.stderr)
        return 1
    return run_server(server, front, engine, tokenizer=tokenizer)


def _inspect(ns: argparse.Namespace) -> int:
    """Read config.json only (no weights) and print how it will run."""
    from structllm.errors import StructLLMError
    from structllm.model.config import ModelConfig
    from structllm.models import resolve_model

    try:
        path = resolve_model(ns.model)
        config = ModelConfig.from_path(path)
        described = config.describe("float32")
        if path is not None and path.is_file():
            described["weights"] = _gguf_weights(path)
    except StructLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # CPU compute is float32 (Paddle has no CPU half-precision matmul)
    for label, value in described.items():
        print(f"{label + ':':<24}{value}")
    return 0


def _gguf_weights(path: Path) -> str:
    """A GGUF file's tensor types, most numerous first, and its size."""
    from collections import Counter

    from structllm.formats import GGUFFile

    with GGUFFile.open(path) as f:
        types = Counter(t.type.name for t in f.tensors.values())
        version = f.version
    kinds = ", ".join(f"{n} x{k}" for n, k in types.most_common())
    size = path.stat().st_size / 1e6
    return f"GGUF v{version}, {size:.1f} MB: {kinds}"


def _generate(ns: argparse.Namespace) -> int:
    from structllm.errors import StructLLMError
    from structllm.llm import LLM
    from structllm.params import OutputKind

    try:
        params = from_arguments(
            SamplingParams,
            ns,
            only=_SAMPLING,
            ignore_eos=ns.ignore_eos,
            output_kind=OutputKind.DELTA,
        )
        llm = LLM(ns.model, **engine_args(ns))
        prompt: Any = ns.prompt
        if ns.chat:
            # the template writes any BOS itself: encode without special tokens
            text = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": ns.prompt}]
            )
            ids = llm.tokenizer.encode(text, add_special_tokens=False)
            prompt = {"prompt": text, "prompt_token_ids": ids}
        outputs = llm.stream(prompt, params)
        last = None
        for last in outputs:
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except StructLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    if last is not None:
        print(
            f"[{last.num_generated_tokens} tokens, finish_reason={last.finish_reason}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
