"""The HTTP routes, one module per API; each only hands over to its serving.

``completions`` and ``chat`` call :class:`~structllm.server.serving_completion.CompletionServing`
and :class:`~structllm.server.serving_chat.ChatServing`, found on
``app.state``; ``models`` and ``operations`` (``/health``, ``/metrics``)
are small enough to answer themselves.
"""

from __future__ import annotations

from structllm.server.routes import chat, completions, models, operations

__all__ = ["chat", "completions", "models", "operations"]
