"""On a GPU: Qwen3.5 (hybrid Gated DeltaNet + attention; dense and MoE) decodes in CUDA graphs with
the Triton GDN decode step and the fused MoE, async equals sync at batch 1, 3 and 16, and the graphed
engine stays on the HF oracle. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from vtcore import SamplingParams
from vtcore.conformance.harness import build_engine, mixed_arrivals, run_engine
from vtcore.testing.oracle import hf_model, near_tie_violations, save_checkpoint
from vtcore_qwen3_5.plugin import dense_example, moe_example

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EXAMPLES = {"dense": dense_example(), "moe": moe_example()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    out = {}
    for family, example in EXAMPLES.items():
        model = hf_model(example.hf_config, seed=3, oracle=example.oracle)
        out[family] = save_checkpoint(model, str(tmp_path_factory.mktemp(f"gpu-{family}"))), model
    return out


def _arrivals(n: int) -> dict:
    if n == 1:
        return {0: [("solo", [5, 9, 2, 7], SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True,
                                                          logprobs=1))]}
    return mixed_arrivals(n, n, vocab_size=512)


@pytest.mark.parametrize("family", list(EXAMPLES))
@pytest.mark.parametrize("n", [1, 3, 16])
def test_async_equals_sync_with_graphs(checkpoints, family: str, n: int) -> None:
    path, model = checkpoints[family]
    knobs = dict(device="cuda", dtype="float32", max_num_seqs=16, num_kv_blocks=256)
    sync, asyn = build_engine(path, "sync", **knobs), build_engine(path, "async", **knobs)
    got = run_engine(asyn, _arrivals(n))[0]
    assert got == run_engine(sync, _arrivals(n))[0]
    assert asyn.runner.graph_replays > 0 and asyn.runner.consuming_forwards == asyn.runner.stale_forwards
    prompts = {rid: (ids, p) for group in _arrivals(n).values() for rid, ids, p in group}
    for rid, (ids, params) in prompts.items():
        if params.temperature == 0:
            assert near_tie_violations(model, ids, got[rid]) == [], rid
