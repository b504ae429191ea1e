"""The Llama 3.2 Vision (mllama) tile encoder and its projector: tiles -> cross-attention states.

Role: the images of a batch, each padded to `max_num_tiles` tiles as `image_processing.stack_images` lays
them out, become the states the language model's cross-attention layers read, exactly as transformers'
`MllamaForConditionalGeneration` computes them. Per tile: a bias-free conv patch embedding, the
aspect-ratio tile embedding (gated), a class token, the gated position embedding (a learned per-patch
embedding times 1 - tanh(gate) plus an aspect-ratio-dependent per-tile one times tanh(gate)) and
`layernorm_pre`. Each tile's tokens are then zero-padded to a multiple of 8 and all tiles of an image
run as one sequence through the local transformer (its hidden states at `intermediate_layers_indices`
kept), `layernorm_post`, a second gated tile embedding and the global transformer, whose layers scale
their attention and MLP outputs by tanh of learned gates. Attention is over the whole image and
masked only between two padding tokens (a padded tile's, or a tile's padding patches): transformers'
mask is the outer product of the padding indicator, so real tokens do attend to padding. Per token the
output is the global transformer's state followed by the intermediate states interleaved (feature
d of every kept layer, then d + 1: transformers stacks them on the last axis), padding patches
dropped, padded tiles kept; `multi_modal_projector` maps it to the text width.

Weights keep transformers' names, so loading is a prefix rename (`map_weight_name`): the hub's
safetensors and transformers 4 name them `vision_model.*` and `multi_modal_projector.*`, transformers
5's in-memory model `model.vision_model.*` and `model.multi_modal_projector.*`; here they are
`vision_model.*` and `multi_modal_projector.*` (the conv kernel stays (hidden, C, P, P)).

What it does not know: prompts, tokens, the cross-attention mask over text, caches, the language model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.layers.mlp import FeedForward
from mmserve.models.mllama.config import MllamaConfig, MllamaVisionConfig

# checkpoint prefix -> this module's; first match wins
WEIGHT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.vision_model.", "vision_model."),  # transformers 5's MllamaForConditionalGeneration
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_model.", "vision_model."),  # the hub's safetensors (transformers 4's layout), MllamaModel
    ("multi_modal_projector.", "multi_modal_projector."),
)


def map_weight_name(name: str) -> str | None:
    """A checkpoint tensor's name -> its name in `MllamaVisionEncoder`; None for the language model's."""
    for prefix, ours in WEIGHT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return None


def padding_attention_bias(aspect_ratio_mask: torch.Tensor, num_patches: int, padded_patches: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """aspect_ratio_mask (images, tiles), 1 for a real tile and 0 for a padded one -> the additive bias
    (images, 1, tiles * padded_patches, tiles * padded_patches) of transformers'
    `_prepare_aspect_ratio_attention_mask`: the dtype's minimum where query and key are both padding
    (a padded tile's token, or one of a tile's last `padded_patches - num_patches` tokens), else 0."""
    images, tiles = aspect_ratio_mask.shape
    padding = torch.ones(images, tiles, padded_patches, dtype=torch.bool, device=aspect_ratio_mask.device)
    padding[:, :, :num_patches] = (aspect_ratio_mask == 0)[:, :, None]
    padding = padding.reshape(images, tiles * padded_patches)
    both = padding[:, :, None] & padding[:, None, :]  # (images, tokens, tokens)
    bias = torch.zeros(both.shape, dtype=dtype, device=both.device).masked_fill_(both, torch.finfo(dtype).min)
    return bias.unsqueeze(1)


class PrecomputedAspectRatioEmbedding(nn.Module):
    """One learned vector per tile for each aspect ratio, times tanh(gate), added to all the tile's tokens."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.max_num_tiles = cfg.max_num_tiles
        self.hidden_size = cfg.hidden_size
        self.embedding = nn.Embedding(cfg.max_aspect_ratio_id + 1, cfg.max_num_tiles * cfg.hidden_size)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        """x (images, tiles, tokens, hidden), aspect_ratio_ids (images,) -> x's shape."""
        embedding = self.embedding(aspect_ratio_ids).reshape(-1, self.max_num_tiles, 1, self.hidden_size)
        return x + embedding * self.gate.tanh()


class PrecomputedPositionEmbedding(nn.Module):
    """A learned per-token position embedding times 1 - tanh(gate), plus one per aspect ratio, tile and
    token times tanh(gate)."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.max_num_tiles = cfg.max_num_tiles
        self.num_patches = cfg.num_patches
        self.hidden_size = cfg.hidden_size
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(cfg.num_patches, cfg.hidden_size))
        self.tile_embedding = nn.Embedding(cfg.max_aspect_ratio_id + 1,
                                           cfg.max_num_tiles * cfg.num_patches * cfg.hidden_size)

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        """x (images, tiles, num_patches, hidden), aspect_ratio_ids (images,) -> x's shape."""
        gate = self.gate.tanh()
        x = x + ((1 - gate) * self.embedding).view(1, 1, self.num_patches, self.hidden_size)
        tile = self.tile_embedding(aspect_ratio_ids).reshape(
            x.shape[0], self.max_num_tiles, self.num_patches, self.hidden_size)
        return x + gate * tile


class VisionAttention(nn.Module):
    """Bias-free multi-head self-attention over one image's tokens, under an additive bias."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.attention_heads
        self.head_dim = cfg.head_dim
        self.scaling = cfg.head_dim ** -0.5  # passed explicitly: SDPA's own 1/sqrt(E) may round apart
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (images, tokens, hidden), bias (images, 1, tokens, tokens) -> (images, tokens, hidden)."""
        n, length, _ = x.shape
        # (images, heads, tokens, head_dim)
        q, k, v = (proj(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(n, length, -1))


class VisionEncoderLayer(nn.Module):
    """A pre-LN block; a gated one (the global transformer's) scales both branches by tanh of its gates."""

    def __init__(self, cfg: MllamaVisionConfig, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.self_attn = VisionAttention(cfg)
        self.mlp = FeedForward(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (images, tokens, hidden) -> the same shape."""
        attn = self.self_attn(self.input_layernorm(x), bias)
        x = x + (self.gate_attn.tanh() * attn if self.gated else attn)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * mlp if self.gated else mlp)


class VisionTransformer(nn.Module):
    """A stack of encoder layers (transformers' `MllamaVisionEncoder`)."""

    def __init__(self, cfg: MllamaVisionConfig, num_layers: int, gated: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, gated) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                keep: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x (images, tokens, hidden) -> (the last layer's output, the outputs of the layers `keep` names,
        0-based, in its order; only those are held)."""
        wanted = set(keep)
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, bias)
            if i in wanted:
                kept[i] = x
        return x, [kept[i] for i in keep]


class MllamaVisionModel(nn.Module):
    """transformers' `MllamaVisionModel`: padded tiles -> (batch, images, tiles, num_patches, vision_output_dim)."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # local layers whose outputs are kept, negative indices made 0-based as Python indexes them
        self.intermediate_layers = tuple(i % cfg.num_hidden_layers for i in cfg.intermediate_layers_indices)
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, padding="valid", bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.gated_positional_embedding = PrecomputedPositionEmbedding(cfg)
        self.pre_tile_positional_embedding = PrecomputedAspectRatioEmbedding(cfg)
        self.post_tile_positional_embedding = PrecomputedAspectRatioEmbedding(cfg)
        # torch's default eps here, not norm_eps: transformers builds these two without it
        self.layernorm_pre = nn.LayerNorm(cfg.hidden_size)
        self.layernorm_post = nn.LayerNorm(cfg.hidden_size)
        self.transformer = VisionTransformer(cfg, cfg.num_hidden_layers, gated=False)
        self.global_transformer = VisionTransformer(cfg, cfg.num_global_layers, gated=True)

    def _check_shapes(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                      aspect_ratio_mask: torch.Tensor) -> None:
        cfg = self.cfg
        if pixel_values.dim() != 6 or tuple(pixel_values.shape[2:]) != (
                cfg.max_num_tiles, cfg.num_channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"pixel_values must be (batch, images, {cfg.max_num_tiles}, {cfg.num_channels}, "
                             f"{cfg.image_size}, {cfg.image_size}), got {tuple(pixel_values.shape)}")
        if tuple(aspect_ratio_ids.shape) != tuple(pixel_values.shape[:2]):
            raise ValueError(f"aspect_ratio_ids must be (batch, images) = {tuple(pixel_values.shape[:2])}, "
                             f"got {tuple(aspect_ratio_ids.shape)}")
        if tuple(aspect_ratio_mask.shape) != tuple(pixel_values.shape[:3]):
            raise ValueError(f"aspect_ratio_mask must be (batch, images, tiles) = {tuple(pixel_values.shape[:3])}, "
                             f"got {tuple(aspect_ratio_mask.shape)}")

    def forward(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                aspect_ratio_mask: torch.Tensor) -> torch.Tensor:
        """pixel_values (batch, images, max_num_tiles, C, S, S), aspect_ratio_ids (batch, images) int,
        aspect_ratio_mask (batch, images, max_num_tiles) 0/1 -> (batch, images, max_num_tiles, num_patches,
        vision_output_dim)."""
        self._check_shapes(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        cfg = self.cfg
        batch, images, tiles = pixel_values.shape[:3]
        n, dim, patches, padded = batch * images, cfg.hidden_size, cfg.num_patches, cfg.padded_patches
        ids = aspect_ratio_ids.reshape(n)
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.reshape(n * tiles, *pixel_values.shape[3:]).to(weight.device, weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # (n * tiles, patches - 1, hidden), row-major patches
        x = self.pre_tile_positional_embedding(x.reshape(n, tiles, patches - 1, dim), ids)
        x = x.reshape(n * tiles, patches - 1, dim)
        x = torch.cat([self.class_embedding.expand(n * tiles, 1, dim), x], dim=1)  # the class token first
        x = self.gated_positional_embedding(x.reshape(n, tiles, patches, dim), ids)
        x = self.layernorm_pre(x)
        x = F.pad(x, (0, 0, 0, padded - patches))  # (n, tiles, padded, hidden): zeros after the norm
        bias = padding_attention_bias(aspect_ratio_mask.reshape(n, tiles).to(x.device), patches, padded, x.dtype)

        x, intermediate = self.transformer(x.reshape(n, tiles * padded, dim), bias, self.intermediate_layers)
        x = self.layernorm_post(x)
        x = self.post_tile_positional_embedding(x.reshape(n, tiles, padded, dim), ids)
        x, _ = self.global_transformer(x.reshape(n, tiles * padded, dim), bias)

        # (n, tokens, hidden * kept): feature d of every kept layer, then d + 1 (stacked on the last axis)
        stacked = torch.stack(intermediate, dim=-1).reshape(n, tiles * padded, -1)
        out = torch.cat([x, stacked], dim=-1).reshape(n, tiles, padded, -1)[:, :, :patches]
        return out.reshape(batch, images, tiles, patches, cfg.vision_output_dim)


class MllamaVisionEncoder(nn.Module):
    """The vision model and `multi_modal_projector`: the language model's cross-attention states."""

    def __init__(self, config: MllamaConfig) -> None:
        super().__init__()
        self.text_hidden_size = config.text_hidden_size
        self.vision_model = MllamaVisionModel(config.vision)
        self.multi_modal_projector = nn.Linear(config.vision.vision_output_dim, config.text_hidden_size, bias=True)

    def forward(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                aspect_ratio_mask: torch.Tensor) -> torch.Tensor:
        """The inputs of `MllamaVisionModel.forward` -> (batch, images * max_num_tiles * num_patches, text
        hidden): image by image, tile by tile (padded tiles included), token by token (the class token
        first). transformers holds the same rows as (batch * images * tiles, num_patches, text hidden)."""
        features = self.vision_model(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        return self.multi_modal_projector(features).reshape(features.shape[0], -1, self.text_hidden_size)
