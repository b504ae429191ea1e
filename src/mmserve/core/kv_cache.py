"""Paged KV-cache bookkeeping with prefix caching (pure Python, no tensors).

Role: hand out fixed-size blocks of KV slots to requests, reuse full blocks across requests by
content, and evict cached blocks LRU only when free blocks run out.

- `FreeBlockQueue` is an intrusive doubly linked list: a cached block that gets a prefix hit
  must leave the free list from the middle in O(1), which a deque cannot do.
- A full block's hash chains its parent block's hash, its token ids and its extra keys: for every
  media item overlapping the block, the item's content hash and the block's start relative to the
  item's first token. Two prompts with the same placeholder ids but different images therefore
  never share KV (docs/architecture.md §4, invariant 7).

What it does not know: tensors, devices, scheduling policy.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import blake3

from mmserve.core.request import ItemSpec, Request

_ROOT_HASH = b"\x00" * 32
EVICTIONS_KEPT = 4096  # evicted keys a cache manager remembers for take_evicted() (the router's view is approximate)


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None


class FreeBlockQueue:
    """Free blocks, least recently freed first; O(1) popleft, append and remove."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self.head, self.tail = KVBlock(-1), KVBlock(-1)  # sentinels
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[tuple[str, int]]) -> bytes:
    h = blake3.blake3(parent or _ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for content_hash, offset in extra_keys:
        h.update(content_hash.encode())
        h.update(struct.pack("<q", offset))
    return h.digest()


def salted_root(salt: str | None) -> bytes | None:
    """The parent hash of a request's first block: none, or its cache salt's (vLLM's cache_salt)."""
    return None if salt is None else blake3.blake3(b"cache_salt\0" + salt.encode()).digest()


def block_extra_keys(items: Sequence[ItemSpec], start: int, end: int) -> list[tuple[str, int]]:
    """(content hash, block start - item start) for every item tokens [start, end) depend on: those
    overlapping them, and every cross-attention item (all of a request's tokens attend to it)."""
    return [(it.content_hash, start - it.offset) for it in items if it.reaches(start, end)]


@dataclass
class KVCacheStats:
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hit_tokens: int = 0
    evictions: int = 0  # cached blocks reused for new content


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.on_evict: Callable[[bytes], None] | None = None  # told each evicted block's hash (state snapshots)
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.stats = KVCacheStats()
        # hashes of cached blocks evicted since the last take_evicted() (a router forgets them); bounded
        self._evicted: deque[bytes] = deque(maxlen=EVICTIONS_KEPT)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def take_evicted(self) -> tuple[bytes, ...]:
        """Hashes of cached blocks evicted since the last call (at most the latest EVICTIONS_KEPT)."""
        evicted = tuple(self._evicted)
        self._evicted.clear()
        return evicted

    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            start = i * bs
            parent = hashes[-1] if hashes else salted_root(request.cache_salt)
            hashes.append(hash_block(parent, tokens[start:start + bs],
                                     block_extra_keys(request.items, start, start + bs)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix lookup that admitted its request (a lookup retried while the request waits for
        room would count its hit again and again)."""
        self.stats.prefix_cache_queries += num_tokens
        self.stats.prefix_cache_hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = (),
                       first_query: int | None = None) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones; None if they don't fit.

        On success returns the ids of blocks appended to the request (prefix hits first). `first_query`: the
        position the request's next computation starts at, where it is not its computed tokens (a hand-off's
        receiver: its prompt's end); only a pool that keeps a window (core/window_kv.py) reads it."""
        needed, reclaimed = self._blocks_needed(request, num_new_tokens, computed_blocks)
        if needed > self.num_free_blocks - reclaimed:
            return None
        return self._take(request, needed, computed_blocks)

    def _blocks_needed(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[KVBlock]) -> tuple[int, int]:
        """(blocks to take off the free queue, of which prefix hits sitting in it) for the allocation."""
        owned = self.req_blocks.get(request.request_id, [])
        total_tokens = request.num_computed_tokens + num_new_tokens
        if computed_blocks:  # a fresh admission: the hits are the first blocks
            total_tokens = len(computed_blocks) * self.block_size + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(owned) - len(computed_blocks)
        # hits sitting in the free queue stop being free once touched
        return max(needed, 0), sum(1 for b in computed_blocks if b.ref_cnt == 0)

    def _take(self, request: Request, needed: int, computed_blocks: Sequence[KVBlock]) -> list[int]:
        owned = self.req_blocks.get(request.request_id, [])
        for block in computed_blocks:
            self._touch(block)
        new_blocks = list(computed_blocks) + [self._pop_free() for _ in range(needed)]
        self.req_blocks.setdefault(request.request_id, owned).extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def _touch(self, block: KVBlock) -> None:
        """One more owner of a (cached) block: off the free queue if it sat there."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def _release(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue.append(block)

    def _pop_free(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # evict its cached content
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self._evicted.append(block.block_hash)
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = None
            self.stats.evictions += 1
        block.ref_cnt = 1
        return block

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's computed full blocks for reuse."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        owned = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(owned), len(request.block_hashes))
        for i in range(num_full):
            block = owned[i]
            if block.block_hash is None:
                block_hash = request.block_hashes[i]
                block.block_hash = block_hash
                self.cached.setdefault(block_hash, block)

    def free(self, request: Request) -> None:
        """Release a request's blocks; tail blocks first so they are evicted before shared prefixes."""
        for block in reversed(self.req_blocks.pop(request.request_id, [])):
            self._release(block)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def window_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's sliding-window table from logical block `start` on: none here (one pool serves every
        layer); core/window_kv.py's manager keeps one."""
        return []

    def last_window_block_ids(self, request_id: str, num: int) -> tuple[int, ...]:
        """The window table's entries for the request's last `num` blocks (those just allocated)."""
        return tuple(self.window_block_ids(request_id, len(self.req_blocks.get(request_id, ())) - num)) if num else ()

    @property
    def num_window_blocks(self) -> int:
        """A window pool's blocks (core/window_kv.py); none here."""
        return 0

    @property
    def num_free_window_blocks(self) -> int:
        return 0

    def is_idle(self) -> bool:
        """No request holds a block."""
        return self.num_free_blocks == self.num_blocks

    def check_integrity(self) -> None:
        """Reference counts equal ownership; free blocks are exactly those nobody owns."""
        self._check_pool(self.req_blocks.values())

    def _check_pool(self, owned: Iterable[Iterable[KVBlock]]) -> None:
        owners: dict[int, int] = {}
        for blocks in owned:
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == self.free_queue.num_free, "free list length and counter disagree"
        assert len(set(free_ids)) == len(free_ids), "a block is on the free list twice"
        for b in self.blocks:
            assert b.ref_cnt == owners.get(b.block_id, 0), f"block {b.block_id} ref_cnt {b.ref_cnt} != owners"
        assert set(free_ids) == {b.block_id for b in self.blocks if b.ref_cnt == 0}, "free list != unowned blocks"
        for h, b in self.cached.items():
            assert b.block_hash == h, f"cached block {b.block_id} hash mismatch"
