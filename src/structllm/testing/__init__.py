"""Helpers for testing structllm and what is built on it, kept apart from the API.

- :mod:`~structllm.testing.checkpoints`: :func:`make_tiny_model`, random-weight
  checkpoints of every supported family in Hugging Face layout (``structllm
  make-tiny-model``; also ``structllm.models.make_tiny_model``).
- :mod:`~structllm.testing.sse`: reading a server's SSE streams to their end
  (raw socket or httpx); ``tools/soak.py``, ``tests/boundary_probe.py`` and
  the tests share it.
- :mod:`~structllm.testing.faults`: :func:`inject_fault`, a fault (raise,
  hang, exit at a step) for the engine cores started inside a ``with`` block.
"""
