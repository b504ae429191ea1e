"""mmserve: a serving engine for vision-language models on PyTorch.

Role: the package's public names (`from mmserve import LLM, SamplingParams, ...`). They are loaded when first
asked for (PEP 562), not when the package is imported: a client-side helper (`mmserve.demo.shapes`, the
`mmserve` command's argument parser) imports the package without paying for torch and the engine.
What it does not know: anything the names do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmserve.entrypoints.llm import LLM
    from mmserve.errors import ConfigError, InvalidInputError, ModelLoadError
    from mmserve.inputs.media import VideoFrames
    from mmserve.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
        ScoringRequestOutput,
    )
    from mmserve.pooling import PoolerConfig, PoolingParams
    from mmserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

# each public name -> the module that defines it
_HOMES = {
    "LLM": "mmserve.entrypoints.llm",
    "ConfigError": "mmserve.errors",
    "InvalidInputError": "mmserve.errors",
    "ModelLoadError": "mmserve.errors",
    "VideoFrames": "mmserve.inputs.media",
    "BeamSearchOutput": "mmserve.outputs",
    "BeamSearchSequence": "mmserve.outputs",
    "CompletionOutput": "mmserve.outputs",
    "Logprob": "mmserve.outputs",
    "RequestOutput": "mmserve.outputs",
    "EmbeddingRequestOutput": "mmserve.outputs",
    "ScoringRequestOutput": "mmserve.outputs",
    "PoolerConfig": "mmserve.pooling",
    "PoolingParams": "mmserve.pooling",
    "BeamSearchParams": "mmserve.sampling_params",
    "SamplingParams": "mmserve.sampling_params",
    "StructuredOutputsParams": "mmserve.sampling_params",
}

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "ConfigError",
    "InvalidInputError",
    "Logprob",
    "ModelLoadError",
    "PoolerConfig",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "VideoFrames",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # asked once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
