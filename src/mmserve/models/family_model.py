"""The part of a `FamilyModel` every family writes the same way.

Role: a family model holds its decoder as `self.language_model` (embeddings, decoder layers,
logits); `LanguageModelCalls` forwards the runner's `embed` / `forward` / `compute_logits` to it and
brings the shared weight loading (`CheckpointWeights`). A family adds its vision side
(`encode_items`) and its checkpoint name mapping (`_rename`).

What it does not know: any family's encoder, names or config format.
"""

from __future__ import annotations

from typing import Any

import torch

from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.models.weights import CheckpointWeights


class LanguageModelCalls(CheckpointWeights):
    """Mix in before nn.Module."""

    language_model: Any

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None) -> torch.Tensor:
        """positions: (num_position_rows, num_tokens); extra_streams: the deepstack streams, or None."""
        return self.language_model(inputs_embeds, positions, backend, meta, extra_streams)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    @property
    def encoder_device(self) -> torch.device:
        """Where the vision side's weights are (encode_items moves pixels there)."""
        return next(p for n, p in self.named_parameters() if not n.startswith("language_model.")).device

    def drop_language_model(self) -> None:
        """Keep only the vision side (an encoder worker's model): embed/forward/logits are gone."""
        self.language_model = None
