"""vtcore plugin: the Qwen2 model family (the second worked example of docs/writing-a-plugin.md)."""
