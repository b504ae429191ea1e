"""Gemma 4's audio encoder: log-mel frames to soft tokens in the text model's width.

Role: transformers' `Gemma4AudioModel` (a USM-style conformer) followed by the `embed_audio` projector
(`Gemma4MultimodalEmbedder`), for a batch of clips. The tower: two stride-2 3x3 convs over
(time, mel) with a bias-free LayerNorm and ReLU each, the input frames masked before each conv; a
linear projection of the flattened (bins x channels); conformer layers (half-step feed-forward,
chunked local self-attention with relative positions, a light conv block with a causal depthwise conv,
a second feed-forward, each clamped to +-gradient_clipping and RMS-normed); a biased output projection.
The projector: an RMSNorm without scale, then a bias-free linear to the text width.

Attention, as transformers computes it: queries in blocks of `attention_chunk_size`, each block reading
a context of chunk + (context_left - 1) past + context_right future frames; logits are q.k plus q
against a projected sinusoidal table of relative positions (Transformer-XL's shift), soft-capped with
tanh, and masked logits set to `attention_invalid_logits_value` (-1e9, not -inf). A query sees the keys
at distances 0 .. context_left - 2 behind it (12 with the default 13: transformers' sliding window is
`dist < context_left - 1`), those ahead below context_right, and only real frames. The mask is built
here directly in blocked form; it equals transformers' 4-D mask folded into blocks.

A clip's rows do not depend on its batch: padding frames are zeroed before each conv, masked as keys,
the depthwise conv is causal and everything else acts per frame, so with the padding after a clip's
frames (as the extractor pads) the real rows see the same values as the clip alone; only the rounding
of kernels run on other shapes differs (about 1e-6 in float32, transformers alike).

One deliberate difference: the relative-position table is computed in float32 and then cast, where
transformers keeps its timescales in a buffer that a bfloat16 model holds (and multiplies) in bfloat16;
in float32 the two agree.

Weights: `state_dict()` keys are transformers' with `model.audio_tower.` -> `tower.` and
`model.embed_audio.` -> `embedder.` (the clipped linears' bounds are buffers in both);
`audio_weight_name` maps a checkpoint name.

What it does not know: audio samples or mel features (`audio_input.py`), prompts and placeholders, the
text model, where its weights come from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.gemma4.audio_config import Gemma4AudioConfig
from mmserve.models.gemma4.audio_input import Gemma4AudioInput, audio_soft_tokens
from mmserve.models.gemma4.blocks import ClippableLinear, Gemma4RMSNorm, tower_weight_name
from mmserve.models.layers.activations import get_activation

__all__ = ["Gemma4AudioEncoder", "Gemma4AudioInput", "audio_soft_tokens", "audio_weight_name"]

def audio_weight_name(hf_name: str) -> str | None:
    """Our name for a checkpoint's audio tower or projector tensor; None for any other tensor."""
    return tower_weight_name(hf_name, "audio_tower", "embed_audio")


def _clip_value(clip: float, dtype: torch.dtype) -> float:
    """The residual clamp's bound: the config's `gradient_clipping`, within what `dtype` holds (transformers')."""
    return min(clip, torch.finfo(dtype).max)


class SubsampleLayer(nn.Module):
    """A stride-2 3x3 conv over (time, mel), a bias-free LayerNorm over channels, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, frame_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (batch, channels, frames, bins), frame_mask (batch, frames) -> both with frames halved."""
        x = self.conv((x * frame_mask[:, None, :, None]).to(self.conv.weight.dtype))
        # the norm runs over contiguous channel rows: the first conv's output (one input channel) is NCHW, its
        # permuted view strided, and a norm over that view took 3x as long as the copy and the norm together
        x = self.norm(x.permute(0, 2, 3, 1).contiguous()).relu_().permute(0, 3, 1, 2)
        return x, frame_mask[:, ::2]  # output frame t is centred on input frame 2t


class SubsampleProjection(nn.Module):
    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        first, second = config.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, first, config.rms_norm_eps)
        self.layer1 = SubsampleLayer(first, second, config.rms_norm_eps)
        self.input_proj_linear = nn.Linear(config.projection_input_dims, config.hidden_size, bias=False)

    def forward(self, features: torch.Tensor, frame_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features (batch, frames, bins) -> (batch, frames / 4, hidden) and the subsampled mask."""
        x, mask = self.layer0(features.unsqueeze(1), frame_mask)
        x, mask = self.layer1(x, mask)
        batch, _, frames, _ = x.shape
        return self.input_proj_linear(x.permute(0, 2, 3, 1).reshape(batch, frames, -1)), mask


class FeedForward(nn.Module):
    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden, clipped = config.hidden_size, config.use_clipped_linears
        self.ffw_layer_1 = ClippableLinear(hidden, hidden * 4, clipped)
        self.ffw_layer_2 = ClippableLinear(hidden * 4, hidden, clipped)
        # transformers gives these two norms the default eps, not the config's
        self.pre_layer_norm = Gemma4RMSNorm(hidden)
        self.post_layer_norm = Gemma4RMSNorm(hidden)
        self.act = get_activation(config.hidden_act)
        self.clip = config.gradient_clipping
        self.residual_weight = config.residual_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = _clip_value(self.clip, x.dtype)
        h = self.pre_layer_norm(torch.clamp(x, -clip, clip))
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(h)))
        h = self.post_layer_norm(torch.clamp(h, -clip, clip))
        return h * self.residual_weight + x


class LightConv(nn.Module):
    """RMSNorm, a linear to twice the width, GLU, a causal depthwise conv, RMSNorm, activation, linear."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden, clipped, eps = config.hidden_size, config.use_clipped_linears, config.rms_norm_eps
        self.linear_start = ClippableLinear(hidden, hidden * 2, clipped)
        self.linear_end = ClippableLinear(hidden, hidden, clipped)
        self.depthwise_conv1d = nn.Conv1d(hidden, hidden, config.conv_kernel_size, groups=hidden, bias=False)
        self.pre_layer_norm = Gemma4RMSNorm(hidden, eps)
        self.conv_norm = Gemma4RMSNorm(hidden, eps)
        self.act = get_activation(config.hidden_act)
        self.clip = config.gradient_clipping
        self.left_pad_frames = config.conv_kernel_size - 1  # causal: frame t reads t - (kernel - 1) .. t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        h = self.depthwise_conv1d(F.pad(h.transpose(1, 2), (self.left_pad_frames, 0))).transpose(1, 2)
        clip = _clip_value(self.clip, h.dtype)
        h = self.act(self.conv_norm(torch.clamp(h, -clip, clip)))
        return self.linear_end(h) + x


class ChunkedAttention(nn.Module):
    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden, clipped = config.hidden_size, config.use_clipped_linears
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.chunk = config.attention_chunk_size
        self.past = config.attention_context_left - 1  # past frames in a block's context
        self.future = config.attention_context_right
        self.context = self.chunk + self.past + self.future
        self.q_scale = self.head_dim ** -0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.invalid_logit = config.attention_invalid_logits_value
        self.q_proj = ClippableLinear(hidden, hidden, clipped)
        self.k_proj = ClippableLinear(hidden, hidden, clipped)
        self.v_proj = ClippableLinear(hidden, hidden, clipped)
        self.post = ClippableLinear(hidden, hidden, clipped)
        self.relative_k_proj = nn.Linear(hidden, hidden, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))
        # a 0-d tensor as transformers divides by (not a Python float), so the division rounds alike
        self.register_buffer("softcap", torch.tensor(config.attention_logit_cap), persistent=False)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, frames, heads, dim) -> (batch, heads, blocks, chunk, dim), zero-padded."""
        batch, frames = x.shape[:2]
        blocks = -(-frames // self.chunk)
        x = F.pad(x, (0, 0, 0, 0, 0, blocks * self.chunk - frames))
        return x.reshape(batch, blocks, self.chunk, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)

    def _contexts(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, frames, heads, dim) -> (batch, heads, blocks, context, dim): block b's keys are
        frames b * chunk - past .. b * chunk + chunk + future - 1, zeros outside the clip."""
        x = F.pad(x, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))
        return x.unfold(1, self.context, self.chunk).permute(0, 2, 1, 4, 3)

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        """(..., chunk, positions) -> (..., chunk, context): Transformer-XL's pad-and-reshape shift, so
        that entry (i, c) holds position column c - i (zero where that falls outside the table)."""
        *lead, chunk, positions = x.shape
        x = F.pad(x, (0, self.context + 1 - positions)).reshape(*lead, chunk * (self.context + 1))
        return x[..., : chunk * self.context].reshape(*lead, chunk, self.context)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x (batch, frames, hidden); positions (table, hidden) relative-position embeddings; allowed
        (batch, 1, blocks, chunk, context) bool -> (batch, frames, hidden)."""
        batch, frames, _ = x.shape
        shape = (batch, frames, self.num_heads, self.head_dim)
        q = self.q_proj(x).float().view(shape) * self.q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(shape) * self.k_scale
        v = self.v_proj(x).float().view(shape)
        q = self._blocks(q)  # (batch, heads, blocks, chunk, dim)
        k, v = self._contexts(k), self._contexts(v)  # (batch, heads, blocks, context, dim)
        relative = self.relative_k_proj(positions).view(-1, self.num_heads, self.head_dim).to(q.dtype)
        content = q @ k.transpose(-1, -2)
        position = q.reshape(batch, self.num_heads, -1, self.head_dim) @ relative.permute(1, 2, 0)
        position = self._rel_shift(position.reshape(*q.shape[:4], -1))
        logits = torch.tanh((content + position) / self.softcap) * self.softcap
        logits = logits.masked_fill(~allowed, self.invalid_logit)
        weights = F.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
        out = (weights @ v).permute(0, 2, 3, 1, 4).reshape(batch, -1, self.num_heads * self.head_dim)
        return self.post(out[:, :frames].to(x.dtype))


class ConformerLayer(nn.Module):
    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.feed_forward1 = FeedForward(config)
        self.feed_forward2 = FeedForward(config)
        self.self_attn = ChunkedAttention(config)
        self.lconv1d = LightConv(config)
        self.norm_pre_attn = Gemma4RMSNorm(hidden)
        self.norm_post_attn = Gemma4RMSNorm(hidden)
        self.norm_out = Gemma4RMSNorm(hidden)
        self.clip = config.gradient_clipping

    def forward(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        clip = _clip_value(self.clip, self.norm_pre_attn.weight.dtype)  # transformers: the weights' dtype
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(torch.clamp(x, -clip, clip)), positions, allowed)
        x = self.norm_post_attn(torch.clamp(h, -clip, clip)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -clip, clip))


class AudioTower(nn.Module):
    """transformers' `Gemma4AudioModel`: (features, frame mask) -> (rows, row mask)."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubsampleProjection(config)
        self.layers = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_hidden_layers))
        self.output_proj = nn.Linear(config.hidden_size, config.output_proj_dims, bias=True)

    def relative_positions(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(context // 2 + 1, hidden): [sin, cos] of relative positions context // 2 down to 0, over
        hidden / 2 geometric timescales from 1 to 10^4 (computed in float32, then cast)."""
        c = self.config
        context = c.attention_chunk_size + c.attention_context_left - 1 + c.attention_context_right
        num_timescales = c.hidden_size // 2
        increment = math.log(10_000.0) / max(num_timescales - 1, 1)
        inv_timescales = torch.exp(torch.arange(num_timescales) * -increment).to(device)
        scaled = torch.arange(context // 2, -1, -1, device=device)[:, None] * inv_timescales[None, :]
        return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1).to(dtype)

    def attention_allowed(self, row_mask: torch.Tensor) -> torch.Tensor:
        """(batch, rows) bool -> (batch, 1, blocks, chunk, context) bool: which keys each query sees."""
        c = self.config
        chunk, past = c.attention_chunk_size, c.attention_context_left - 1
        context = chunk + past + c.attention_context_right
        rows, device = row_mask.shape[1], row_mask.device
        starts = torch.arange(-(-rows // chunk), device=device)[:, None] * chunk
        query = (starts + torch.arange(chunk, device=device))[:, :, None]  # (blocks, chunk, 1)
        key = (starts - past + torch.arange(context, device=device))[:, None, :]  # (blocks, 1, context)
        distance = query - key
        # transformers' sliding_window_mask_function((context_left - 1, context_right)): strict bounds
        behind = (distance >= 0) & (distance < past)
        window = behind | ((distance < 0) & (-distance < c.attention_context_right))
        inside = (key >= 0) & (key < rows) & (query < rows)
        key_real = row_mask[:, key.squeeze(1).clamp(0, max(rows - 1, 0))]  # (batch, blocks, context)
        return (window & inside)[None, None] & key_real[:, None, :, None, :]

    def forward(self, features: torch.Tensor, frame_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features (batch, frames, bins), frame_mask (batch, frames) bool -> rows (batch, frames / 4,
        output_proj_dims) and the row mask (batch, frames / 4), True on the rows of real audio."""
        x, row_mask = self.subsample_conv_projection(features, frame_mask)
        positions = self.relative_positions(x.dtype, x.device)
        allowed = self.attention_allowed(row_mask)
        for layer in self.layers:
            x = layer(x, positions, allowed)
        return self.output_proj(x), row_mask


class AudioEmbedder(nn.Module):
    """transformers' `Gemma4MultimodalEmbedder` for audio: RMSNorm without scale, then a linear."""

    def __init__(self, config: Gemma4AudioConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = Gemma4RMSNorm(config.output_proj_dims, config.rms_norm_eps,
                                                     with_scale=False)
        self.embedding_projection = nn.Linear(config.output_proj_dims, text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4AudioEncoder(nn.Module):
    """The audio tower and its projector: clips in, each clip's soft tokens out."""

    def __init__(self, config: Gemma4AudioConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.text_hidden_size = text_hidden_size
        self.tower = AudioTower(config)
        self.embedder = AudioEmbedder(config, text_hidden_size)

    @torch.inference_mode()
    def encode(self, payloads: Sequence[Gemma4AudioInput]) -> list[torch.Tensor]:
        """One (num_soft_tokens, text_hidden) tensor per clip, its real rows in order, from one padded
        batch: each clip's frames padded at the end to the longest clip's with zero features and a False
        mask, as transformers' feature extractor pads a batch. A clip whose num_soft_tokens is below its
        real rows (a processor cap under what its audio gives) keeps its first num_soft_tokens rows."""
        if not payloads:
            return []
        features, frame_mask = self._batch(payloads)
        if features.shape[1] == 0:  # only empty clips: no frames to convolve, no soft tokens
            weight = self.embedder.embedding_projection.weight
            return [weight.new_zeros(0, self.text_hidden_size) for _ in payloads]
        rows, row_mask = self.tower(features, frame_mask)
        embedded = self.embedder(rows)
        out = []
        for i, payload in enumerate(payloads):
            real = embedded[i][row_mask[i]]
            if real.shape[0] < payload.num_soft_tokens:
                raise ValueError(f"clip {i} gives {real.shape[0]} soft tokens, its input says "
                                 f"{payload.num_soft_tokens}")
            out.append(real[: payload.num_soft_tokens])
        return out

    def _batch(self, payloads: Sequence[Gemma4AudioInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, frames, bins) float32 features and (batch, frames) bool mask on the tower's device."""
        mel_bins = {p.features.shape[1] for p in payloads}
        if len(mel_bins) != 1 or not self.config.accepts_mel_bins(next(iter(mel_bins))):
            raise ValueError(f"clips have {sorted(mel_bins)} mel bins; the tower's input projection takes "
                             f"{self.config.projection_input_dims} values per frame")
        frames = max(p.num_frames for p in payloads)
        features = np.zeros((len(payloads), frames, mel_bins.pop()), dtype=np.float32)
        frame_mask = np.zeros((len(payloads), frames), dtype=np.bool_)
        for i, payload in enumerate(payloads):
            features[i, : payload.num_frames] = payload.features
            frame_mask[i, : payload.num_frames] = payload.frame_mask
        device = self.embedder.embedding_projection.weight.device
        return torch.from_numpy(features).to(device), torch.from_numpy(frame_mask).to(device)
