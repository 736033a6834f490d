"""Shared setup of the Qwen3.5 plugin's tests."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch

from vtcore.testing.oracle import hf_model, save_checkpoint
from vtcore_qwen3_5.plugin import dense_example, moe_example

EXAMPLES = {"dense": dense_example(), "moe": moe_example()}
SEED = 41


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine spinning
    OpenMP workers (beside the async engine's forward thread) made run times swing 10x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move HF's initial norms (0 or 1) and dt_bias (1), so that loading them matters."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("dt_bias"):
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.fixture(scope="session")
def quantized_store(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """``store(family, scheme)``: {"hf": the dense HF model, "src", "path": the quantized folder,
    "tokens": vtcore's greedy tokens on PROMPTS (filled by the first test)}; built once each."""
    from vtcore.tools.quantize import quantize_checkpoint

    hf: dict[str, tuple[torch.nn.Module, str]] = {}
    made: dict[tuple[str, str], dict[str, Any]] = {}

    def get(family: str, scheme: str) -> dict[str, Any]:
        if family not in hf:
            example = EXAMPLES[family]
            model = hf_model(example.hf_config, seed=SEED, oracle=example.oracle)
            _perturb(model, SEED)
            hf[family] = model, save_checkpoint(model, str(tmp_path_factory.mktemp(f"{family}-src")))
        if (family, scheme) not in made:
            model, src = hf[family]
            dst = str(tmp_path_factory.mktemp(f"{family}-{scheme}"))
            quantize_checkpoint(src, dst, scheme, show_progress=False)
            made[family, scheme] = {"hf": model, "src": src, "path": dst, "tokens": None}
        return made[family, scheme]

    return get
