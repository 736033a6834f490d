"""vtcore plugin: the Llama model family (the worked example of docs/writing-a-plugin.md)."""
