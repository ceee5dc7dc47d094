"""``structllm bench``: measurements, kept apart from the API they measure.

- :mod:`~structllm.bench.model`: the bench checkpoint and the flags shared by
  the offline benchmarks.
- :mod:`~structllm.bench.throughput`: offline throughput (``LLM``,
  ``EngineCore``, ``AsyncLLM``), optionally against transformers.
- :mod:`~structllm.bench.hf`: the transformers side, run in a child process by
  a Python that has torch (``--hf-python``).
- :mod:`~structllm.bench.prefix`: prefix-cache workloads (chat turns, few-shot).
- :mod:`~structllm.bench.serve` and :mod:`~structllm.bench.serve_results`:
  load-test any OpenAI-compatible server, as ``vllm bench serve`` does.
"""
