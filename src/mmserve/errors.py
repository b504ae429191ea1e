"""The error types a user of mmserve can catch.

Role: one documented exception per kind of failure a caller must handle. Bad input always
raises `InvalidInputError` (a `ValueError`), never an error from deep inside torch or PIL.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager


class InvalidInputError(ValueError):
    """A request's input is unusable: bad media, mismatched placeholders, limits exceeded, ...

    `param` names the request field at fault when there is one, as a path like
    `messages[0].content[1].image_url` (the server's error JSON carries it). `setting` names the
    engine setting whose value refused the input, spelled in the message as it is (e.g.
    `allowed_local_media_path`), so that a front end can name its own spelling instead (the server:
    `--allowed-local-media-path`)."""

    def __init__(self, message: str, param: str | None = None, setting: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.setting = setting

    def reworded(self, message: str) -> InvalidInputError:
        """The same error (field, setting) with another message, e.g. prefixed with where it arose."""
        return InvalidInputError(message, self.param, self.setting)


@contextmanager
def at_param(param: str) -> Iterator[None]:
    """Name `param` as the field at fault of an InvalidInputError raised inside that names none."""
    try:
        yield
    except InvalidInputError as exc:
        if exc.param is None:
            exc.param = param
        raise


class ConfigError(ValueError):
    """An engine setting is unusable: raised at start-up, before anything is served. `key` names it as the
    user spelled it (e.g. `speculative_config.num_speculative_tokens`)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ModelLoadError(RuntimeError):
    """A checkpoint directory cannot be turned into a model: missing files, names or shapes."""


def out_of_vocabulary(token_ids: Iterable[int], vocab_size: int, shown: int | None = None) -> str | None:
    """What to say of the ids in `token_ids` outside a vocabulary of `vocab_size` tokens, each named once
    (the first `shown` of them, then how many more; None: all); None when every id is inside."""
    outside = list(dict.fromkeys(t for t in token_ids if not 0 <= t < vocab_size))
    if not outside:
        return None
    named = ", ".join(str(t) for t in outside[:shown])
    if shown is not None and len(outside) > shown:
        named += f" and {len(outside) - shown} more"
    verb = "is" if len(outside) == 1 else "are"
    return f"token id{'s' if len(outside) > 1 else ''} {named} {verb} out of vocabulary (size {vocab_size})"
