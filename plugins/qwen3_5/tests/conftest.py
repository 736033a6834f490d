"""Shared setup of the Qwen3.5 plugin's tests."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine spinning
    OpenMP workers (beside the async engine's forward thread) made run times swing 10x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
