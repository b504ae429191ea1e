"""The Responses API's store: the responses `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` name.

Role: `ResponseStore` keeps each stored response (its JSON as answered) with the conversation it answered:
the input items before its output, the earlier responses' items included, so continuing from it never
needs an older one. Images in those items stay as the client sent them (a data URL or an http(s) URL,
fetched again when the conversation continues), never as decoded pixels. The store is bounded twice: by
bytes (the JSON size of each response and its conversation, counted in full even where a chain shares
items) and by age (since it was stored); the oldest go first, whichever bound is crossed. A response too
large for the whole budget is not kept. A lookup of an id it does not hold (never stored, deleted,
evicted) raises `ResponseNotStored`; a continuation deeper than `max_chain_depth` raises
`ChainTooDeep`. Time comes from the `clock` it is given (a fake one in tests).
What it does not know: HTTP, the engine, how items become a prompt, what a response's fields mean.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_AGE_S = 3600.0
DEFAULT_MAX_CHAIN_DEPTH = 100


class ResponseNotStored(LookupError):
    """No stored response has this id: never stored, deleted, or evicted (by age or bytes)."""

    def __init__(self, response_id: str, store: ResponseStore) -> None:
        super().__init__(f"no stored response has the id {response_id!r:.80}: it was never stored (store: false), "
                         f"was deleted, or was evicted (the server keeps stored responses for "
                         f"{store.max_age_s:g} s and {store.max_bytes} bytes in all, the oldest evicted first)")
        self.response_id = response_id


class ChainTooDeep(ValueError):
    """A continuation would make a chain of `previous_response_id`s longer than the store allows."""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its JSON as answered, the input items of its whole conversation (earlier
    responses' input and output items, then its own request's input; instructions are never carried), the
    length of its `previous_response_id` chain (0: it continued none), its size and when it was stored."""

    response_id: str
    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    chain_depth: int
    size_bytes: int
    stored_at_s: float

    @property
    def output_items(self) -> list[dict[str, Any]]:
        return list(self.response.get("output", []))

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a request continuing from this response puts before its own input."""
        return [*self.input_items, *self.output_items]


def json_size_bytes(value: Any) -> int:
    """The bytes of `value` as compact UTF-8 JSON: what the store counts."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class ResponseStore:
    """Stored responses by id, oldest first, within `max_bytes` and `max_age_s` (module docstring). Used from
    the app's event loop only: no lock."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 max_chain_depth: int = DEFAULT_MAX_CHAIN_DEPTH, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes <= 0 or max_age_s <= 0 or max_chain_depth < 1:
            raise ValueError(f"the response store needs max_bytes > 0, max_age_s > 0 and max_chain_depth >= 1; got "
                             f"{max_bytes}, {max_age_s}, {max_chain_depth}")
        self.max_bytes, self.max_age_s, self.max_chain_depth = max_bytes, max_age_s, max_chain_depth
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # in the order stored: oldest first
        self.num_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        self._evict_expired()
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        self._evict_expired()
        return response_id in self._entries

    def get(self, response_id: str) -> StoredResponse:
        """The stored response, or ResponseNotStored."""
        self._evict_expired()
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotStored(response_id, self)
        return entry

    def chain_depth_after(self, previous: StoredResponse | None) -> int:
        """The chain depth of a response that continues `previous` (None: it continues none), or
        ChainTooDeep where that passes `max_chain_depth`."""
        depth = 0 if previous is None else previous.chain_depth + 1
        if depth > self.max_chain_depth:
            raise ChainTooDeep(f"previous_response_id {previous.response_id!r} ends a chain of {previous.chain_depth} "
                               f"earlier responses: this server continues chains of at most {self.max_chain_depth}; "
                               "start a new conversation (send the history as input)")
        return depth

    def put(self, response_id: str, response: dict[str, Any], input_items: list[dict[str, Any]],
            chain_depth: int) -> bool:
        """Store a response (replacing one of the same id); False where it alone is over the byte budget
        (then it is not kept). Older responses are evicted until the budget holds."""
        self._evict_expired()
        self._remove(response_id)
        size_bytes = json_size_bytes(response) + json_size_bytes(input_items)
        if size_bytes > self.max_bytes:
            self.num_evicted += 1
            return False
        self._entries[response_id] = StoredResponse(response_id, response, tuple(input_items), chain_depth,
                                                    size_bytes, self.clock())
        self.num_bytes += size_bytes
        while self.num_bytes > self.max_bytes:
            self._evict_oldest()
        return True

    def delete(self, response_id: str) -> None:
        """Forget a stored response, or ResponseNotStored."""
        self.get(response_id)
        self._remove(response_id)

    def check_integrity(self) -> None:
        """The byte count is the sum of what the store holds, within the budget; entries are oldest first."""
        sizes = [e.size_bytes for e in self._entries.values()]
        assert self.num_bytes == sum(sizes), (self.num_bytes, sum(sizes))
        assert 0 <= self.num_bytes <= self.max_bytes, (self.num_bytes, self.max_bytes)
        times = [e.stored_at_s for e in self._entries.values()]
        assert times == sorted(times), "entries are not in the order stored"
        for entry in self._entries.values():
            assert entry.size_bytes == json_size_bytes(entry.response) + json_size_bytes(list(entry.input_items))
            assert entry.chain_depth <= self.max_chain_depth

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.size_bytes

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.size_bytes
        self.num_evicted += 1

    def _evict_expired(self) -> None:
        # stored in time order: the expired ones are a prefix
        deadline_s = self.clock() - self.max_age_s
        while self._entries and next(iter(self._entries.values())).stored_at_s <= deadline_s:
            self._evict_oldest()
