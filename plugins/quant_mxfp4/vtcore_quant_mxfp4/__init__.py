"""vtcore plugin: the compressed-tensors MXFP4 packed format."""
