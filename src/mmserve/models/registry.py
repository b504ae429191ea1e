"""Architecture name (config.json `architectures[0]`) -> model family entry.

Role: the one table that says which architectures mmserve serves and with which classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.qwen2_vl.config import QWEN2_5_VL, QWEN2_VL, parse_config
from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_class: type
    parse_config: Any  # callable(raw config dict) -> typed config


_FAMILIES = {
    QWEN2_VL: ModelFamily("qwen2_vl", Qwen2VLForConditionalGeneration, parse_config),
    QWEN2_5_VL: ModelFamily("qwen2_5_vl", Qwen2VLForConditionalGeneration, parse_config),
}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def resolve(raw_config: dict) -> ModelFamily:
    archs = raw_config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in _FAMILIES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        )
    return _FAMILIES[arch]
