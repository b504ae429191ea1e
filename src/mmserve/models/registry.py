"""Architecture name (config.json `architectures[0]`) -> model family.

Role: the one table that says which architectures mmserve serves; each family's folder exports
its `FAMILIES` (architecture -> `ModelFamily`), and adding a family adds one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from mmserve.errors import ModelLoadError
from mmserve.models.gemma3 import family as gemma3
from mmserve.models.gemma4 import family as gemma4
from mmserve.models.gemma4.assistant import ASSISTANT, not_served
from mmserve.models.llava_onevision import family as llava_onevision
from mmserve.models.mistral3 import family as mistral3
from mmserve.models.mllama import family as mllama
from mmserve.models.qwen2_vl import family as qwen2_vl
from mmserve.models.qwen3_5 import family as qwen3_5
from mmserve.models.qwen3_vl import family as qwen3_vl
from mmserve.models.spec import ModelFamily

_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({
    **qwen2_vl.FAMILIES,
    **llava_onevision.FAMILIES,
    **qwen3_vl.FAMILIES,
    **qwen3_5.FAMILIES,
    **gemma3.FAMILIES,
    **gemma4.FAMILIES,
    **mistral3.FAMILIES,
    **mllama.FAMILIES,
})


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def resolve(raw_config: dict) -> ModelFamily:
    archs = raw_config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch == ASSISTANT:
        raise not_served(raw_config)
    if arch not in _FAMILIES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        )
    return _FAMILIES[arch]
