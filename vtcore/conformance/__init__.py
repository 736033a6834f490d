"""The conformance gate: every registered model family proven against its oracle and on the async path.

This package's ``__init__`` stays light (the pytest plugin imports it); the checks import torch
and transformers when they run.
"""

#: The checks, in the order they run; a failed prerequisite turns later checks into skips.
CHECKS = (
    "example",
    "structure",
    "declares-device-tokens",
    "example-strength",
    "parameters",
    "weights",
    "oracle-greedy",
    "oracle-logprobs",
    "oracle-schedule",
    "prefix-cache",
    "speculative",
    "structured",
    "cuda-graphs",
    "cuda-bf16",
    "async-abc",
    "async-batch1-x5",
    "async-concurrency",
    "async-max-tokens",
)

#: The quant section's checks, per registered quant format.
QUANT_CHECKS = ("decode", "tokens")
