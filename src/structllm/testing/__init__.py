"""Helpers for testing structllm and what is built on it, kept apart from the API.

- :mod:`~structllm.testing.sse`: reading a server's SSE streams to their end
  (raw socket or httpx); ``tools/soak.py``, ``tests/boundary_probe.py`` and
  the tests share it.
"""
