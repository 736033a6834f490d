"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 (and Qwen3-Next), on the hybrid cache.

Per token: fused q/k/v projection, a causal depthwise conv1d with SiLU over the last ``K`` inputs
(its conv state, the last K-1 pre-conv inputs, lives in the request's slot), l2-normalised q and k
(q scaled by Dk^-0.5), decay g = -exp(A_log) * softplus(a + dt_bias), write strength
beta = sigmoid(b), the gated delta rule on an fp32 per-head state (chunked for prefill chunks,
recurrent for single tokens), the gated output norm rms(x) * w * silu(z), and out_proj.
Parameter names follow the HF checkpoints (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``, ``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``, ``out_proj``).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from vtcore.layers.attention import AttentionMetadata, get_attention_metadata
from vtcore.layers.gated_delta import gated_delta_chunked, gated_delta_recurrent, l2_normalize
from vtcore.layers.linear import Linear
from vtcore.layers.state import StatefulLayer


class GatedRMSNorm(nn.Module):
    """rms(x) * w * silu(z), w starting at 1 (not zero-centred), statistics in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)

    def dummy_init(self, gen: torch.Generator) -> None:
        self.weight.fill_(1.0)


class _ConvWeight(nn.Module):
    """Holds the depthwise conv kernel under the checkpoint's name ``conv1d.weight`` [channels, 1, K]."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)

    def dummy_init(self, gen: torch.Generator) -> None:
        kernel = self.weight.shape[-1]
        self.weight.copy_(torch.randn(self.weight.shape, generator=gen, device=self.weight.device) / math.sqrt(kernel))


class GatedDeltaNet(StatefulLayer):
    #: prefill chunk of the chunked algorithm
    chunk_size = 64
    supports_decode_graphs = True

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.hk, self.hv, self.dk, self.dv, self.kernel = num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = Linear(hidden_size, self.conv_dim)
        self.in_proj_z = Linear(hidden_size, self.value_dim)
        self.in_proj_b = Linear(hidden_size, num_v_heads)
        self.in_proj_a = Linear(hidden_size, num_v_heads)
        self.conv1d = _ConvWeight(self.conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv_dim, self.kernel - 1), torch.float32),
                "recurrent": ((self.hv, self.dk, self.dv), torch.float32)}

    def dummy_init(self, gen: torch.Generator) -> None:
        device = self.A_log.device
        self.A_log.copy_(torch.empty(self.hv, device=device).uniform_(1.0, 16.0, generator=gen).log())
        self.dt_bias.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, hidden], the tokens of every scheduled request, laid out flat."""
        md = get_attention_metadata()
        if md.state_index is not None:
            out = self._decode_indexed(x, md.state_index, md.state_continues)
        else:
            out = self._forward_per_sequence(x, md)
        y = self.norm(out.to(x.dtype).reshape(-1, self.dv), self.in_proj_z(x).reshape(-1, self.dv))
        return self.out_proj(y.reshape(x.shape[0], self.value_dim))

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """g = -exp(A_log) * softplus(a + dt_bias), float32."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _decode_indexed(self, x: torch.Tensor, slots: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:
        """One token a row, states addressed by the device tensors ``slots`` / ``continues`` (no host
        value read: capturable in a CUDA graph). CUDA: the Triton decode step; elsewhere the same
        math vectorised in torch."""
        mixed, a, b = self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x)
        conv_states, rec_states = self.states["conv"], self.states["recurrent"]
        weight = self.conv1d.weight.reshape(self.conv_dim, self.kernel)
        if x.is_cuda:
            from vtcore.kernels.gated_delta import gdn_decode_step
            return gdn_decode_step(mixed, a, b, weight, self.A_log, self.dt_bias, conv_states, rec_states, slots,
                                   continues, self.hk, self.hv, self.dk, self.dv)
        keep = continues.float()
        window = torch.cat((conv_states[slots] * keep[:, None, None], mixed.float()[:, :, None]), dim=-1)
        conv_states[slots] = window[:, :, 1:]
        qkv = F.silu((window * weight.float()).sum(-1))  # [rows, conv_dim]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.reshape(-1, self.hk, self.dk)) * self.dk ** -0.5
        k = l2_normalize(k.reshape(-1, self.hk, self.dk))
        if self.hv != self.hk:
            q, k = (t.repeat_interleave(self.hv // self.hk, dim=1) for t in (q, k))
        state = rec_states[slots] * keep[:, None, None, None] * self._decay(a).exp()[:, :, None, None]
        delta = (v.reshape(-1, self.hv, self.dv) - torch.einsum("bhkv,bhk->bhv", state, k)) \
            * b.float().sigmoid()[:, :, None]
        state = state + k[:, :, :, None] * delta[:, :, None, :]
        rec_states[slots] = state
        return torch.einsum("bhkv,bhk->bhv", state, q)

    def _forward_per_sequence(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Any batch (prefill chunks, mixed): a loop over the sequences' host row ranges and slots."""
        mixed = self.in_proj_qkv(x).float()
        beta = self.in_proj_b(x).float().sigmoid()
        g = self._decay(self.in_proj_a(x))
        weight = self.conv1d.weight.float()
        conv_states, rec_states = self.states["conv"], self.states["recurrent"]
        out = torch.empty(x.shape[0], self.hv, self.dv, dtype=torch.float32, device=x.device)
        for (row0, n), slot, continues in zip(md.seq_rows, md.state_slots, md.has_state):
            rows = slice(row0, row0 + n)
            prev = conv_states[slot] if continues else torch.zeros_like(conv_states[slot])
            window = torch.cat((prev, mixed[rows].T), dim=-1)  # [conv_dim, K-1+n]
            conv_states[slot] = window[:, window.shape[1] - (self.kernel - 1):]
            qkv = F.silu(F.conv1d(window[None], weight, groups=self.conv_dim)[0].T)  # [n, conv_dim]
            q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q = l2_normalize(q.reshape(n, self.hk, self.dk)) * self.dk ** -0.5
            k = l2_normalize(k.reshape(n, self.hk, self.dk))
            if self.hv != self.hk:
                q, k = (t.repeat_interleave(self.hv // self.hk, dim=1) for t in (q, k))
            state = rec_states[slot] if continues else torch.zeros_like(rec_states[slot])
            rule = gated_delta_recurrent if n == 1 else gated_delta_chunked
            extra = {} if n == 1 else {"chunk": self.chunk_size}
            out[rows], rec_states[slot] = rule(q, k, v.reshape(n, self.hv, self.dv), g[rows], beta[rows], state,
                                               **extra)
        return out
