"""The gated delta rule (Gated DeltaNet's recurrence) in torch, float32: recurrent and chunked.

Per head, with a state S of shape [Dk, Dv], decay a_t = exp(g_t), write strength b_t:

    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = b_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

``gated_delta_recurrent`` applies it token by token (decode). ``gated_delta_chunked`` processes
chunks of C tokens with a few matmuls (prefill): inside a chunk, with G_t = prod_{i<=t} a_i, the
updates w_t = d_t solve the unit lower-triangular system (I + A) W = (b * V) - (b * G * K) S_0,
A[t, i] = b_t (G_t / G_i) k_t . k_i for i < t; then O = (G * Q) S_0 + P W with
P[t, i] = (G_t / G_i) q_t . k_i for i <= t, and S_C = G_C S_0 + (K * G_C / G)^T W.
Inputs: q, k [T, H, Dk] (already l2-normalised and scaled), v [T, H, Dv], g, beta [T, H], state
[H, Dk, Dv]; outputs [T, H, Dv] and the new state.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    length = q.shape[0]
    pad = (-length) % chunk
    # Padded tokens have beta = 0, k = 0 and g = 0: they neither read nor change the state.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    heads, n = q.shape[1], (length + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, n, C, ...]
        return x.reshape(n, chunk, heads, *x.shape[2:]).transpose(0, 2).transpose(1, 2)

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)  # log G_t
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # G_t / G_i, i <= t
    kk = k @ k.transpose(-1, -2)
    system = torch.eye(chunk, device=q.device) + (beta[..., None] * kk * decay).tril(-1)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    kc = torch.linalg.solve_triangular(system, k * (beta * cum.exp())[..., None], upper=False, unitriangular=True)
    p = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(n):
        w = u[:, i] - kc[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + p[:, i] @ w
        state = state * cum[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ w
    out = out.transpose(1, 2).transpose(0, 2).reshape(n * chunk, heads, -1)[:length]
    return out, state
