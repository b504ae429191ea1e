"""mmserve: a serving engine for vision-language models on PyTorch."""

from mmserve.entrypoints.llm import LLM
from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.media import VideoFrames
from mmserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from mmserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "InvalidInputError", "Logprob", "ModelLoadError", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "VideoFrames"]
__version__ = "0.1.0"
