"""A test kit for vtcore and its plugins: tiny HF checkpoints and the HF-oracle comparisons."""
