"""QKVAttention's separate q/k/v and output-projection biases (Qwen2: q/k/v bias, no o bias), and that
every path a bias takes adds it: the torch path, and the decode GEMV whose epilogue norms, rotates and
caches q/k/v (``Linear.forward_qk_rope``, run here in the Triton interpreter)."""
from __future__ import annotations

import pytest
import torch

from vtcore.config import HFConfig
from vtcore.kernels import gemv
from vtcore.kernels.rmsnorm import INTERPRET
from vtcore.layers import linear
from vtcore.layers.decoder import QKVAttention
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding
from vtcore.testing.layers import sequence_step as step
from vtcore.testing.oracle import tiny_config

BLOCK, PROMPT = 8, 5  # a prompt of 5 tokens in one 8-slot block, then one decode token


def attention(qkv_bias: bool | None, o_bias: bool | None, attention_bias: bool = False) -> QKVAttention:
    """A QKVAttention of the tiny config (4 heads, 2 kv heads, head_dim 16) with seeded parameters and
    an empty cache of two blocks."""
    config = HFConfig(tiny_config(attention_bias=attention_bias))
    attn = QKVAttention(config, RotaryEmbedding(config.head_dim, 64, 10000.0), qkv_bias=qkv_bias, o_bias=o_bias)
    gen = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    attn.attn.k_cache, attn.attn.v_cache = (torch.zeros(2 * BLOCK, 2, 16) for _ in range(2))
    attn.attn.block_size = BLOCK
    return attn


@pytest.mark.parametrize("qkv_bias, o_bias, attention_bias, expected", [
    (True, False, False, (True, False)),  # Qwen2
    (False, True, True, (False, True)),  # each overrides attention_bias
    (None, None, True, (True, True)),  # None: the config's attention_bias, as before
    (None, None, False, (False, False)),
])
def test_bias_knobs_decide_the_parameters(qkv_bias, o_bias, attention_bias, expected) -> None:
    attn = attention(qkv_bias, o_bias, attention_bias)
    names = {n for n, _ in attn.named_parameters()}
    assert ("qkv_proj.bias" in names, "o_proj.bias" in names) == expected
    if expected[0]:
        assert attn.qkv_proj.bias.shape == (8 * 16,) and attn.qkv_proj.bias.shards == ("q", "k", "v")


def test_each_qkv_bias_shard_moves_the_output() -> None:
    """Zeroing the q, k or v part of the bias changes the prefill output (a dropped bias would not).
    Compared past the first token: with one key to attend to, only v counts; with several, q's and
    (through RoPE, which makes ``q . b_k`` differ from key to key) k's count too."""
    x = torch.randn(PROMPT, 64, generator=torch.Generator().manual_seed(1))
    attn = attention(qkv_bias=True, o_bias=False)
    ref = step(0, PROMPT, lambda pos: attn(pos, x))
    for shard in ("q", "k", "v"):
        part = attn.qkv_proj.shard_view(attn.qkv_proj.bias, shard)  # a view of the bias
        saved = part.clone()
        part.zero_()
        out = step(0, PROMPT, lambda pos: attn(pos, x))
        part.copy_(saved)
        assert not torch.allclose(out[1:], ref[1:], atol=1e-4), f"the {shard} bias is dropped"


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("o_bias", [False, True])
def test_decode_gemv_epilogue_adds_the_qkv_bias(o_bias, monkeypatch) -> None:
    """One decode token through ``forward_normed`` (the qkv GEMV with the norm prologue and the q/k
    RoPE + KV-write epilogue) equals the torch path, output and cache, with a q/k/v bias."""
    gen = torch.Generator().manual_seed(2)
    prompt, x, residual = torch.randn(PROMPT, 64, generator=gen), *torch.randn(2, 1, 64, generator=gen)
    attn = attention(qkv_bias=True, o_bias=o_bias)
    norm = RMSNorm(64)
    norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    step(0, PROMPT, lambda pos: attn(pos, prompt))
    caches = attn.attn.k_cache.clone(), attn.attn.v_cache.clone()
    want = step(PROMPT, 1, lambda pos: attn(pos, norm(x, residual)[0]))
    want_caches = attn.attn.k_cache.clone(), attn.attn.v_cache.clone()
    attn.attn.k_cache, attn.attn.v_cache = caches
    calls = []
    monkeypatch.setattr(gemv, "gemv_qk_rope", lambda *a, _f=gemv.gemv_qk_rope, **k: calls.append(a[3]) or _f(*a, **k))
    monkeypatch.setattr(linear, "use_gemv", lambda x: True)
    monkeypatch.setattr(gemv, "num_sms", lambda device: 2)  # few programs: the interpreter runs them one by one
    got, new_residual = step(PROMPT, 1, lambda pos: attn.forward_normed(pos, x, residual, norm))
    assert len(calls) == 1 and calls[0] is attn.qkv_proj.bias  # the fused path ran, handed the bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_residual, x + residual)
    for cache, want_cache in zip((attn.attn.k_cache, attn.attn.v_cache), want_caches):
        torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)
