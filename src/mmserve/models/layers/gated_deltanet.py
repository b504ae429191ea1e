"""The Gated DeltaNet layer of hybrid decoders (Qwen3.5), over a flattened batch whose state lives in slots.

Role: the token mixer of a linear-attention layer. One fused input projection gives q/k/v (through the short
causal convolution), the output gate z and the per-head beta (write strength) and decay; q and k are
L2-normalised and grouped onto the value heads; the gated delta rule (`delta_rule`) reads and writes each
sequence's recurrent state; a gated RMSNorm (RMSNorm of the output, times SiLU(z)) and the output projection
close it. Parameter names follow Hugging Face's `Qwen3_5GatedDeltaNet` (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a` arrive stacked as `in_proj` in that order; `conv1d`, `A_log`, `dt_bias`, `norm`,
`out_proj`).

State: the layer asks its `LinearStateBackend` for this layer's two tensors, (num_slots, conv_dim, kernel - 1)
and (num_slots, value_heads, key_dim, value_dim), and `meta.state_slots` says which slot each sequence of the
step owns. A sequence's slot holds what its previous tokens left (zeros for a fresh one: the runner clears a
slot when it hands it out); the layer updates it in place. A step of only decodes runs the recurrent form
batched over sequences; otherwise each sequence runs its tokens (a prefill chunk, or one decode) in turn — a
sequence verifying speculative drafts (`meta.record_states`) token by token in the recurrent form, the state
after each token kept in `meta.recorded_states` for the runner to roll back to.

What it does not know: requests, scheduling, which slot is whose, full-attention layers, KV.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.layers import delta_rule
from mmserve.models.layers.attention import AttentionMetadata


class LinearStateBackend(Protocol):
    def linear_states(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (conv_state (slots, conv_dim, kernel - 1), recurrent_state (slots, heads, dk, dv)),
        updated in place."""
        ...


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's output, scaled by its weight in the input dtype, then times SiLU(gate) in
    float32 (the reference's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, layer_idx: int) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads "
                             f"{num_k_heads}")
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        # rows [q k v | z | b | a]: the checkpoint's four projections stacked (one matmul)
        self.in_proj = nn.Linear(hidden_size, self.conv_dim + self.value_dim + 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def shard_sizes(self) -> list[int]:
        """The stacked projection's rows per checkpoint projection (qkv, z, b, a)."""
        return [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One slot's (conv state, recurrent state) shapes."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, x: torch.Tensor, backend: LinearStateBackend, meta: AttentionMetadata) -> torch.Tensor:
        """x (num_tokens, hidden) -> (num_tokens, hidden); sequence i owns the next query_lens[i] tokens."""
        mixed, z, b, a = self.in_proj(x).split(self.shard_sizes(), dim=-1)
        conv_state, recurrent_state = backend.linear_states(self.layer_idx)
        weight = self.conv1d.weight[:, 0, :]  # (conv_dim, kernel)
        beta = b.sigmoid()
        g_log = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (num_tokens, heads), <= 0
        slots = meta.state_slots
        if all(n == 1 for n in meta.query_lens):  # decodes only: one batched recurrent step
            index = meta.state_slot_index if meta.state_slot_index is not None else \
                torch.tensor(slots, dtype=torch.long, device=x.device)
            mixed, new_conv = delta_rule.causal_conv_step(mixed, conv_state.index_select(0, index), weight)
            conv_state.index_copy_(0, index, new_conv)
            q, k, v = self._heads(mixed)
            out, new_state = delta_rule.recurrent_delta_step(q, k, v, g_log, beta,
                                                             recurrent_state.index_select(0, index))
            recurrent_state.index_copy_(0, index, new_state.to(recurrent_state.dtype))
        else:
            pieces, start = [], 0
            for i, (slot, n) in enumerate(zip(slots, meta.query_lens)):
                rows = slice(start, start + n)
                if i in meta.record_states:  # a verification: token by token, as decodes, each state kept
                    pieces.append(self._recorded(mixed[rows], g_log[rows], beta[rows], weight, conv_state,
                                                 recurrent_state, slot, meta.recorded_states, i))
                else:
                    pieces.append(self._sequence(mixed[rows], g_log[rows], beta[rows], weight, conv_state,
                                                 recurrent_state, slot))
                start += n
            out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        out = self.norm(out.to(x.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))

    def _sequence(self, mixed: torch.Tensor, g_log: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                  conv_state: torch.Tensor, recurrent_state: torch.Tensor, slot: int) -> torch.Tensor:
        """One sequence's tokens from its slot's state, written back. -> (tokens, heads, head_v_dim) float32."""
        mixed, conv_state[slot] = delta_rule.causal_conv(mixed, conv_state[slot], weight)
        q, k, v = self._heads(mixed)
        if mixed.shape[0] == 1:  # one token: the recurrent form, as a decode
            out, state = delta_rule.recurrent_delta_step(q, k, v, g_log, beta, recurrent_state[slot:slot + 1])
            recurrent_state[slot] = state[0]
            return out
        out, recurrent_state[slot] = delta_rule.chunked_delta_rule(q, k, v, g_log, beta, recurrent_state[slot])
        return out

    def _recorded(self, mixed: torch.Tensor, g_log: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                  conv_state: torch.Tensor, recurrent_state: torch.Tensor, slot: int,
                  recorded: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], sequence: int) -> torch.Tensor:
        """A sequence's tokens one at a time (the recurrent form, a decode's arithmetic), the slot's state after
        each kept in `recorded[(layer, sequence)]` and the last written back."""
        conv, state = conv_state[slot:slot + 1], recurrent_state[slot:slot + 1]
        outs, convs, states = [], [], []
        for t in range(mixed.shape[0]):
            out, conv = delta_rule.causal_conv_step(mixed[t:t + 1], conv, weight)
            q, k, v = self._heads(out)
            out, state = delta_rule.recurrent_delta_step(q, k, v, g_log[t:t + 1], beta[t:t + 1], state)
            outs.append(out)
            convs.append(conv)
            states.append(state)
        recorded[(self.layer_idx, sequence)] = torch.cat(convs), torch.cat(states)
        conv_state[slot], recurrent_state[slot] = conv[0], state[0].to(recurrent_state.dtype)
        return torch.cat(outs)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, conv_dim) -> q, k (n, v_heads, dk) L2-normalised in float32 and grouped; v (n, v_heads, dv)."""
        n = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        group = self.num_v_heads // self.num_k_heads
        q, k = (delta_rule.l2_normalize(t.reshape(n, self.num_k_heads, self.head_k_dim).float())
                .repeat_interleave(group, dim=1) for t in (q, k))
        return q, k, v.reshape(n, self.num_v_heads, self.head_v_dim)
