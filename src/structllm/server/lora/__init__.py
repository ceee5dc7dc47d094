"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters
loaded and unloaded at run time (vLLM's routes), and the server's adapters
by name."""
