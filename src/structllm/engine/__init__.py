"""The engine layer: prompts in, text out, around an :class:`EngineCore`."""
