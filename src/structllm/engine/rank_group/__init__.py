"""The tensor-parallel ranks: a program of their own beside the core process.

Rank 0 is the core process; :mod:`~structllm.engine.rank_group.group` is its
side (:class:`RankGroup`: start or accept the followers, broadcast each
step, watch them). :mod:`~structllm.engine.rank_group.follower` is the
follower program (``python -m structllm.engine.rank_group``), which runs
the forward of every step rank 0 sends. Both speak
:mod:`~structllm.engine.rank_group.protocol` and set their
``paddle.distributed`` variables with :mod:`~structllm.engine.rank_group.env`;
what a follower shares with the core process (the parent watch, test
faults) is :mod:`structllm.engine.child`.
"""

from __future__ import annotations

from structllm.engine.rank_group.follower import main
from structllm.engine.rank_group.group import EXIT_TIMEOUT, RankGroup

__all__ = ["EXIT_TIMEOUT", "RankGroup", "main"]
