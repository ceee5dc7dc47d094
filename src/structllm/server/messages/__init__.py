"""``/v1/messages`` (Anthropic's Messages API) and ``/v1/messages/count_tokens``:
its route, protocol models, serving and streamed events."""
