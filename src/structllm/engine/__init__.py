"""The engine layer: prompts in, text out, around an :class:`EngineCore`.

Three programs, each in its room:

- :mod:`~structllm.engine.frontend`: the front end in the caller's process
  (``AsyncLLM``, its request streams, the supervision of the cores);
- :mod:`~structllm.engine.core_process`: the engine core's process
  (``python -m structllm.engine.core_process``);
- :mod:`~structllm.engine.rank_group`: the follower ranks of a
  tensor-parallel core (``python -m structllm.engine.rank_group``).

What they share is public here: :mod:`~structllm.engine.protocol` (the
messages between the front end and the core process),
:mod:`~structllm.engine.child` (what every child process does) and
:mod:`~structllm.engine.statistics` (``EngineStatistics``).
"""
