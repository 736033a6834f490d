"""Triton kernels and their torch references (same signatures): the ground floor of vtcore, importing
nothing from the rest of it (``[tool.importlinter]`` in pyproject.toml holds that). Each kernel module
imports triton itself, so importing this package imports none; ``fp4`` (the FP4 weight operand and its
torch decode) imports no Triton at all."""
