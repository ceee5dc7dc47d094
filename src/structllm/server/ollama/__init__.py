"""Ollama's API (``/api/generate``, ``/api/chat``, ``/api/tags``, ...): its
routes, protocol models and serving."""
