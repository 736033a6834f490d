"""vtcore plugin: the Qwen3 dense model family."""
