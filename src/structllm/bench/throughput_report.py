"""``structllm bench throughput``'s printed report of its JSON result."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["print_report"]


def print_report(r: dict[str, Any]) -> None:
    """The systems' table, acceptance, front-end and step overheads."""
    m = r["model"]
    print(
        f"model: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab "
        f"{m['vocab_size']}; {r['num_prompts']} {r['workload']} prompts, "
        f"{r['input_tokens']} input / {r['output_tokens']} output tokens; "
        f"{r['threads']} threads"
    )
    if r["speculative_config"] is not None:
        print(f"speculative_config: {json.dumps(r['speculative_config'])}")
    base = r["systems"]["structllm"]["tokens_per_s"]
    print(
        f"{'system':<38}{'seconds':>9}{'out tok/s':>11}{'structllm x':>13}{'gen tok/s':>11}"
    )
    for name, s in r["systems"].items():
        tps = s["tokens_per_s"]
        gen = s.get("generated_tokens_per_s", tps)
        print(
            f"{name:<38}{s['seconds']:>9.2f}{tps:>11.1f}{base / tps:>13.2f}{gen:>11.1f}"
        )
    print(
        "out tok/s counts requested tokens; gen tok/s also counts tokens a "
        "baseline generated past a request's length (padding to its batch's longest)"
    )
    for name, s in r["systems"].items():
        if "acceptance_rate" in s:
            print(
                f"{name}: {s['accepted_tokens']} of {s['proposed_tokens']} proposed "
                f"tokens accepted ({100 * s['acceptance_rate']:.1f}%)"
            )
    if "frontend_overhead" in r:
        pairs = ", ".join(f"{100 * x:.1f}%" for x in r["frontend_overhead_runs"])
        print(
            "front-end overhead (EngineCore tok/s / AsyncLLM tok/s - 1), median of "
            f"{len(r['frontend_overhead_runs'])} alternating pairs: "
            f"{100 * r['frontend_overhead']:.1f}% ({pairs})"
        )
    o = r["overhead"]
    print(
        f"overhead at batch {o['batch']} (decode): step {o['step_ms']:.2f} ms, forward "
        f"{o['forward_ms']:.2f} ms -> {100 * o['overhead']:.1f}%"
    )
