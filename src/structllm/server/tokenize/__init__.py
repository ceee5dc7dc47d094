"""``/tokenize`` and ``/detokenize``: their routes, protocol models and serving."""
