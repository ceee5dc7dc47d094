"""A process that compiles the kernels computes the bits of one that loads
them from numba's disk cache.

numba links a compiled helper's optimized code into each caller as a weak
copy, optimized again there. The process that compiled the helper calls
its own copy; a later one, loading the callers from the cache, never loads
it and runs a caller's copy: with fast-math, other code, other last bits,
and after 30 layers other logits (2026-12, SmolLM2's batch-16 decode). The
entry points are therefore compiled whole (see ``kernels._jit``); this
runs each from a cold cache and from the warm one it left.

The threaded entry points (``parallel=True``) still differ: numba compiles
a parallel loop's body as a function of its own, linked into the kernel
the same way, and it cannot be inlined; they are left out here until they
are rebuilt (the report of branch ``determ`` has the evidence).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from structllm.model import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no numba")

#: every serial entry point on a step-like input (one thread: the threaded
#: ones still differ, see the module doc); prints a digest of the outputs
#: and how many of the entry points it ran came from the disk cache
_STEP = """
    import hashlib
    import numpy as np
    from structllm.model import kernels

    rng = np.random.default_rng(0)
    b, nh, kvh, d, n, bs = 4, 6, 2, 64, 37, 8
    per = -(-n // bs)
    k_cache = rng.standard_normal((kvh, b * per * bs, d)).astype(np.float32)
    v_cache = rng.standard_normal((kvh, b * per * bs, d)).astype(np.float32)
    tables = np.arange(b * per, dtype=np.int64).reshape(b, per)
    lens = np.full(b, n, np.int64)
    positions = lens - 1
    slots = tables[:, (n - 1) // bs] * bs + (n - 1) % bs
    qkv = rng.standard_normal((b, (nh + 2 * kvh) * d)).astype(np.float32)
    angles = rng.standard_normal((n, d // 2)).astype(np.float32)
    cos = np.concatenate([np.cos(angles)] * 2, 1)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], 1)
    outs = []
    k2, v2 = k_cache.copy(), v_cache.copy()
    q = np.empty((b, nh, d), np.float32)
    out = np.empty_like(q)
    fn, args = kernels.rope_write_attend_call(
        qkv, positions, cos, sin, None, None, 1e-5, k2, v2, slots, q,
        tables, lens, None, d**-0.5, bs, out,
    )
    fn(*args)
    outs += [q, out, k2, v2]
    outs.append(kernels.decode_attention(q, k2, v2, tables, lens, 16, d**-0.5, bs))
    q = np.empty((b, nh, d), np.float32)
    kernels.rope_and_write(
        qkv, positions, cos, sin, nh, None, None, 1e-5, k_cache, v_cache, slots, q
    )
    outs.append(q)
    x = rng.standard_normal((b, 96)).astype(np.float32)
    normed = np.empty_like(x)
    outs.append(kernels.add_rms_norm(x, x[0].copy(), 1e-5, normed, delta=x.copy()))
    gate_up = rng.standard_normal((b, 192)).astype(np.float32)
    outs.append(kernels.swiglu(gate_up, np.empty((b, 96), np.float32)))
    digest = hashlib.sha256(b"".join(a.tobytes() for a in outs)).hexdigest()
    entries = [
        kernels._rope_write_attend, kernels._decode_attention,
        kernels._rope_and_write, kernels._add_rms_norm, kernels._swiglu,
    ]
    used = [f for f in entries if f.signatures]
    hits = sum(sum(f.stats.cache_hits.values()) > 0 for f in used)
    print(digest, hits, len(used))
"""


def _step(cache: Path, script: str = _STEP) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NUMBA_CACHE_DIR": str(cache)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow
def test_a_cold_compile_and_the_cache_it_left_give_the_same_bits(
    tmp_path: Path,
) -> None:
    cold_digest, cold_hits, entries = _step(tmp_path)
    warm_digest, warm_hits, _ = _step(tmp_path)
    assert (cold_hits, warm_hits) == ("0", entries)  # compiled, then loaded
    assert warm_digest == cold_digest


#: the serial prefill kernel on a step of chunks; prints a digest of its
#: output and whether it came from the disk cache
_PREFILL = """
    import hashlib
    import numpy as np
    from structllm.model import kernels

    rng = np.random.default_rng(0)
    nh, kvh, d, bs = 6, 2, 64, 8
    k_cache, v_cache = rng.standard_normal((2, kvh, 40 * bs, d)).astype(np.float32)
    chunks = np.array([[0, 37, 0], [37, 57, 13], [57, 60, 40]], np.int64)
    tables = rng.permutation(39).reshape(3, 13).astype(np.int64)
    q = rng.standard_normal((60, nh, d)).astype(np.float32)
    out = np.zeros_like(q)
    items = kernels.prefill_items(chunks, nh, kvh)
    kernels.prefill_attention(
        q, k_cache, v_cache, chunks, tables, items, 16, d**-0.5, bs, out
    )
    f = kernels._prefill_attention
    print(hashlib.sha256(out.tobytes()).hexdigest(), sum(f.stats.cache_hits.values()))
"""


@pytest.mark.slow
def test_the_prefill_kernel_computes_the_same_bits_from_the_disk_cache(
    tmp_path: Path,
) -> None:
    cold_digest, cold_hits = _step(tmp_path, _PREFILL)
    warm_digest, warm_hits = _step(tmp_path, _PREFILL)
    assert (cold_hits, warm_hits) == ("0", "1")  # compiled, then loaded
    assert warm_digest == cold_digest
