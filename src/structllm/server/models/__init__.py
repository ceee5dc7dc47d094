"""``/v1/models`` and ``/v1/models/{id}``: their route and models."""
