"""transformers baselines for ``structllm bench throughput`` (run in a child).

Reads a JSON job (model dir, workload, threads, modes), prints one JSON line
of results (:func:`run_baselines` starts it from the parent). Greedy, EOS ignored (min_new_tokens = max_new_tokens), so every
system produces exactly the requested number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run_baselines(
    ns: argparse.Namespace, model: str, work: list[tuple[list[int], int]], threads: int
) -> dict[str, dict[str, float]]:
    """In the parent: the baselines of ``work`` in a child running this
    module under ``ns.hf_python`` ({} when torch or transformers is missing)."""
    probe = subprocess.run(
        [ns.hf_python, "-c", "import torch, transformers"], capture_output=True
    )
    if probe.returncode != 0:
        print(
            "transformers baselines skipped: torch/transformers not importable by "
            f"{ns.hf_python} (pass --hf-python)",
            file=sys.stderr,
        )
        return {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {
                "model": model,
                "work": work,
                "threads": threads,
                "batch_size": ns.batch_size,
                "modes": ns.hf_modes.split(","),
            },
            f,
        )
    try:
        proc = subprocess.run(
            [ns.hf_python, "-m", "structllm.bench.hf", f.name],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit("transformers baseline failed")
    result: dict[str, dict[str, float]] = json.loads(
        proc.stdout.strip().splitlines()[-1]
    )
    return result


def main(job_file: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # exactly max_new_tokens each
    work: list[tuple[list[int], int]] = job["work"]
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    results: dict[str, Any] = {}
    total = sum(o for _, o in work)

    def gen(ids: Any, mask: Any, n: int) -> Any:
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=pad,
        )

    with torch.inference_mode():
        gen(torch.tensor([work[0][0][:8]]), None, 2)  # warm-up
        if "single" in job["modes"]:
            start = time.perf_counter()
            for p, o in work:
                gen(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), o)
            s = time.perf_counter() - start
            results["transformers (one at a time)"] = {
                "seconds": s,
                "tokens_per_s": total / s,
            }
        if "static" in job["modes"]:
            bs = job["batch_size"]
            start = time.perf_counter()
            generated = 0
            for i in range(0, len(work), bs):
                chunk = work[i : i + bs]
                width = max(len(p) for p, _ in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for j, (p, _) in enumerate(chunk):  # left padding
                    ids[j, width - len(p) :] = torch.tensor(p)
                    mask[j, width - len(p) :] = 1
                gen(ids, mask, max(o for _, o in chunk))
                generated += len(chunk) * max(o for _, o in chunk)
            s = time.perf_counter() - start
            # tokens_per_s counts the requested tokens; rows that asked for
            # fewer than their batch's longest still generate (waste), which
            # generated_tokens_per_s counts too
            results[f"transformers (static batch {bs})"] = {
                "seconds": s,
                "tokens_per_s": total / s,
                "generated_tokens_per_s": generated / s,
            }
        if "continuous" in job["modes"] and hasattr(model, "generate_batch"):
            from transformers import GenerationConfig

            cfg = GenerationConfig(
                max_new_tokens=max(o for _, o in work),
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=pad,
                num_blocks=2048,
                block_size=16,
                max_batch_tokens=1024,
                scheduler="fifo",
            )
            start = time.perf_counter()
            try:
                outs = model.generate_batch(
                    inputs=[p for p, _ in work], generation_config=cfg
                )
                s = time.perf_counter() - start
                generated = (
                    sum(
                        len(getattr(o, "generated_tokens", ()) or ())
                        for o in outs.values()
                    )
                    or len(work) * cfg.max_new_tokens
                )
                results["transformers (generate_batch)"] = {
                    "seconds": s,
                    "tokens_per_s": total / s,
                    "generated_tokens_per_s": generated / s,
                    "note": "one max_new_tokens (the longest output) for every prompt",
                }
            except Exception as exc:  # report, don't hide
                results["transformers (generate_batch)"] = {
                    "seconds": float("nan"),
                    "tokens_per_s": float("nan"),
                    "error": repr(exc)[:300],
                }
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
