"""The ``structllm`` command: generate, inspect, serve, make-tiny-model, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    g.add_argument(
        "--load-format", default="auto", choices=["auto", "safetensors", "dummy"]
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of repeated prompt prefixes (default: on)",
    )
    g.add_argument(
        "--model-backend",
        default="auto",
        choices=["auto", "eager", "inference"],
        help="auto: oneDNN predictors (Paddle Inference) for float32 CPU models of 10M+ parameters",
    )


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": ns.dtype,
        "load_format": ns.load_format,
        "max_model_len": ns.max_model_len,
        "block_size": ns.block_size,
        "num_blocks": ns.num_blocks,
        "max_num_seqs": ns.max_num_seqs,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "num_threads": ns.num_threads,
        "model_backend": ns.model_backend,
        "enable_prefix_caching": ns.enable_prefix_caching,
    }


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--stop", action="append", default=[], help="a stop string (repeatable)"
    )
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    from structllm import __version__

    parser = argparse.ArgumentParser(prog="structllm", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"structllm {__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("model", help="model directory, or 'tiny'")
    gen.add_argument("prompt")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template"
    )
    _add_engine_args(gen)
    _add_sampling_args(gen)

    insp = sub.add_parser(
        "inspect", help="print what structllm understands of a model's config.json"
    )
    insp.add_argument("model", help="model directory, or 'tiny'")

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight HF checkpoint")
    tiny.add_argument("directory")
    tiny.add_argument(
        "--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"]
    )
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--intermediate", type=int, default=None)
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--max-position-embeddings", type=int, default=2048)
    tiny.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None)
    tiny.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"]
    )
    tiny.add_argument("--shards", type=int, default=1)
    tiny.add_argument("--seed", type=int, default=0)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from structllm.server.run import add_serve_args

    add_serve_args(serve)
    _add_engine_args(serve)

    bench = sub.add_parser("bench", help="benchmarks")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "make-tiny-model":
        from structllm.tiny import make_tiny_model

        config = make_tiny_model(
            ns.directory,
            arch=ns.arch,
            hidden_size=ns.hidden,
            num_layers=ns.layers,
            num_heads=ns.heads,
            num_kv_heads=ns.kv_heads,
            intermediate_size=ns.intermediate,
            vocab_size=ns.vocab_size,
            tie_word_embeddings=ns.tie,
            max_position_embeddings=ns.max_position_embeddings,
            dtype=ns.dtype,
            shards=ns.shards,
            seed=ns.seed,
        )
        print(
            f"wrote {config.architecture} ({config.num_parameters / 1e6:.2f}M parameters) "
            f"to {ns.directory}"
        )
        return 0
    if ns.command == "generate":
        return _generate(ns)
    if ns.command == "inspect":
        return _inspect(ns)
    if ns.command == "serve":
        from structllm.server.run import run_server

        return run_server(ns, engine_args(ns))
    if ns.command == "bench" and ns.bench == "serve":
        from structllm.bench.serve import run_serve

        return run_serve(ns)
    if ns.command == "bench" and ns.bench == "prefix":
        from structllm.bench.prefix import run_prefix

        return run_prefix(ns)
    if ns.command == "bench" and ns.bench == "throughput":
        from structllm.bench.throughput import run_throughput

        return run_throughput(ns)
    raise AssertionError(ns.command)  # pragma: no cover


def _inspect(ns: argparse.Namespace) -> int:
    """Read config.json only (no weights) and print how it will run."""
    from pathlib import Path

    from structllm.errors import StructLLMError
    from structllm.model.config import ModelConfig, tiny_config

    try:
        config = (
            tiny_config()
            if ns.model == "tiny"
            else ModelConfig.from_directory(Path(ns.model))
        )
    except StructLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # CPU compute is float32 (Paddle has no CPU half-precision matmul)
    for label, value in config.describe("float32").items():
        print(f"{label + ':':<24}{value}")
    return 0


def _generate(ns: argparse.Namespace) -> int:
    from structllm.errors import StructLLMError
    from structllm.llm import LLM
    from structllm.params import OutputKind, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            top_k=ns.top_k,
            min_p=ns.min_p,
            seed=ns.seed,
            stop=ns.stop,
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
