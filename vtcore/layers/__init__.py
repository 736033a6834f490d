"""Shared model layers that model-family plugins build their models from."""
