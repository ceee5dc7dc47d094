"""``POST /v1/embeddings``: OpenAI's embeddings API (vLLM's fields beside it)."""
