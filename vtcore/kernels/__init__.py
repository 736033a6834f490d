"""Triton kernels; each module imports triton itself, so import them lazily."""
