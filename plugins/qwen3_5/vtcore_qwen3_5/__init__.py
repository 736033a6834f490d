"""vtcore plugin: the Qwen3.5 families (dense and MoE)."""
