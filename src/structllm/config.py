"""The settings users pass, in one place, and the command-line flags made from them.

==================  =========================================================
:class:`EngineConfig`    the engine core: model, KV cache, batch limits
                         (``LLM(model, **fields)``, ``AsyncLLM.open``)
:class:`FrontendConfig`  ``AsyncLLM``'s front end: where the core runs, its
                         supervision, admission limits
:class:`ServerConfig`    ``structllm serve``: listening, HTTP limits, defaults
==================  =========================================================

Each field is a :func:`~structllm.settings.setting`: it carries its
command-line help and its topic (a ``--help`` group, :data:`TOPICS`), so
:func:`add_arguments` / :func:`add_grouped_arguments` turn the fields into
``argparse`` flags (``max_num_seqs`` becomes ``--max-num-seqs``) and
:func:`from_arguments` builds the config back from the parsed namespace:
every default lives here once. Those helpers live in
:mod:`structllm.settings`, :class:`ServerConfig` in
:mod:`structllm.server_config`; all are re-exported here.

A value that cannot work raises :class:`~structllm.errors.EngineConfigError`
naming the field when the config is built, whoever builds it (``LLM``,
``AsyncLLM.open``, the command line): types, ``Literal`` choices and bounds
are checked here, what depends on the model when the core loads it. This
module is in the types layer: attrs, ``settings``, ``errors`` and
``params``.
"""

from __future__ import annotations

from typing import Literal

import attrs

from structllm._cores import cpu_cores
from structllm.errors import EngineConfigError
from structllm.server_config import ServerConfig, check_lora_modules
from structllm.settings import (
    TOPICS,
    add_arguments,
    add_grouped_arguments,
    at_least,
    check_address,
    check_api_keys,
    check_config,
    from_arguments,
    parse_address,
    setting,
    split_fields,
)
from structllm.speculative_config import SpeculativeConfig, speculative_config

__all__ = [
    "TOPICS",
    "EngineConfig",
    "FrontendConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "add_arguments",
    "add_grouped_arguments",
    "at_least",
    "check_address",
    "check_api_keys",
    "check_config",
    "check_lora_modules",
    "from_arguments",
    "parse_address",
    "setting",
    "split_fields",
]

_GiB = 1 << 30
_ONE = at_least(1)
_ZERO = at_least(0)
_POSITIVE = at_least(0, above=True)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How to build an engine core. Every field but ``model`` has a working default."""

    model: str = setting(
        help="a model directory, a .gguf file, a Hugging Face Hub repo id "
        "(owner/name[@revision]), or a built-in name (see structllm.models)",
        cli=False,
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        help="compute dtype; auto: float32 on CPU, else the checkpoint's",
        topic="model",
    )
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = setting(
        "auto",
        help="auto: by the model's files; dummy: random weights from its config alone",
        topic="model",
    )
    quantization: Literal["auto", "none", "q8_0", "q4_0", "q4_1", "q4_k"] = setting(
        "auto",
        help="auto: a GGUF file's weights stay in their quantized blocks, a float "
        "checkpoint's in float32; none: dequantize a GGUF file to float32; "
        "q8_0/q4_0/q4_1/q4_k: quantize a float checkpoint's projections at load "
        "(q4_k: llama-quantize's Q4_K_M mix of Q4_K and Q6_K)",
        topic="model",
    )
    quantized_activations: Literal["float", "q8"] = setting(
        "float",
        help="how quantized projections take their input: float, or q8 "
        "(quantized to 8 bits first, as llama.cpp does; needs quantized weights)",
        topic="model",
    )
    seed: int = setting(0, help="seed for dummy weights", cli=False)
    block_size: int = setting(
        16, help="tokens per KV block", validator=_ONE, topic="engine"
    )
    num_blocks: int | None = setting(
        None,
        help="KV blocks (default: as many as fit in --kv-cache-memory)",
        validator=_ONE,
        topic="engine",
    )
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = setting(
        "auto",
        help="how the KV cache stores keys and values; auto: float16 for "
        "quantized weights on the CPU kernels (a GGUF file, --quantization; as "
        "llama.cpp caches them), else the model's dtype; float16 or bfloat16: "
        "half the memory and memory traffic of a float32 cache, rounded to "
        "nearest even (the CPU attention kernels only; see docs/benchmarks.md "
        "for the effect on tokens)",
        topic="engine",
    )
    kv_cache_memory: int = setting(
        _GiB // 2,
        help="the most bytes the KV cache may hold when --num-blocks is not "
        "given (it holds at most max_num_seqs sequences of max_model_len; on "
        "CPU its pages are committed as blocks are first used, not at start)",
        validator=_ONE,
        topic="engine",
    )
    max_model_len: int | None = setting(
        None,
        help="longest prompt + output (default: the model's max_position_embeddings)",
        validator=at_least(2),  # a prompt of one token, and one to sample
        topic="engine",
    )
    max_num_seqs: int = setting(
        64, help="most sequences in one batch", validator=_ONE, topic="engine"
    )
    max_num_batched_tokens: int = setting(
        1024, help="most tokens in one step", validator=_ONE, topic="engine"
    )
    enable_chunked_prefill: bool = setting(
        True,
        help="split prompts longer than the token budget over several steps",
        topic="engine",
    )
    enable_prefix_caching: bool = setting(
        True, help="reuse the KV blocks of repeated prompt prefixes", topic="engine"
    )
    scheduling_order: Literal["edf", "fcfs"] = setting(
        "edf",
        help="within a priority, edf: requests with the earliest deadline first "
        "(a caller's cancel scope, or a server request's timeout), then the "
        "others first-come first-served; fcfs: arrival order only (expired "
        "requests are dropped either way)",
        topic="engine",
    )
    deadline_starvation_s: float = setting(
        30.0,
        help="with --scheduling-order edf, a request without a deadline ranks "
        "as if due this many seconds after it arrived, so deadlines never "
        "starve it",
        validator=_POSITIVE,
        topic="engine",
    )
    max_pinned_fraction: float = setting(
        0.5,
        help="the largest fraction of the KV blocks that pinned prefixes "
        "(AsyncLLM.pin) may hold; a pin beyond it is refused",
        validator=at_least(0, at_most=1),
        topic="engine",
    )
    num_threads: int | None = setting(
        None,
        help="CPU threads for Paddle's math (default: every usable core)",
        validator=_ONE,
        topic="model",
    )
    tensor_parallel_size: int = setting(
        1,
        help="processes the model is split over, Megatron-style (each loads "
        "its shard; gloo on CPU, NCCL on GPUs; see docs/parallel.md)",
        validator=_ONE,
        topic="model",
    )
    tensor_parallel_listen: str | None = setting(
        None,
        help="HOST:PORT where rank 0 waits for the follower ranks, started on "
        "other machines with `python -m structllm.engine.rank_group --connect "
        "HOST:PORT` (default: rank 0 starts them itself, on this machine)",
        validator=check_address,
        metavar="HOST:PORT",
        topic="model",
    )
    tensor_parallel_connect_timeout: float = setting(
        120.0,
        help="seconds rank 0 waits for every follower to connect to "
        "--tensor-parallel-listen before it fails",
        validator=_POSITIVE,
        topic="model",
    )
    model_backend: Literal["auto", "eager", "inference"] = setting(
        "auto",
        help="inference: oneDNN predictors (Paddle Inference); auto runs eager "
        "(float32 projections on the packed-panel CPU kernels) and picks the "
        "predictors only where those kernels cannot run (no numba), for float32 "
        "CPU models of 10M+ parameters on CPUs other than Intel's",
        topic="model",
    )
    enable_lora: bool = setting(
        False,
        help="serve LoRA adapters (PEFT's format) over the model, chosen per "
        "request and loaded at run time (see docs/architecture.md)",
        topic="model",
    )
    max_loras: int = setting(
        1,
        help="with --enable-lora, adapters the model holds at once; a batch "
        "mixes at most this many, the least recently used idle one making room",
        validator=_ONE,
        topic="model",
    )
    max_cpu_loras: int | None = setting(
        None,
        help="with --enable-lora, adapters kept read on the host (default: "
        "--max-loras); past it the least recently used one that no request "
        "uses is forgotten, and read again from its path when named again",
        validator=_ONE,
        topic="model",
    )
    max_lora_rank: int = setting(
        16,
        help="with --enable-lora, the highest adapter rank (r) loaded; the "
        "slots are allocated at this rank",
        validator=_ONE,
        topic="model",
    )
    speculative_config: SpeculativeConfig | None = setting(  # noqa: RUF009 (frozen)
        None,
        help='speculative decoding, as JSON in vLLM\'s form: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5} (prompt lookup) or {"method": "draft_model", '
        '"model": REF, "num_speculative_tokens": 4} (a draft model with the '
        'same tokenizer); the output is unchanged; "disable_by_batch_size": N '
        "pauses it while more than N requests run, default 1; see "
        "docs/benchmarks.md)",
        converter=speculative_config,
        parse=str,
        metavar="JSON",
        topic="engine",
    )

    def __attrs_post_init__(self) -> None:
        check_config(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise EngineConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                f"({self.max_loras}): the adapters in slots are kept on the host",
                field="max_cpu_loras",
            )
        if self.tensor_parallel_listen is not None and self.tensor_parallel_size < 2:
            raise EngineConfigError(
                "tensor_parallel_listen waits for follower ranks: it needs "
                f"tensor_parallel_size > 1, not {self.tensor_parallel_size}",
                field="tensor_parallel_listen",
            )

    def cpu_threads(self, processes: int = 1) -> int:
        """Paddle threads for each rank: ``num_threads``, or this machine's
        cores shared out among ``processes`` engines of ``tensor_parallel_size``
        ranks each (at least 1)."""
        if self.num_threads is not None:
            return self.num_threads
        return max(1, cpu_cores() // (processes * self.tensor_parallel_size))


@attrs.frozen(kw_only=True)
class FrontendConfig:
    """Front-end settings of :meth:`AsyncLLM.open` (engine settings are separate)."""

    executor: Literal["process", "inline"] = setting(
        "process",
        help="where the engine core runs: a child process, or a thread",
        topic="engine",
    )
    tokenizer: str | None = setting(
        None, help="tokenizer directory (default: the model's)", topic="model"
    )
    data_parallel_size: int = setting(
        1,
        help="engine replicas (each its own core process) behind one front end; "
        "a request goes to the one holding its prompt's prefix, within a load "
        "bound, else to the least-loaded one (see docs/parallel.md)",
        validator=_ONE,
        topic="engine",
    )
    max_queued_requests: int | None = setting(
        None,
        help="refuse new requests (overloaded) once this many wait beyond "
        "--max-num-seqs (default: no limit)",
        validator=_ZERO,
        topic="limits",
    )
    shutdown_grace: float = setting(
        5.0,
        help="seconds that stopping the engine waits for in-flight requests",
        validator=_ZERO,
        topic="supervision",
    )
    heartbeat_interval: float = setting(
        1.0,
        help="seconds between core heartbeats",
        validator=_POSITIVE,
        topic="supervision",
    )
    heartbeat_timeout: float = setting(
        10.0,
        help="a core silent this long (no heartbeat, no step) is declared dead",
        validator=_POSITIVE,
        topic="supervision",
    )
    step_timeout: float = setting(
        300.0,
        help="the longest one step may run: a core keeps sending heartbeats "
        "through a slow step for this long, then goes silent (a wedged step), "
        "and --heartbeat-timeout later it is declared dead",
        validator=_POSITIVE,
        topic="supervision",
    )
    startup_timeout: float = setting(
        600.0,
        help="seconds the core may take to load",
        validator=_POSITIVE,
        topic="supervision",
    )
    max_restarts: int = setting(
        3,
        help="core restarts allowed within --restart-window seconds",
        validator=_ZERO,
        topic="supervision",
    )
    restart_window: float = setting(
        300.0, help="see --max-restarts", validator=_POSITIVE, topic="supervision"
    )
    restart_backoff: float = setting(
        0.25,
        help="seconds before the first restart",
        validator=_ZERO,
        topic="supervision",
    )
    show_progress: bool = setting(
        True, help="progress bars while the model loads", topic="logging"
    )
    max_prompt_bytes: int | None = setting(
        None,
        help="refuse longer prompts (UTF-8 bytes) before tokenising "
        "(default: 32 per token of max-model-len, at least 64 KiB)",
        validator=_ONE,
        topic="limits",
    )
    health_timeout: float | None = setting(
        None,
        help="report unhealthy once the core has been silent this long "
        "(default: 3 heartbeat intervals)",
        validator=_POSITIVE,
        topic="supervision",
    )

    def __attrs_post_init__(self) -> None:
        check_config(self)
        if self.data_parallel_size > 1 and self.executor == "inline":
            raise EngineConfigError(
                f"data_parallel_size={self.data_parallel_size} runs one core "
                "process per replica: use executor='process', not 'inline'",
                field="data_parallel_size",
            )
