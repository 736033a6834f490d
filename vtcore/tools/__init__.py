"""Offline tools that run beside the engine, never inside it (``vtcore quantize``); the runtime imports none."""
