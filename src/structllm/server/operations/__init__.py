"""``/health``, ``/metrics`` and ``/version``: their routes and models."""
