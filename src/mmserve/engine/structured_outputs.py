"""Structured outputs: grammars compiled off the step loop, one matcher per sequence, each step's bitmask.

Role: turn a request's `StructuredOutputsParams` into an xgrammar grammar (compiled on one worker thread,
cached by kind and canonical text), hold one `GrammarMatcher` per constrained sequence (each choice of an
`n > 1` request its own), fill the packed token bitmask of the constrained sequences a step schedules, and
advance a matcher by the tokens its sequence got. xgrammar is imported on first use: an engine that never
sees a grammar never pays for it. With a thinking chat template (its thought tags single tokens) the grammar
applies after the thought: a sequence whose prompt ends inside a thought is unconstrained until it closes it,
and one that does not may open a thought with its first token (the mask allows the grammar's tokens and the
opening tag).
What it does not know: the scheduler, the model, the sampler (it hands out packed int32 rows: bit j of row
word j // 32 set = token j allowed), why a request finished.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from mmserve.errors import InvalidInputError
from mmserve.inputs.tokenizer import TextTokenizer
from mmserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
# compact JSON has no space after its separators, as vLLM's disable_any_whitespace (xgrammar's own compact
# default writes ", " and ": ")
COMPACT_SEPARATORS = (",", ":")
PARAM = "structured_outputs"


def _choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of the strings (each escaped for xgrammar's regex dialect)."""
    special = set(r"\.^$|?*+()[]{}/")
    return "(" + "|".join("".join("\\" + c if c in special else c for c in choice) for choice in choices) + ")"


class StructuredOutputs:
    """The engine's grammars and matchers (the engine thread calls everything but the compile worker)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._thought_ids = tokenizer.thought_token_ids()  # (open, close), or None: grammars apply from the start
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built by the worker on first compile
        self._lock = threading.Lock()  # the cache is read by callers' threads and written by the worker's
        self._grammars: OrderedDict[tuple, Future] = OrderedDict()
        self.matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher
        # request id -> True: inside a thought (unconstrained until its closing tag); False: its next token
        # may open one. Absent: the grammar applies.
        self._thoughts: dict[str, bool] = {}
        self.num_compiled = 0

    @property
    def bitmask_words(self) -> int:
        return -(-self.vocab_size // 32)

    # ---- compiling (any thread) -------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> Future:
        """The grammar's compile, started on the worker thread unless cached; its result is the compiled
        grammar, its exception an InvalidInputError naming structured_outputs."""
        with self._lock:
            future = self._grammars.get(params.key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._grammars.move_to_end(params.key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmserve-grammar")
            future = self._pool.submit(self._compile, params)
            self._grammars[params.key] = future
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
            return future

    def compiled(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar, waiting for it if needed; InvalidInputError if it does not compile."""
        return self.compile(params).result()

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr), max_threads=1)
        compiler = self._compiler
        kind, text, any_whitespace = params.key
        try:
            if kind == "json":
                schema = json.dumps(rewrite_bounded_strings(json.loads(text)))
                grammar = compiler.compile_json_schema(schema, any_whitespace=any_whitespace, strict_mode=True,
                                                       separators=_separators(any_whitespace))
            elif kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                       separators=_separators(any_whitespace))
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            elif kind == "choice":
                grammar = compiler.compile_regex(_choice_regex(tuple(json.loads(text))))
            elif kind == "structural_tag":
                grammar = compiler.compile_structural_tag(text)
            else:
                grammar = compiler.compile_grammar(text)
        except InvalidInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidInputError(f"structured_outputs {kind} does not compile: {reason}", param=PARAM) from None
        self.num_compiled += 1
        return grammar

    def _tokenizer_info(self, xgr: Any) -> Any:
        """xgrammar's view of the vocabulary: every id's token string, decoded as the tokenizer's type
        says (byte-level, byte-fallback, raw), over the model's whole (padded) vocabulary."""
        tok = self._tokenizer.backend
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        vocab = [""] * self.vocab_size
        for token, token_id in tok.get_vocab(with_added_tokens=True).items():
            if token_id < self.vocab_size:
                vocab[token_id] = token
        return xgr.TokenizerInfo(vocab, metadata["vocab_type"], vocab_size=self.vocab_size,
                                 stop_token_ids=self._stop_token_ids, add_prefix_space=metadata["add_prefix_space"])

    # ---- matchers (the engine thread) ---------------------------------------------------------------
    def start(self, request_id: str, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.matchers[request_id] = xgr.GrammarMatcher(self.compiled(params))
        if self._thought_ids is not None:
            open_id, close_id = self._thought_ids
            last = {t: i for i, t in enumerate(prompt_token_ids) if t in self._thought_ids}
            self._thoughts[request_id] = last.get(open_id, -1) > last.get(close_id, -1)

    def fill(self, request_ids: list[str], drafts: Mapping[str, tuple[int, ...]] | None = None
             ) -> dict[str, torch.Tensor]:
        """The packed bitmask row of each constrained request among `request_ids` (int32, bitmask_words); one
        with `drafts` to verify: a row for its next token and one after each draft ((k + 1, words))."""
        constrained = [rid for rid in request_ids if rid in self.matchers and not self._thoughts.get(rid)]
        if not constrained:
            return {}
        drafts = drafts or {}
        drafted = {rid: self._draft_rows(rid, drafts[rid]) for rid in constrained if drafts.get(rid)}
        constrained = [rid for rid in constrained if rid not in drafted]
        if not constrained:
            return drafted
        bitmask = torch.empty(len(constrained), self.bitmask_words, dtype=torch.int32)
        for row, rid in enumerate(constrained):
            self.matchers[rid].fill_next_token_bitmask(bitmask, row)
            if rid in self._thoughts:  # may open a thought instead of starting the grammar
                open_id = self._thought_ids[0]
                bitmask[row, open_id // 32] |= torch.tensor(1, dtype=torch.int32) << (open_id % 32)
        return {rid: bitmask[row] for row, rid in enumerate(constrained)} | drafted

    def _draft_rows(self, request_id: str, drafts: tuple[int, ...]) -> torch.Tensor:
        """The grammar's mask before each draft and after the last, the matcher walked through the drafts and
        back. Past a draft the grammar refuses, the rows repeat the last: verification stops at that draft."""
        matcher = self.matchers[request_id]
        rows = torch.empty(len(drafts) + 1, self.bitmask_words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(rows, 0)
        walked = 0
        for i, token in enumerate(drafts):
            if matcher.is_terminated() or not matcher.accept_token(token):
                rows[i + 1:] = rows[i]
                break
            walked += 1
            if matcher.is_terminated():  # a stop token: nothing follows it
                rows[i + 1:] = rows[i]
                break
            matcher.fill_next_token_bitmask(rows, i + 1)
        if walked:
            matcher.rollback(walked)
        return rows

    def tracks_thought(self, request_id: str) -> bool:
        """Whether the request's answer may still open a reasoning thought before its grammar applies."""
        return request_id in self._thoughts

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the request's matcher by its new tokens; False if the grammar refused one (the mask
        allowed only what the grammar accepts, so this is a bookkeeping fault)."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return True
        for token_id in token_ids:
            if request_id in self._thoughts:
                open_id, close_id = self._thought_ids
                if self._thoughts[request_id]:  # inside the thought: the grammar starts after its closing tag
                    if token_id == close_id:
                        del self._thoughts[request_id]
                    continue
                if token_id == open_id:
                    self._thoughts[request_id] = True
                    continue
                del self._thoughts[request_id]  # the answer started without a thought
            if matcher.is_terminated():
                return token_id in self._stop_token_ids
            if not matcher.accept_token(token_id):
                return False
        return True

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self._thoughts.pop(request_id, None)

    def tracked_ids(self) -> set[str]:
        """The sequences holding a matcher or a thought state (empty when idle)."""
        return set(self.matchers) | set(self._thoughts)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _separators(any_whitespace: bool) -> tuple[str, str] | None:
    return None if any_whitespace else COMPACT_SEPARATORS


def json_schema_ebnf(schema: Any, param: str, any_whitespace: bool = False) -> str:
    """The EBNF grammar (xgrammar's dialect) of JSON matching `schema`, compact unless `any_whitespace`,
    length-bounded strings rewritten as below; InvalidInputError naming `param` if it does not convert."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(rewrite_bounded_strings(schema)),
                                               any_whitespace=any_whitespace, strict_mode=True,
                                               separators=_separators(any_whitespace))
    except InvalidInputError as exc:
        raise InvalidInputError(str(exc).replace(PARAM, param, 1), param=param) from None
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
        raise InvalidInputError(f"{param}: the JSON schema does not compile: {str(exc).strip()[:200]}",
                                param=param) from None
    return str(grammar)


# a JSON string's characters that need no escape: xgrammar's length-bounded string rule lets raw control
# characters through (invalid JSON), so bounded strings are rewritten to this class, repeated min..max times
_UNESCAPED_CHAR = '[^\\x00-\\x1f"\\\\]'


def rewrite_bounded_strings(node: Any) -> Any:
    """The schema with each `minLength`/`maxLength` string as a pattern over characters needing no escape
    (so a length-bounded string holds no quotes, backslashes or control characters); one that also has a
    `pattern` or `format` is refused, since the two cannot be combined into one pattern here."""
    if isinstance(node, list):
        return [rewrite_bounded_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: rewrite_bounded_strings(v) for k, v in node.items()}
    if out.get("type") == "string" and ("minLength" in out or "maxLength" in out):
        if "pattern" in out or "format" in out:
            raise InvalidInputError("structured_outputs json: a string with minLength/maxLength and a pattern or "
                                    "format is not supported (xgrammar would let invalid characters through)",
                                    param=PARAM)
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        if not isinstance(low, int) or (high is not None and not isinstance(high, int)):
            raise InvalidInputError("structured_outputs json: minLength and maxLength must be integers", param=PARAM)
        out["pattern"] = f"^{_UNESCAPED_CHAR}{{{low},{'' if high is None else high}}}$"
    return out
