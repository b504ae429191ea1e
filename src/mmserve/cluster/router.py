"""The router: which replica a request goes to, by the media and prefix blocks it likely holds, and its load.

Role: keep, per replica, an approximate and bounded index of what it caches — the content keys of
the media items routed to it and the hashes of the prompt blocks it prefilled (the same keys and
hashes its engine uses) — updated from what was routed and from the evictions the replica reports,
never by asking a replica per request. `choose` scores each live replica by the encoder rows and
prefix tokens a request would find there — a hit counts only where it saves at least
`min_hit_fraction` of the request's work — and balances that against load (requests in flight):
only replicas within a load gap of the least loaded are candidates, so one hot image cannot pin
all traffic to one replica (its second replica caches it too). Policies: `cache_aware` (default),
`round_robin`, `least_loaded`.
What it does not know: processes, HTTP, tensors, engines; it sees `RouteKeys` and replica numbers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

ROUTING_POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    max_media_keys: int = 4096  # per replica: content keys remembered (an LRU, approximate by design)
    max_blocks: int = 65536  # per replica: prefix-block hashes remembered
    # a replica is a candidate while its requests in flight exceed the least loaded one's by at most
    # max(max_load_gap, load_gap_fraction x that load): a batch absorbs a few more requests cheaply,
    # a queue of many does not
    max_load_gap: int = 8
    load_gap_fraction: float = 0.5
    # a replica's expected hit (its held items' rows plus its cached prefix tokens) attracts a request only
    # from this fraction of the request's prompt tokens plus media rows (SGLang's router has the same idea)
    min_hit_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; use one of {', '.join(ROUTING_POLICIES)}")
        if self.max_media_keys < 1 or self.max_blocks < 1 or self.max_load_gap < 0 or self.load_gap_fraction < 0:
            raise ValueError("the router's index sizes must be >= 1, max_load_gap and load_gap_fraction >= 0")
        if not 0 <= self.min_hit_fraction <= 1:
            raise ValueError(f"min_hit_fraction must be in [0, 1], got {self.min_hit_fraction}")


@dataclass(frozen=True)
class RouteKeys:
    """What a request would find cached: its media items and its prompt's full blocks, in order."""

    media: tuple[tuple[str, int], ...] = ()  # (content key, embedding rows) per item
    block_hashes: tuple[bytes, ...] = ()
    block_size: int = 16
    num_tokens: int = 0  # the prompt's


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    reason: str  # cache_hit, no_hit, balance (the best-scoring replica was too loaded), round_robin, least_loaded
    expected_media_hits: int  # items the chosen replica is expected to hold
    expected_prefix_tokens: int  # prompt tokens it is expected to hold


class _LRU:
    """A bounded set that forgets its least recently touched keys first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()


@dataclass
class _Replica:
    media: _LRU
    blocks: _LRU
    alive: bool = True
    in_flight: int = 0


@dataclass
class RouterStats:
    routed: dict[tuple[str, str], int] = field(default_factory=dict)  # (policy, reason) -> requests
    expected_media_hits: int = 0
    expected_prefix_tokens: int = 0


class Router:
    def __init__(self, num_replicas: int, config: RouterConfig | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        self.config = config or RouterConfig()
        self._replicas = [_Replica(_LRU(self.config.max_media_keys), _LRU(self.config.max_blocks))
                          for _ in range(num_replicas)]
        self._next = 0  # round robin's cursor, also the tie-break's starting point
        self.stats = RouterStats()

    def in_flight(self, replica: int) -> int:
        return self._replicas[replica].in_flight

    # ---- the decision -----------------------------------------------------------------------------
    def choose(self, keys: RouteKeys) -> RouteDecision | None:
        """The replica for a request, or None when no replica is alive. Does not dispatch: call
        `dispatched` once the request is sent."""
        live = [i for i, r in enumerate(self._replicas) if r.alive]
        if not live:
            return None
        policy = self.config.policy
        if policy == "round_robin":
            return self._decide(self._rotate(live), "round_robin", keys)
        least = min(self._replicas[i].in_flight for i in live)
        if policy == "least_loaded":
            return self._decide(self._rotate([i for i in live if self._replicas[i].in_flight == least]),
                                "least_loaded", keys)
        scores = {i: self._expected(i, keys) for i in live}
        # a hit counts only where it saves a good part of the request's work: a template's first block is
        # in every replica's cache and must not pull every new image to one of them
        needed = self.config.min_hit_fraction * (keys.num_tokens + sum(rows for _, rows in keys.media))
        worth = {i: _value(scores[i]) if _value(scores[i]) >= max(needed, 1) else 0 for i in live}
        gap = max(self.config.max_load_gap, int(self.config.load_gap_fraction * least))
        candidates = [i for i in live if self._replicas[i].in_flight <= least + gap]
        top = max(worth[i] for i in candidates)
        # among the best-scoring candidates, the least loaded; then the rotation decides
        tied = [i for i in candidates if worth[i] == top]
        fewest = min(self._replicas[i].in_flight for i in tied)
        chosen = self._rotate([i for i in tied if self._replicas[i].in_flight == fewest])
        if top > 0:
            reason = "cache_hit"
        elif any(worth[i] > 0 for i in live):
            reason = "balance"  # a replica holds it, but it is too busy
        else:
            reason = "no_hit"
        return self._decide(chosen, reason, keys, scores[chosen])

    def _expected(self, replica: int, keys: RouteKeys) -> tuple[int, int, int]:
        """(media items, their embedding rows, prefix tokens) `replica` is expected to hold."""
        r = self._replicas[replica]
        hit_items = [rows for key, rows in keys.media if key in r.media]
        prefix_blocks = 0
        for h in keys.block_hashes:
            if h not in r.blocks:
                break
            prefix_blocks += 1
        return len(hit_items), sum(hit_items), prefix_blocks * keys.block_size

    def _rotate(self, choices: list[int]) -> int:
        """The first of `choices` at or after the cursor (wrapping); `dispatched` moves the cursor."""
        n = len(self._replicas)
        return min(choices, key=lambda i: (i - self._next) % n)

    def _decide(self, replica: int, reason: str, keys: RouteKeys,
                score: tuple[int, int, int] | None = None) -> RouteDecision:
        items, _, prefix_tokens = score if score is not None else self._expected(replica, keys)
        return RouteDecision(replica, reason, items, prefix_tokens)

    # ---- what happened ----------------------------------------------------------------------------
    def dispatched(self, decision: RouteDecision, keys: RouteKeys) -> None:
        """The request went to `decision.replica`: it will hold the request's media and blocks."""
        r = self._replicas[decision.replica]
        r.in_flight += 1
        self._next = (decision.replica + 1) % len(self._replicas)
        r.media.touch(key for key, _ in keys.media)
        r.blocks.touch(keys.block_hashes)
        route = (self.config.policy, decision.reason)
        self.stats.routed[route] = self.stats.routed.get(route, 0) + 1
        self.stats.expected_media_hits += decision.expected_media_hits
        self.stats.expected_prefix_tokens += decision.expected_prefix_tokens

    def finished(self, replica: int) -> None:
        r = self._replicas[replica]
        r.in_flight = max(0, r.in_flight - 1)

    def evicted(self, replica: int, media_keys: Iterable[str] = (), block_hashes: Iterable[bytes] = ()) -> None:
        """What `replica` reported evicting: forget it there."""
        r = self._replicas[replica]
        r.media.discard(media_keys)
        r.blocks.discard(block_hashes)

    def set_alive(self, replica: int, alive: bool) -> None:
        """A replica that died (or came back) holds nothing: its index starts empty."""
        r = self._replicas[replica]
        if r.alive != alive:
            r.media.clear()
            r.blocks.clear()
            r.in_flight = 0
        r.alive = alive


def _value(score: tuple[int, int, int]) -> int:
    """Roughly the prompt work a replica would skip: its held items' embedding rows (encoder work) plus
    its cached prefix tokens (prefill); where a cached prefix covers an item both count, which only
    strengthens a replica that holds both."""
    _, rows, prefix_tokens = score
    return rows + prefix_tokens
