"""The error types a user of mmserve can catch.

Role: one documented exception per kind of failure a caller must handle. Bad input always
raises `InvalidInputError` (a `ValueError`), never an error from deep inside torch or PIL.
"""

from __future__ import annotations


class InvalidInputError(ValueError):
    """A request's input is unusable: bad media, mismatched placeholders, limits exceeded, ...

    `param` names the request field at fault when there is one (the server's error JSON carries it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(RuntimeError):
    """A checkpoint directory cannot be turned into a model: missing files, names or shapes."""
