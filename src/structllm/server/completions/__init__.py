"""``/v1/completions``: its route, protocol models and serving."""
