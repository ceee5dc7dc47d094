"""The HTTP routes, one module per API; each only hands over to its serving.

``completions`` and ``chat`` call :class:`~structllm.server.serving_completion.CompletionServing`
and :class:`~structllm.server.serving_chat.ChatServing`, found on
``app.state``; ``tokenize`` (``/tokenize``, ``/detokenize``) calls
:class:`~structllm.server.serving_tokenize.TokenizeServing`; ``models``
(``/v1/models``, ``/v1/models/{id}``) and ``operations`` (``/health``,
``/metrics``, ``/version``) are small enough to answer themselves.
"""

from __future__ import annotations

from structllm.server.routes import chat, completions, models, operations, tokenize

__all__ = ["chat", "completions", "models", "operations", "tokenize"]
