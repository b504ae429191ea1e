"""Qwen2-VL / Qwen2.5-VL: vision tower + language model, and the checkpoint name mapping.

Role: encode items into embedding rows, fuse them into the token embeddings at given rows,
run the decoder, compute logits; `load_weights` maps Hugging Face parameter names (the hub's
`model.*`/`visual.*` layout and transformers 5's `model.language_model.*`/`model.visual.*`)
onto this module, stacking q/k/v and gate/up projections. What it does not know: files,
tokenizers, scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.models.qwen2_vl.config import Qwen2VLConfig
from mmserve.models.qwen2_vl.language import Qwen2LanguageModel
from mmserve.models.qwen2_vl.vision import GridTHW, VisionTransformer

# (hf fragment, our fragment, shard index) for projections we store stacked
_STACKED = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class Qwen2VLForConditionalGeneration(nn.Module):
    def __init__(self, config: Qwen2VLConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTransformer(config.vision)
        self.language_model = Qwen2LanguageModel(config.text)

    # ---- forward pieces -------------------------------------------------------------------
    def encode(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> torch.Tensor:
        """Embedding rows for a batch of items, concatenated in item order."""
        return self.visual(pixel_values, grids)

    def encode_items(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> list[torch.Tensor]:
        """One (rows, hidden) tensor per item: views into one batched encoder output."""
        unit = self.config.vision.spatial_merge_size ** 2
        rows = self.encode(pixel_values, grids)
        return list(rows.split([t * h * w // unit for t, h, w in grids]))

    def embed(self, input_ids: torch.Tensor, mm_rows: torch.Tensor | None = None,
              mm_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with `mm_rows` written at token positions `mm_positions` (a CPU-built index)."""
        embeds = self.language_model.embed(input_ids)
        if mm_rows is not None and mm_rows.shape[0]:
            embeds = embeds.index_copy(0, mm_positions, mm_rows.to(embeds.dtype))
        return embeds

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, backend, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    # ---- weights --------------------------------------------------------------------------
    @staticmethod
    def map_name(hf_name: str) -> str:
        """Hugging Face parameter name -> this module's name (before stacking)."""
        for prefix, ours in (("model.visual.", "visual."), ("visual.", "visual."),
                             ("model.language_model.", "language_model."), ("model.", "language_model."),
                             ("lm_head.", "language_model.lm_head.")):
            if hf_name.startswith(prefix):
                return ours + hf_name[len(prefix):]
        return hf_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        """Copy checkpoint tensors in. Returns (names of our parameters filled, unexpected hf names).

        Raises ValueError naming the tensor on a shape mismatch."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            name = self.map_name(hf_name)
            if name == "visual.patch_embed.proj.weight":
                name, tensor = "visual.patch_embed.weight", tensor.reshape(tensor.shape[0], -1)
            if name.startswith("language_model.lm_head.") and self.config.text.tie_word_embeddings:
                continue  # tied: the embedding matrix is the head
            shard = None
            for frag, stacked, idx in _STACKED:
                if frag in name:
                    name, shard = name.replace(frag, stacked), idx
                    break
            param = params.get(name)
            if param is None:
                unexpected.append(hf_name)
                continue
            target = param.data if shard is None else self._shard(name, param, shard)
            if target.shape != tensor.shape:
                raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)} for {name!r}")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        return loaded, unexpected

    def _shard(self, name: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        if ".qkv_proj." in name:
            t = self.config.text
            sizes = [t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim,
                     t.num_key_value_heads * t.head_dim]
        else:
            half = param.shape[0] // 2
            sizes = [half, half]
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])

    def expected_weight_names(self) -> set[str]:
        """What `load_weights` must have filled for the model to be complete."""
        out = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                out.update(f"{name}#{i}" for i in range(3))
            elif ".gate_up_proj." in name:
                out.update(f"{name}#{i}" for i in range(2))
            else:
                out.add(name)
        return out
