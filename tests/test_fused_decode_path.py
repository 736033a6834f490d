"""The decode path's fused launches, run in the Triton interpreter on CPU through a whole model.

On CUDA, Linear calls of <= 16 rows take the Triton GEMV, and the decoder layer hands the
residual add + RMSNorm to the GEMV of the next Linear (``gemv_rms_norm``) and SwiGLU to the
down projection's (``gemv_silu_and_mul``); FP4 GEMVs take no prologue, and the SwiGLU runs as
gate_up's epilogue instead (``gemv_swiglu``). Here ``use_gemv`` is pointed at CPU tensors, so the
same layer code runs those kernels in the interpreter (float32: the interpreter's dot mishandles
bf16), and the tokens and logprobs must match the plain torch path. One sequence at a time: the
prologues run at one row only (``PROLOGUE_MAX_ROWS``).
"""
from __future__ import annotations

import math

import pytest

from vtcore import SamplingParams
from vtcore.conformance.harness import build_engine
from vtcore.kernels.rmsnorm import INTERPRET
from vtcore.layers import linear

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")

KNOBS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=200, max_num_seqs=1)


def _generate(path: str) -> tuple[dict[str, object], int]:
    """Finished outputs by request id, and the model's layer count."""
    eng = build_engine(path, "sync", **KNOBS)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate([[5, 9, 2], [7], [3, 3, 8, 1]]):
        eng.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done, len(eng.runner.model.model.layers)


@pytest.fixture(scope="module", params=[None, "NVFP4A16"])  # MXFP4: the kernel tests
def checkpoint(request, tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny checkpoint, dense and as compressed-tensors' NVFP4A16 (the FP4 GEMV's path)."""
    if request.param is None:
        return tiny_checkpoint[0]
    pytest.importorskip("compressed_tensors")
    from vtcore.tools.quantize import quantize_checkpoint

    dst = str(tmp_path_factory.mktemp(request.param))
    quantize_checkpoint(tiny_checkpoint[0], dst, request.param)
    return dst


def test_fused_gemv_decode_equals_torch(checkpoint, monkeypatch) -> None:
    """Dense weights with the norm and SwiGLU prologues, and packed FP4 ones decoded inside the GEMV
    with the SwiGLU epilogue (the torch path decodes them transiently in float32); the qkv GEMV
    finishing q/k/v itself (norm, RoPE, cache write) in both."""
    from vtcore.kernels import gemv
    from vtcore.kernels.fp4 import FP4Weight

    ref, layers = _generate(checkpoint)
    calls = {"gemv_rms_norm": 0, "gemv_silu_and_mul": 0, "gemv_swiglu": 0, "gemv_qk_rope": 0, "gemv": 0}
    fp4_calls = []
    for name in calls:
        def spy(*args, _f=getattr(gemv, name), _n=name, **kwargs):
            calls[_n] += 1
            fp4_calls.extend(a for a in args if isinstance(a, FP4Weight))
            return _f(*args, **kwargs)
        monkeypatch.setattr(gemv, name, spy)
    monkeypatch.setattr(linear, "use_gemv", lambda x: True)
    monkeypatch.setattr(gemv, "num_sms", lambda device: 4)  # few, large programs: the interpreter runs them one by one
    got, _ = _generate(checkpoint)
    if "FP4" in checkpoint:
        # qkv, o, gate_up and down of every one-row forward (9 decode steps and the 1-token prompt's
        # prefill) take the FP4 GEMV, without prologues; gate_up with the SwiGLU epilogue, qkv (but
        # the first layer's, which has no residual) with the q/k norm, RoPE and KV-write epilogue
        assert len(fp4_calls) == 4 * layers * 10 and calls["gemv_swiglu"] == layers * 10
        assert calls["gemv_qk_rope"] == (layers - 1) * 10
        assert calls["gemv_rms_norm"] == calls["gemv_silu_and_mul"] == 0
    else:
        # each of the 3 requests' 3 decode steps, in every layer: both norms fused (but the first
        # layer's input norm, which has no residual to add; the others with the qkv GEMV's q/k norm,
        # RoPE and KV-write epilogue) and SwiGLU fused
        assert calls["gemv_rms_norm"] >= 9 * layers and calls["gemv_silu_and_mul"] >= 9 * layers
        assert calls["gemv_qk_rope"] >= 9 * (layers - 1)
        assert not fp4_calls and calls["gemv_swiglu"] == 0
    assert calls["gemv"] > 0  # o_proj and lm_head
    for rid, want in ref.items():
        have = got[rid]
        assert have.token_ids == want.token_ids, rid
        for a, b in zip(have.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4) for t in a)
