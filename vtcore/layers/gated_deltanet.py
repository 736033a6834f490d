"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 (and Qwen3-Next), on the hybrid cache.

Per token: fused q/k/v projection, a causal depthwise conv1d with SiLU over the last ``K`` inputs
(its conv state, the last K-1 pre-conv inputs, lives in the request's slot), l2-normalised q and k
(q scaled by Dk^-0.5), decay g = -exp(A_log) * softplus(a + dt_bias), write strength
beta = sigmoid(b), the gated delta rule on an fp32 per-head state (chunked for prefill chunks, the
Triton kernel on CUDA; recurrent for single tokens), the gated output norm rms(x) * w * silu(z), and
out_proj.
Parameter names follow the HF checkpoints (``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``,
``out_proj``) but for the input projections, fused at load as vLLM fuses them (``GDN_FUSED`` in a
family's ``packed_modules_mapping``): ``in_proj_qkvz`` = [in_proj_qkv | in_proj_z] and ``in_proj_ba``
= [in_proj_b | in_proj_a], two GEMVs a decode step instead of four.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from vtcore.layers import parallel as tp
from vtcore.layers.attention import AttentionMetadata, get_attention_metadata
from vtcore.layers.gated_delta import gated_delta_chunked, gated_delta_recurrent, l2_normalize
from vtcore.layers.linear import Linear, copy_checked, loadable_param
from vtcore.layers.state import StatefulLayer


#: Prefill tokens per Triton chunked-rule call: its per-chunk states take 32 MB at this length for
#: Qwen3.5-35B-A3B's 32 heads of 128 x 128.
KERNEL_MAX_TOKENS = 1024


def use_chunk_kernel(x: torch.Tensor) -> bool:
    """Prefill chunks on CUDA run the Triton chunked rule (tests point this at the interpreter on CPU)."""
    return x.is_cuda


#: checkpoint name part -> (fused parameter, shard): the GDN input projections (see the module docstring)
GDN_FUSED = {"in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", "z"),
             "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a")}


class GatedRMSNorm(nn.Module):
    """rms(x) * w * silu(z), w starting at 1 (not zero-centred), statistics in float32."""

    tp_replicated = True  # one head's width: the same on every rank

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, dim] (any float dtype; rounded to ``z.dtype`` first) gated by ``z`` [rows, dim]
        or [tokens, heads, dim] (a strided view is fine): [rows, dim]. One Triton kernel on CUDA
        when the weight has ``z``'s dtype."""
        if z.is_cuda and self.weight.dtype == z.dtype:
            from vtcore.kernels.gated_rmsnorm import gated_rms_norm
            return gated_rms_norm(x, z, self.weight, self.eps)
        z = z.reshape(x.shape)
        h = x.to(z.dtype).float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(z.dtype)
        return (h * F.silu(z.float())).to(z.dtype)

    def dummy_init(self, gen: torch.Generator) -> None:
        self.weight.fill_(1.0)


class _ConvWeight(nn.Module):
    """Holds the depthwise conv kernel under the checkpoint's name ``conv1d.weight`` [channels, 1, K]; under
    tensor parallelism the rank's channels of each of ``segments`` (q, k, v)."""

    tp_sharded = True

    def __init__(self, segments: list[int], kernel: int) -> None:
        super().__init__()
        self.segments, self.tp_group = segments, tp.tp()
        channels = sum(n // self.tp_group.size for n in segments)
        self.weight = loadable_param(torch.empty(channels, 1, kernel), (None,), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        copy_checked(param.data, tp.rank_part(loaded, 0, self.tp_group, self.segments))

    def dummy_init(self, gen: torch.Generator) -> None:
        kernel = self.weight.shape[-1]
        self.weight.copy_(torch.randn(self.weight.shape, generator=gen, device=self.weight.device) / math.sqrt(kernel))


class GatedDeltaNet(StatefulLayer):
    """Under tensor parallelism (:mod:`vtcore.layers.parallel`) a rank keeps its share of the key and value
    heads: its q, k, v and z rows of the input projections and its conv channels, its heads' ``A_log`` and
    ``dt_bias``, its columns of ``out_proj`` (summed over the ranks); its state is its heads'."""

    #: prefill chunk of the chunked algorithm
    chunk_size = 64
    supports_decode_graphs = True
    supports_chunk_graphs = True
    supports_verify_graphs = True
    supports_state_snapshots = True
    tp_sharded = True

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim  # whole, before any split
        qkv = [key_dim, key_dim, value_dim]
        self.in_proj_qkvz = Linear(hidden_size, [("qkv", sum(qkv)), ("z", value_dim)], parallel="column",
                                   segments={"qkv": qkv})
        self.in_proj_ba = Linear(hidden_size, [("b", num_v_heads), ("a", num_v_heads)], parallel="column")
        self.conv1d = _ConvWeight(qkv, conv_kernel)
        self.out_proj = Linear(value_dim, hidden_size, parallel="row")
        num_k_heads = tp.split(num_k_heads, "linear_num_key_heads")
        num_v_heads = tp.split(num_v_heads, "linear_num_value_heads")
        self.hk, self.hv, self.dk, self.dv, self.kernel = num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.tp_group = tp.tp()
        self.dt_bias = loadable_param(torch.empty(num_v_heads), (None,), self._head_loader)
        self.A_log = loadable_param(torch.empty(num_v_heads), (None,), self._head_loader)
        self.norm = GatedRMSNorm(head_v_dim, eps)

    def _head_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        copy_checked(param.data, tp.rank_part(loaded, 0, self.tp_group))

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
        mixed, z, b, a = self.project(x)
        if md.state_tokens is not None:
            out = self._chunk_indexed(mixed, b, a, md.state_index, md.state_continues, md.state_tokens)
        elif md.state_index is not None:
            out = self._decode_indexed(mixed, b, a, md.state_index, md.state_continues, md.state_out_index)
        else:
            out = self._forward_per_sequence(mixed, b, a, md)
        y = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.hv, self.dv))
        return self.out_proj(y.reshape(x.shape[0], self.value_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four input projections of ``x`` (views into the two fused outputs): the pre-conv
        ``mixed`` [T, conv_dim], the gate ``z`` [T, value_dim], ``b`` and ``a`` [T, Hv]."""
        mixed, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.hv, self.hv], dim=-1)
        return mixed, z, b, a

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """g = -exp(A_log) * softplus(a + dt_bias), float32."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _decode_indexed(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                        continues: torch.Tensor, out_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of one token, or (``out_slots`` [rows, Q]) verify rows of Q tokens each, their states
        addressed by the device tensors ``slots`` / ``continues`` / ``out_slots`` (no host value read:
        capturable in a CUDA graph). CUDA: the Triton decode step; elsewhere the same math vectorised in
        torch, token by token."""
        conv_states, rec_states = self.states["conv"], self.states["recurrent"]
        weight = self.conv1d.weight.reshape(self.conv_dim, self.kernel)
        if mixed.is_cuda:
            from vtcore.kernels.gated_delta import gdn_decode_step
            return gdn_decode_step(mixed, a, b, weight, self.A_log, self.dt_bias, conv_states, rec_states, slots,
                                   continues, self.hk, self.hv, self.dk, self.dv, out_slots=out_slots)
        rows, dk, dv = slots.shape[0], self.dk, self.dv
        out_slots = slots[:, None] if out_slots is None else out_slots
        keep = continues.float()
        conv, rec = conv_states[slots] * keep[:, None, None], rec_states[slots] * keep[:, None, None, None]
        mixed, g, beta = (t.reshape(rows, out_slots.shape[1], -1) for t in (mixed.float(), self._decay(a), b.float()))
        outs = []
        for t, written in enumerate(out_slots.unbind(1)):
            window = torch.cat((conv, mixed[:, t, :, None]), dim=-1)
            conv = window[:, :, 1:]
            q, k, v = self._heads(F.silu((window * weight.float()).sum(-1)))  # [rows, heads, dim] each
            # every (row, head) pair as one head of a one-token sequence: the torch reference rule
            out, state = gated_delta_recurrent(
                q.reshape(1, -1, dk), k.reshape(1, -1, dk), v.reshape(1, -1, dv), g[:, t].reshape(1, -1),
                beta[:, t].sigmoid().reshape(1, -1), rec.reshape(-1, dk, dv))
            rec = state.reshape(rows, self.hv, dk, dv)
            outs.append(out.reshape(rows, self.hv, dv))
            kept = written >= 0
            conv_states[written[kept]], rec_states[written[kept]] = conv[kept], rec[kept]
        return torch.stack(outs, 1).reshape(-1, self.hv, dv)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv ``qkv`` [n, conv_dim] -> q, k [n, Hv, Dk] (l2-normalised, q scaled by Dk^-0.5, each
        k head shared by Hv / Hk value heads) and v [n, Hv, Dv]."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.reshape(n, self.hk, self.dk)) * self.dk ** -0.5
        k = l2_normalize(k.reshape(n, self.hk, self.dk))
        if self.hv != self.hk:
            q, k = (t.repeat_interleave(self.hv // self.hk, dim=1) for t in (q, k))
        return q, k, v.reshape(n, self.hv, self.dv)

    def _forward_per_sequence(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, md: AttentionMetadata
                              ) -> torch.Tensor:
        """Any batch (prefill chunks, mixed): a loop over the sequences' host row ranges and slots."""
        mixed = mixed.float()
        beta = b.float().sigmoid()
        g = self._decay(a)
        weight = self.conv1d.weight.float()
        conv_states, rec_states = self.states["conv"], self.states["recurrent"]
        out = torch.empty(mixed.shape[0], self.hv, self.dv, dtype=torch.float32, device=mixed.device)
        outs = md.state_out_slots or md.state_slots
        for (row0, n), slot, out_slot, continues in zip(md.seq_rows, md.state_slots, outs, md.has_state):
            rows = slice(row0, row0 + n)
            prev = conv_states[slot] if continues else torch.zeros_like(conv_states[slot])
            window, qkv = self._conv(prev, mixed[rows], weight)
            conv_states[out_slot] = window[:, window.shape[1] - (self.kernel - 1):]
            q, k, v = self._heads(qkv)
            state = rec_states[slot] if continues else torch.zeros_like(rec_states[slot])
            out[rows], rec_states[out_slot] = self._rule(q, k, v, g[rows], beta[rows], state)
        return out

    def _chunk_indexed(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, slot: torch.Tensor,
                       continues: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """A lone prefill chunk whose rows past ``tokens`` [1] are padding, its state addressed by the
        device tensors ``slot`` / ``continues`` [1] (no host value read: capturable in a CUDA graph).
        Padded rows get zero q, k, v, decay and write strength, as the chunked rule pads its own last
        chunk, so they neither read nor change the state; the conv state kept is the K-1 inputs before
        row ``tokens``."""
        conv_states, rec_states = self.states["conv"], self.states["recurrent"]
        valid = (torch.arange(mixed.shape[0], device=mixed.device) < tokens)[:, None]  # [T, 1]
        prev = torch.where(continues, conv_states.index_select(0, slot)[0], 0.0)
        window, qkv = self._conv(prev, mixed.float(), self.conv1d.weight.float())
        tail = tokens + torch.arange(self.kernel - 1, device=mixed.device)
        conv_states.index_copy_(0, slot, window.index_select(1, tail)[None])
        q, k, v = (t * valid[..., None] for t in self._heads(qkv))
        state = torch.where(continues, rec_states.index_select(0, slot)[0], 0.0)
        out, state = self._rule(q, k, v, self._decay(a) * valid, b.float().sigmoid() * valid, state)
        rec_states.index_copy_(0, slot, state[None])
        return out

    def _conv(self, prev: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal depthwise conv (float32 ``weight`` [conv_dim, 1, K]) of float32 ``mixed`` [n, conv_dim]
        after the conv state ``prev`` [conv_dim, K-1]: (the window [conv_dim, K-1+n], its SiLU outputs)."""
        window = torch.cat((prev, mixed.T), dim=-1)
        return window, F.silu(F.conv1d(window[None], weight, groups=self.conv_dim)[0].T)

    def _rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over one segment from ``state``: (outputs [n, Hv, Dv], the state after)."""
        if q.shape[0] == 1:
            return gated_delta_recurrent(q, k, v, g, beta, state)
        if use_chunk_kernel(q) and self.chunk_size >= 16 and not self.chunk_size & (self.chunk_size - 1):
            # (the kernel takes power-of-two chunks from 16)
            return self._chunked_kernel(q, k, v, g, beta, state)
        return gated_delta_chunked(q, k, v, g, beta, state, chunk=self.chunk_size)

    def _chunked_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton chunked rule over at most ``KERNEL_MAX_TOKENS`` tokens a call (its scratch holds
        a state per chunk: Hv * Dk * Dv * 4 bytes per 64 tokens), the state carried between calls."""
        from vtcore.kernels.gated_delta import chunk_gated_delta_rule

        outs = []
        state = state.contiguous()
        for s in range(0, q.shape[0], KERNEL_MAX_TOKENS):
            part = slice(s, s + KERNEL_MAX_TOKENS)
            o, state = chunk_gated_delta_rule(q[part], k[part], v[part], g[part], beta[part], state,
                                              chunk=self.chunk_size)
            outs.append(o)
        return torch.cat(outs) if len(outs) > 1 else outs[0], state
