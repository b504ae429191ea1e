"""Gemma 4's assistant drafter (`gemma4_assistant`, the hub's "-assistant" checkpoints): its config, read.

Role: parse the drafter's config.json into a typed record — its small decoder (every layer KV-shared: it
reads the target's last sliding and full caches, so it has no cache of its own), the width of the target's
hidden state it is fed, and its centroid-ordered output embeddings — so that naming such a checkpoint gives
a clear answer instead of an unknown-architecture error: it is a speculative-decoding drafter, not a model
to serve, and mmserve does not draft with it yet.

What it does not know: weights, the target, the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.gemma4.config import TextConfig, parse_text_config

ASSISTANT = "Gemma4AssistantForCausalLM"


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    text: TextConfig
    backbone_hidden_size: int  # the target's hidden width, which the drafter reads
    use_ordered_embeddings: bool = False
    num_centroids: int | None = None
    centroid_intermediate_top_k: int | None = None


def parse_assistant_config(raw: dict[str, Any]) -> Gemma4AssistantConfig:
    text = dict(raw.get("text_config") or {})
    try:
        return Gemma4AssistantConfig(
            parse_text_config(text, raw), int(raw.get("backbone_hidden_size") or text.get("hidden_size") or 0),
            bool(raw.get("use_ordered_embeddings", False)), raw.get("num_centroids"),
            raw.get("centroid_intermediate_top_k"))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Gemma 4 assistant config: {exc}") from exc


def not_served(raw: dict[str, Any]) -> ModelLoadError:
    """The error for serving an assistant checkpoint (its config parsed first, so a broken one says so)."""
    config = parse_assistant_config(raw)
    return ModelLoadError(
        f"{ASSISTANT} is Gemma 4's assistant drafter ({config.text.num_hidden_layers} layers reading a "
        f"{config.backbone_hidden_size}-wide Gemma 4 target's caches), a speculative-decoding drafter, not a "
        "model to serve; mmserve does not draft with it yet (speculative_config methods: ngram, draft_model, "
        "mtp)")
