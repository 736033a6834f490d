"""vtcore plugin: the compressed-tensors NVFP4 packed format."""
