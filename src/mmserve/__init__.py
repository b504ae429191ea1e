"""mmserve: a serving engine for vision-language models on PyTorch."""

from mmserve.errors import InvalidInputError, ModelLoadError

__all__ = ["InvalidInputError", "ModelLoadError"]
__version__ = "0.1.0"
