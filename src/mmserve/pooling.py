"""Pooling: how a pooling runner turns a prompt's hidden states into one vector, and that vector into an
embedding or a score.

Role: `PoolerConfig` (vLLM's `--pooler-config`: the task, the pooling type, the activation, default
dimensions), `RerankerOverrides` (the `--hf-overrides` keys vLLM serves an original Qwen3 reranker with: the
"no"/"yes" classifier tokens), `resolve_pooling` (those over what the checkpoint says: its
sentence-transformers files `modules.json` and the Pooling module's `config.json`, `config.json`'s
Matryoshka keys; vLLM's defaults otherwise: last token, normalized) and the per-request finishing of a
pooled vector (`embedding`: Matryoshka truncation then L2 normalization; `relevance`: a reranker's
logit difference through a sigmoid; `cosine`).
What it does not know: tensors, the runner, the engine, HTTP.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserve.errors import InvalidInputError

RUNNERS = ("generate", "pooling")  # vLLM's --runner values besides "auto" (the checkpoint's: generate here)
POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "score")  # score: a reranker's relevance from its classifier tokens
POOLER_KEYS = ("task", "pooling_type", "use_activation", "normalize", "dimensions")
OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker", "is_matryoshka",
                 "matryoshka_dimensions")
# sentence-transformers' pooling flags -> our pooling types (others are refused: we pool these three)
ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                    "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `--pooler-config`; None fields take the checkpoint's (or vLLM's default)."""

    task: str | None = None
    pooling_type: str | None = None
    use_activation: bool | None = None  # embed: L2-normalize; score: sigmoid
    dimensions: int | None = None  # an embedding's default Matryoshka dimensions

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"pooler_config.task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"pooler_config.dimensions must be a positive integer, got {self.dimensions!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | Mapping[str, Any] | str | None) -> PoolerConfig | None:
        """A PoolerConfig, its dict, or its JSON text (the flag's value); vLLM's keys we do not implement are
        refused naming them."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        fields = _json_object(value, "pooler_config", POOLER_KEYS, "")
        if "normalize" in fields:  # vLLM's older spelling of use_activation for embeddings
            fields.setdefault("use_activation", fields.pop("normalize"))
        return cls(**fields)


@dataclass(frozen=True)
class RerankerOverrides:
    """The `hf_overrides` keys mmserve reads (vLLM's spelling for serving an original Qwen3 reranker and for
    Matryoshka embeddings); any other key is refused: mmserve edits no other config field."""

    classifier_from_token: tuple[str, str] | None = None  # ("no", "yes"): score = sigmoid(yes - no)
    is_matryoshka: bool | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, value: Mapping[str, Any] | str | None) -> RerankerOverrides:
        if value is None:
            return cls()
        value = _json_object(value, "hf_overrides", OVERRIDE_KEYS, "; edit config.json in a copy of the checkpoint")
        archs = value.get("architectures") or []
        if any(not str(a).endswith("ForSequenceClassification") for a in archs):
            raise ValueError("hf_overrides.architectures: mmserve reads only *ForSequenceClassification (a reranker "
                             "scored by its classifier tokens)")
        tokens = value.get("classifier_from_token")
        if tokens is not None and (not isinstance(tokens, (list, tuple)) or len(tokens) != 2):
            raise ValueError("hf_overrides.classifier_from_token must name two tokens, e.g. [\"no\", \"yes\"]")
        dims = value.get("matryoshka_dimensions")
        return cls(None if tokens is None else (str(tokens[0]), str(tokens[1])), value.get("is_matryoshka"),
                   None if dims is None else tuple(int(d) for d in dims))


@dataclass(frozen=True)
class Pooling:
    """What a pooling engine does, resolved once at start from the checkpoint and the flags."""

    task: str  # "embed" or "score"
    pooling_type: str  # LAST, MEAN or CLS
    use_activation: bool
    hidden_size: int
    dimensions: int | None = None  # the default Matryoshka dimensions (None: the whole vector)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only ones allowed, when the model lists them
    matryoshka: bool = True  # False: the model says it was not trained for truncation
    classifier_from_token: tuple[str, str] | None = None

    def check_dimensions(self, dimensions: int | None, param: str = "dimensions") -> int | None:
        """A request's `dimensions` (None: the default) or InvalidInputError naming `param`."""
        if dimensions is None:
            return self.dimensions
        if self.task != "embed":
            raise InvalidInputError("dimensions applies to embeddings; this model scores", param=param)
        if not self.matryoshka:
            raise InvalidInputError("this model does not support Matryoshka dimensions (is_matryoshka is false)",
                                    param=param)
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise InvalidInputError(f"dimensions must be a positive integer, got {dimensions!r}", param=param)
        if dimensions > self.hidden_size:
            raise InvalidInputError(f"dimensions={dimensions} is larger than the model's embedding size "
                                    f"({self.hidden_size})", param=param)
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise InvalidInputError(f"dimensions={dimensions} is not one the model supports "
                                    f"({', '.join(map(str, self.matryoshka_dimensions))})", param=param)
        return dimensions


def resolve_pooling(model_dir: str, hidden_size: int, config: PoolerConfig | None,
                    overrides: RerankerOverrides) -> Pooling:
    """The checkpoint's pooling under the flags: `--pooler-config` wins, then the sentence-transformers files,
    then vLLM's defaults (last token, activation on)."""
    config = config or PoolerConfig()
    raw = _read_json(Path(model_dir) / "config.json")
    tokens = overrides.classifier_from_token or _pair(raw.get("classifier_from_token"))
    task = config.task or ("score" if tokens is not None else "embed")
    if task == "score" and tokens is None:
        raise ValueError("pooler_config.task=score needs the reranker's classifier tokens: pass hf_overrides "
                         "{\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}")
    st_type, st_normalize = sentence_transformers_pooling(Path(model_dir))
    matryoshka = overrides.is_matryoshka if overrides.is_matryoshka is not None else raw.get("is_matryoshka")
    dims = overrides.matryoshka_dimensions or raw.get("matryoshka_dimensions")
    return Pooling(task, config.pooling_type or st_type or "LAST",
                   config.use_activation if config.use_activation is not None
                   else (st_normalize if st_normalize is not None and task == "embed" else True),
                   hidden_size, config.dimensions, tuple(dims) if dims else None, matryoshka is not False,
                   tokens)


def sentence_transformers_pooling(model_dir: Path) -> tuple[str | None, bool | None]:
    """(pooling type, normalized) as the checkpoint's sentence-transformers modules say; (None, None) without
    them. A pooling mode mmserve does not implement (max, weighted mean) is refused."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None, None
    pooling_type = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            settings = _read_json(model_dir / str(module.get("path", "")) / "config.json")
            chosen = [mode for flag, mode in ST_POOLING_MODES.items() if settings.get(flag)]
            others = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v
                      and k not in ST_POOLING_MODES]
            if others or len(chosen) > 1:
                raise ValueError(f"the checkpoint's sentence-transformers pooling ({', '.join(others + chosen)}) "
                                 "is not one mmserve implements (last token, mean, CLS); override it with "
                                 "--pooler-config")
            pooling_type = chosen[0] if chosen else None
    return pooling_type, normalize


def embedding(vector: Sequence[float], dimensions: int | None, normalize: bool) -> list[float]:
    """A pooled hidden state as an embedding: the first `dimensions` values, then L2-normalized (vLLM's order)."""
    values = [float(v) for v in (vector[:dimensions] if dimensions else vector)]
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in values))
        values = [v / max(norm, 1e-12) for v in values]
    return values


def relevance(vector: Sequence[float], use_activation: bool) -> float:
    """A reranker's pooled output (its "yes" logit minus its "no" logit) as a score in [0, 1]."""
    logit = float(vector[0])
    if not use_activation:
        return logit
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / max(norm, 1e-12)


def _json_object(value: Mapping[str, Any] | str, name: str, keys: Sequence[str], advice: str) -> dict[str, Any]:
    """A flag's JSON object (or dict), or ValueError naming the keys mmserve does not read."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{name} key(s) {', '.join(unknown)} are not supported by mmserve (it reads only "
                         f"{', '.join(keys)}){advice}")
    return dict(value)


def _pair(value: Any) -> tuple[str, str] | None:
    return (str(value[0]), str(value[1])) if isinstance(value, (list, tuple)) and len(value) == 2 else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's per-request pooling options: `dimensions` (Matryoshka; None: the model's default) and
    `use_activation` (normalize an embedding, squash a score; None: the engine's pooling says)."""

    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def finish(self, pooling: Pooling, vector: Sequence[float]) -> list[float] | float:
        """The request's embedding (a list) or score (a float) from its pooled vector."""
        active = pooling.use_activation if self.use_activation is None else self.use_activation
        if pooling.task == "score":
            return relevance(vector, active)
        return embedding(vector, pooling.check_dimensions(self.dimensions), active)
