"""The gated delta rule and causal convolution of `models/layers/delta_rule.py` against transformers' Qwen3.5
reference functions, and against themselves split into chunks: a prompt prefilled in pieces, or decoded a token
at a time, must leave the same state and outputs as in one piece."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.models.layers import delta_rule

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

HEADS, DK, DV = 4, 16, 24


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = delta_rule.l2_normalize(torch.randn(tokens, HEADS, DK, generator=gen))
    k = delta_rule.l2_normalize(torch.randn(tokens, HEADS, DK, generator=gen))
    v = torch.randn(tokens, HEADS, DV, generator=gen)
    g_log = -F.softplus(torch.randn(tokens, HEADS, generator=gen)) * 0.3
    beta = torch.rand(tokens, HEADS, generator=gen)
    return q, k, v, g_log, beta


def _reference(q, k, v, g_log, beta, state, fn):
    out, final = fn(q[None], k[None], v[None], g=g_log[None], beta=beta[None], initial_state=state[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=False)
    return out[0], final[0]


@pytest.mark.parametrize("tokens", [1, 37, 64, 150])
def test_chunked_matches_reference_from_a_state(tokens: int) -> None:
    q, k, v, g_log, beta = _inputs(tokens, seed=tokens)
    state = torch.randn(HEADS, DK, DV, generator=torch.Generator().manual_seed(1)) * 0.1
    out, final = delta_rule.chunked_delta_rule(q, k, v, g_log, beta, state)
    ref_out, ref_final = _reference(q, k, v, g_log, beta, state, hf.torch_chunk_gated_delta_rule)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(final, ref_final, rtol=0, atol=0)


def test_recurrent_step_matches_reference_per_token() -> None:
    q, k, v, g_log, beta = _inputs(6, seed=3)
    state = torch.zeros(HEADS, DK, DV)
    ref_state = state.clone()
    for t in range(6):
        out, state = delta_rule.recurrent_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g_log[t:t + 1],
                                                     beta[t:t + 1], state[None])
        state = state[0]
        ref_out, ref_state = _reference(q[t:t + 1], k[t:t + 1], v[t:t + 1], g_log[t:t + 1], beta[t:t + 1],
                                        ref_state, hf.torch_recurrent_gated_delta_rule)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


@pytest.mark.parametrize("split", [1, 20, 64, 100])
def test_chunks_resume_from_the_carried_state(split: int) -> None:
    """A prompt in two pieces (the second resuming from the state the first left) equals one piece."""
    q, k, v, g_log, beta = _inputs(130, seed=7)
    zero = torch.zeros(HEADS, DK, DV)
    whole, whole_state = delta_rule.chunked_delta_rule(q, k, v, g_log, beta, zero)
    first, state = delta_rule.chunked_delta_rule(q[:split], k[:split], v[:split], g_log[:split], beta[:split], zero)
    rest, final = delta_rule.chunked_delta_rule(q[split:], k[split:], v[split:], g_log[split:], beta[split:], state)
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, whole_state, rtol=1e-5, atol=1e-5)


def test_recurrent_and_chunked_forms_agree() -> None:
    q, k, v, g_log, beta = _inputs(40, seed=11)
    out, final = delta_rule.chunked_delta_rule(q, k, v, g_log, beta, torch.zeros(HEADS, DK, DV))
    state = torch.zeros(1, HEADS, DK, DV)
    steps = []
    for t in range(40):
        o, state = delta_rule.recurrent_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g_log[t:t + 1],
                                                   beta[t:t + 1], state)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[0], final, rtol=1e-4, atol=1e-5)


def test_recurrent_step_is_per_row() -> None:
    """A batch of decodes: each row's output and state are those of that row alone."""
    q, k, v, g_log, beta = _inputs(3, seed=5)
    states = torch.randn(3, HEADS, DK, DV, generator=torch.Generator().manual_seed(2))
    out, new = delta_rule.recurrent_delta_step(q, k, v, g_log, beta, states)
    for b in range(3):
        o, s = delta_rule.recurrent_delta_step(q[b:b + 1], k[b:b + 1], v[b:b + 1], g_log[b:b + 1], beta[b:b + 1],
                                               states[b:b + 1])
        torch.testing.assert_close(out[b:b + 1], o, rtol=0, atol=0)
        torch.testing.assert_close(new[b:b + 1], s, rtol=0, atol=0)


def test_causal_conv_matches_reference_and_resumes() -> None:
    channels, kernel, tokens = 10, 4, 9
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(tokens, channels, generator=gen), torch.randn(channels, kernel, generator=gen)
    ref = hf.causal_conv1d_fn.__wrapped__ if hasattr(hf.causal_conv1d_fn, "__wrapped__") else hf.causal_conv1d_fn
    expected = ref(x.t()[None], weight, None, activation="silu")[0].t()
    zero = torch.zeros(channels, kernel - 1)
    out, state = delta_rule.causal_conv(x, zero, weight)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, x[-(kernel - 1):].t())
    first, mid = delta_rule.causal_conv(x[:2], zero, weight)  # fewer tokens than the kernel: state keeps zeros
    rest, final = delta_rule.causal_conv(x[2:], mid, weight)
    torch.testing.assert_close(torch.cat([first, rest]), out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, state)
    steps, s = [], zero[None]
    for t in range(tokens):
        o, s = delta_rule.causal_conv_step(x[t:t + 1], s, weight)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps), out, rtol=1e-6, atol=1e-6)
