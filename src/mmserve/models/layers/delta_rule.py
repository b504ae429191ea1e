"""The gated delta rule and the short causal convolution of Gated DeltaNet layers, with carried state.

Role: the math of a linear-attention layer of a hybrid model (Qwen3.5), per sequence or batched over
decodes, always from a given state and always returning the state it leaves, so a prompt prefilled in
chunks resumes exactly where the previous chunk stopped:
- `causal_conv`: the depthwise causal convolution over the last `kernel - 1` inputs (its conv state) and
  the new ones, then SiLU; one sequence's tokens at once, or one token of each of many sequences;
- `chunked_delta_rule`: a prompt chunk in the chunkwise-parallel form (chunks of 64 tokens: inside a chunk
  the delta-rule updates are condensed by a unit-triangular solve into matmuls, across chunks the state is
  scanned), the form transformers and flash-linear-attention use for prefill;
- `recurrent_delta_step`: one token of each of B sequences, the recurrent form (decode).
The recurrent state of a value head is a (key_dim, value_dim) matrix S, read as o = S^T q and updated per
token by S <- g S + k (beta (v - (g S)^T k))^T, with decay g = exp(g_log) <= 1. Everything is computed in
float32 (a decay compounded over thousands of tokens loses too much in half precision); the state is
float32 for the same reason.

What it does not know: projections, heads' grouping, slots, requests, where the state lives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 64  # the chunk of the chunkwise-parallel form (transformers' and flash-linear-attention's)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as the reference's q/k normalisation (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new inputs through the depthwise causal convolution, then SiLU.

    x (T, C); conv_state (C, K - 1), the inputs before these (zeros for a fresh sequence); weight (C, K).
    Returns (out (T, C) in x's dtype, new conv_state (C, K - 1): the last K - 1 inputs)."""
    tokens, kernel = x.shape[0], weight.shape[1]
    joined = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # (C, K - 1 + T)
    out = F.conv1d(joined[None], weight[:, None, :], groups=weight.shape[0])[0]  # (C, T)
    new_state = joined[:, joined.shape[1] - (kernel - 1):]
    return F.silu(out[:, -tokens:]).t().to(x.dtype), new_state.to(conv_state.dtype)


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: x (B, C), conv_state (B, C, K - 1), weight (C, K).
    Returns (out (B, C), new conv_state (B, C, K - 1))."""
    joined = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=2)  # (B, C, K)
    # a K-tap dot product per channel: oneDNN's depthwise conv1d costs ~100x this at decode shapes
    out = (joined * weight).sum(dim=-1)  # (B, C)
    return F.silu(out).to(x.dtype), joined[:, :, 1:].to(conv_state.dtype)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_log: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens from `state`: q, k (T, H, Dk) already L2-normalised and grouped to the value
    heads; v (T, H, Dv); g_log, beta (T, H); state (H, Dk, Dv). Returns (out (T, H, Dv) float32, final state
    (H, Dk, Dv) float32)."""
    tokens = q.shape[0]
    pad = (-tokens) % CHUNK_TOKENS
    # (H, T, D) in float32, padded to whole chunks (padded tokens have k = v = 0, g = 0: they change nothing)
    q, k, v = (F.pad(t.transpose(0, 1).float(), (0, 0, 0, pad)) for t in (q, k, v))
    g_log, beta = (F.pad(t.t().float(), (0, pad)) for t in (g_log, beta))
    q = q * q.shape[-1] ** -0.5
    heads, chunks = q.shape[0], q.shape[1] // CHUNK_TOKENS
    q, k, v_beta, k_beta = (t.reshape(heads, chunks, CHUNK_TOKENS, -1)
                            for t in (q, k, v * beta[..., None], k * beta[..., None]))
    decay = g_log.reshape(heads, chunks, CHUNK_TOKENS).cumsum(dim=-1)  # log decay from the chunk's start
    future = torch.ones(CHUNK_TOKENS, CHUNK_TOKENS, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay  # unit lower-triangular once the diagonal is added
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    q_decayed = q * decay.exp()[..., None]
    k_decayed = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # (H, chunks, 1, 1)
    out = torch.zeros_like(new_values)
    state = state.float()
    for c in range(chunks):  # the scan: each chunk reads the state the previous ones left
        v_new = new_values[:, c] - k_reads[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c] + k_decayed[:, c].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :tokens].transpose(0, 1), state


def recurrent_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_log: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k (B, H, Dk) L2-normalised and grouped; v (B, H, Dv); g_log, beta
    (B, H); state (B, H, Dk, Dv). Returns (out (B, H, Dv) float32, new state (B, H, Dk, Dv) float32)."""
    q, k, v = q.float() / q.shape[-1] ** 0.5, k.float(), v.float()  # the reference divides here (same bits)
    state = state.float() * g_log.float().exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # what the state already predicts for k: (B, H, Dv)
    delta = (v - remembered) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state
