"""The OpenAI-compatible HTTP server (``structllm serve``)."""
