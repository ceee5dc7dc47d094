"""``POST /v1/chat/completions/batch``: vLLM's batch of conversations."""
