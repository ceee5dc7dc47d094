"""The core process: a program of its own, ``python -m structllm.engine.core_process``.

:mod:`~structllm.engine.core_process.loop` runs an engine core behind a socket
(:func:`serve`; :func:`main` is the command). It speaks
:mod:`structllm.engine.protocol` with the front end, starts the follower
ranks of a tensor-parallel group (:mod:`structllm.engine.rank_group`), and
shares with them :mod:`structllm.engine.child` (the parent watch, test
faults, peak memory).
"""

from __future__ import annotations

from structllm.engine.core_process.loop import main, serve

__all__ = ["main", "serve"]
