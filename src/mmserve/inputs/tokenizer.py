"""Tokenizer and chat template read from a checkpoint directory, without transformers.

Role: `tokenizer.json` through the `tokenizers` library; the special tokens of `tokenizer_config.json`;
the chat template found and rendered as transformers does (`chat_template.py`). What it does not know:
images, placeholders' meaning, models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.chat import require_unicode
from mmserve.inputs.chat_template import ChatTemplate, load_chat_template, thought_tag_pair


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object, or {} when the file is absent."""
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a `tokenizer_config.json` (`bos_token`, `eos_token`, ..., and a model's own,
    such as `image_token`), as transformers hands them to a chat template."""
    named = {k: v for k, v in config.items() if k.endswith("_token")}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):  # a model's named tokens may come here instead
        named.update(extra)
    return {k: c for k, v in named.items() if isinstance(c := _token_content(v), str)}


class TextTokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: a template that replaces the directory's (vLLM's --chat-template, read)."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {model_dir}")
        self._tok = Tokenizer.from_file(str(path))
        config = read_json(root / "tokenizer_config.json")
        self._config = config
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.bos_token: str | None = _token_content(config.get("bos_token"))
        self.eos_token_id: int | None = self.token_to_id(self.eos_token) if self.eos_token else None
        self.special_token_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.chat_template = chat_template or load_chat_template(root)
        self._template = None if self.chat_template is None else ChatTemplate(self.chat_template,
                                                                                special_tokens(config))

    def info(self) -> dict[str, Any]:
        """What vLLM's /tokenizer_info answers: the tokenizer's configuration (`tokenizer_config.json`
        without its added-token table, which /tokenize and the vocabulary already give), its class as
        transformers would load it, and the chat template this tokenizer renders."""
        info = {k: v for k, v in self._config.items() if k not in ("added_tokens_decoder", "chat_template")}
        info["tokenizer_class"] = self._config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        if self.chat_template is not None:
            info["chat_template"] = self.chat_template
        return info

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers` tokenizer itself (for libraries that read its vocabulary and type)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(require_unicode(text, None), add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def thought_token_ids(self) -> tuple[int, int] | None:
        """(open, close) ids of the thought tags when the chat template thinks and each tag is one token."""
        tags = thought_tag_pair(self.chat_template)
        if tags is None:
            return None
        ids = self.token_to_id(tags[0]), self.token_to_id(tags[1])
        return None if None in ids else (ids[0], ids[1])

    def bad_words_token_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as vLLM finds them: the word, and the word after a space where that
        starts with another token and has as many."""
        found: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.encode(word.lstrip()))
            if plain:
                found.append(plain)
            spaced = tuple(self.encode(" " + word.lstrip()))
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                found.append(spaced)
        return tuple(found)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._template is None:
            raise InvalidInputError("this model has no chat template; pass a plain prompt instead")
        return self._template.render(messages, add_generation_prompt, **kwargs)
