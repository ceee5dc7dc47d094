"""llama.cpp's native API (``/completion``, ``/tokenize`` with ``content``,
``/props``, ``/slots``) and its routes without ``/v1``: routes, protocol
models and serving."""
