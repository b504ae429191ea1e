"""KV blocks of a model whose sliding-window layers keep only their window (Gemma 4's, Gemma 3's).

Role: two pools of blocks under one manager. The full pool (the `KVCacheManager` this class extends) holds
every block of a request for the layers that attend to the whole context. The window pool holds, for the
sliding layers, only the blocks the request's next queries can still see: a query at position q sees keys
after q - window, so the blocks before the one holding q - window + 1 go back to the pool at the request's
next allocation (freed as the window moves; a published block stays in the prefix cache until evicted).

A request's window table is aligned with its full table: entry i is logical block i in both, so the runner
indexes both by position. Entries the window has left (or that a prefix hit never brought) are
`null_block_id`: the block after the pool's last, which the storage keeps, no request owns, and reads of it
are masked (a padding row may write there). The runner keeps the ids it was told; an entry the window left
is never written again and lies outside every later query's window.

Both pools publish a computed full block under the same hash. A prefix hit of n blocks needs the full pool's
n blocks and the window pool's blocks of the window before the hit's end (the first query's window): the
hit is the longest prefix for which both are cached, so prefix caching stays exact across windows.

What it does not know: tensors, layers, which layer lives in which pool, the storage's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mmserve.core.kv_cache import KVBlock, KVCacheManager
from mmserve.core.request import Request


@dataclass
class WindowTable:
    """A request's window-pool blocks by logical block; entries before `start` are None (left behind)."""

    blocks: list[KVBlock | None] = field(default_factory=list)
    start: int = 0


class WindowedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, num_window_blocks: int, window_tokens: int,
                 enable_prefix_caching: bool = True) -> None:
        """`num_window_blocks`: the window pool's; `window_tokens`: the widest sliding window (a layer with a
        narrower one masks the rest)."""
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if window_tokens <= 0:
            raise ValueError(f"need a positive window, got {window_tokens}")
        self.window_tokens = window_tokens
        self.window = KVCacheManager(num_window_blocks, block_size, enable_prefix_caching)
        self.window_tables: dict[str, WindowTable] = {}

    @property
    def null_block_id(self) -> int:
        """The window storage's block past the pool's: what a table holds where the window has no block."""
        return self.window.num_blocks

    @property
    def num_window_blocks(self) -> int:
        return self.window.num_blocks

    @property
    def num_free_window_blocks(self) -> int:
        return self.window.num_free_blocks

    def window_start(self, first_query: int) -> int:
        """The first logical block a query at `first_query` (and every later one) still sees."""
        return max(0, first_query - self.window_tokens + 1) // self.block_size

    def max_window_blocks(self, num_new_tokens: int) -> int:
        """The most window blocks a request holds computing `num_new_tokens` in one step."""
        return -(-(self.window_tokens - 1 + num_new_tokens) // self.block_size) + 1

    # ---- prefix hits ------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The full pool's longest cached prefix, cut to the longest whose window the window pool holds."""
        hits, _ = super().get_computed_blocks(request)
        usable, run = 0, 0
        for n in range(1, len(hits) + 1):  # run: the cached window blocks ending at block n - 1
            run = run + 1 if request.block_hashes[n - 1] in self.window.cached else 0
            if run >= n - self.window_start(n * self.block_size):
                usable = n
        return hits[:usable], usable * self.block_size

    # ---- allocation -------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = (),
                       first_query: int | None = None) -> list[int] | None:
        """Both pools' blocks for the next `num_new_tokens`, or neither (None: they do not fit). The window
        pool's blocks the window has left are returned first, whatever the outcome: no later query of the
        request reads them."""
        bs, rid = self.block_size, request.request_id
        start = len(computed_blocks) * bs if computed_blocks else request.num_computed_tokens
        lo = self.window_start(start if first_query is None else first_query)
        table = self.window_tables.get(rid) or WindowTable()
        self._leave_window(table, lo)
        hits = [self.window.cached[h] for h in request.block_hashes[max(lo, len(table.blocks)):len(computed_blocks)]]
        first_new = max(lo, len(table.blocks), len(computed_blocks))
        window_needed = max(0, -(-(start + num_new_tokens) // bs) - first_new)
        needed, reclaimed = self._blocks_needed(request, num_new_tokens, computed_blocks)
        if (needed > self.num_free_blocks - reclaimed
                or window_needed > self.window.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)):
            return None
        ids = self._take(request, needed, computed_blocks)
        for block in hits:
            self.window._touch(block)
        table.blocks.extend([None] * (max(lo, len(table.blocks)) - len(table.blocks)))
        table.blocks.extend(hits)
        table.blocks.extend([None] * (first_new - len(table.blocks)))
        table.blocks.extend(self.window._pop_free() for _ in range(window_needed))
        self.window_tables[rid] = table
        return ids

    def _leave_window(self, table: WindowTable, lo: int) -> None:
        for i in range(table.start, min(lo, len(table.blocks))):
            if (block := table.blocks[i]) is not None:
                self.window._release(block)
                table.blocks[i] = None
        table.start = max(table.start, min(lo, len(table.blocks)))

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the computed full blocks of both pools (the window's still held)."""
        super().cache_full_blocks(request)
        table = self.window_tables.get(request.request_id)
        if not self.enable_prefix_caching or table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table.blocks), len(request.block_hashes))
        for i in range(table.start, num_full):
            block = table.blocks[i]
            if block is not None and block.block_hash is None:
                block.block_hash = request.block_hashes[i]
                self.window.cached.setdefault(block.block_hash, block)

    def free(self, request: Request) -> None:
        super().free(request)
        table = self.window_tables.pop(request.request_id, None)
        for block in reversed(table.blocks if table is not None else []):
            if block is not None:
                self.window._release(block)

    # ---- views --------------------------------------------------------------------------------------
    def window_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        table = self.window_tables.get(request_id)
        null = self.null_block_id
        return [] if table is None else [null if b is None else b.block_id for b in table.blocks[start:]]

    def num_window_blocks_held(self, request_id: str) -> int:
        table = self.window_tables.get(request_id)
        return 0 if table is None else sum(1 for b in table.blocks[table.start:] if b is not None)

    def is_idle(self) -> bool:
        return super().is_idle() and self.window.is_idle()

    def check_integrity(self) -> None:
        """Both pools' books; every request holds blocks in both or in neither; nothing before a table's
        start is held."""
        super().check_integrity()
        self.window._check_pool([b for b in t.blocks if b is not None] for t in self.window_tables.values())
        assert set(self.window_tables) <= set(self.req_blocks), "window blocks held by a request without KV"
        for rid, table in self.window_tables.items():
            assert all(b is None for b in table.blocks[:table.start]), f"{rid} holds blocks its window left"
            assert len(table.blocks) <= len(self.req_blocks[rid]), f"{rid}'s window table outgrew its blocks"
