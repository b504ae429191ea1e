"""mmserve's float32 CPU attention over the paged KV cache, a query at a time: `kernels/paged_attention.cpp`.

Role: load the kernel (built and cached like the matmul kernel, by `native.cached_library`) and run
it as the operator `mmserve::paged_attention`: each query (a decode, or a token of a prefill chunk)
attends over its sequence's keys where they lie in the cache, through its block table. The paged
backend otherwise gathers every decode's blocks into a padded copy and runs SDPA with a key mask, and
attends each prefill chunk with its own SDPA call (its cached context gathered, its mask built); at
decode batch sizes the copies and the per-call work cost more than the arithmetic.

The values differ from SDPA's in the last bits (another exp, another order of summation) and do not
depend on which sequences share a step.

What it does not know: requests, scheduling, models, bidirectional spans, quantized or half-precision
caches (`attention_plan` decides which tokens it gets: none of a prompt with spans, float32 caches on
the CPU only; `available()` says whether this machine can run it).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mmserve.runner.cpu.native import KERNELS_DIR, cached_library

SOURCE = KERNELS_DIR / "paged_attention.cpp"
HEAD_DIM_MULTIPLE = 8  # the kernel reads a head in 8-float registers


class AttentionKernel:
    """The loaded library; `attend` checks what the kernel's pointers assume."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.mm_paged_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr,
                                           ctypes.c_float, i64, ptr, ctypes.c_int]
        lib.mm_paged_attention.restype = None
        self.path = path
        self._lib = lib

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
               rows: torch.Tensor | None, positions: torch.Tensor, scale: float, window: int) -> torch.Tensor:
        n, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = key.shape
        if not supports(q, key) or value.shape != key.shape or value.dtype != key.dtype or not value.is_contiguous():
            raise ValueError(f"paged_attention: q {tuple(q.shape)} {q.dtype}, key {tuple(key.shape)} {key.dtype}, "
                             f"value {tuple(value.shape)} {value.dtype}: float32, contiguous caches of one shape, "
                             f"whole kv groups and a head size that is a multiple of {HEAD_DIM_MULTIPLE} expected")
        if any(t is not None and t.dtype != torch.int64 for t in (block_table, rows, positions)):
            raise ValueError("paged_attention: block table, rows and positions must be int64")
        q, table, positions = q.contiguous(), block_table.contiguous(), positions.contiguous()
        rows = None if rows is None else rows.contiguous()
        out = torch.empty(n, heads * head_dim, dtype=torch.float32)
        if n:
            self._lib.mm_paged_attention(
                q.data_ptr(), n, heads, kv_heads, head_dim, key.data_ptr(), value.data_ptr(), block_size,
                table.data_ptr(), table.shape[1], None if rows is None else rows.data_ptr(), positions.data_ptr(),
                scale, window, out.data_ptr(), torch.get_num_threads())
        return out


kernel = cached_library(SOURCE, "attention over the paged cache stays on SDPA", AttentionKernel)


def available() -> bool:
    return kernel() is not None


def supports(q: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel can attend these (where it is `available()`): float32 on the CPU, contiguous
    cache layers, whole kv groups, a head size it reads in registers."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and key.dtype == torch.float32
            and key.is_contiguous() and q.shape[-1] % HEAD_DIM_MULTIPLE == 0 and q.shape[1] % key.shape[2] == 0)


def _attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
            rows: torch.Tensor | None, positions: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    lib = kernel()
    assert lib is not None, "mmserve::paged_attention runs only where the kernel was built"
    return lib.attend(q, key, value, block_table, rows, positions, scale, window)


def _attend_fake(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
                 rows: torch.Tensor | None, positions: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# An operator, so a compiled decode step calls it as one opaque node (defined on a `torch.library.Library`
# for the same reason as `mmserve::panel_linear`: less per-call work than `custom_op`'s wrapper).
_LIBRARY = torch.library.Library("mmserve", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor key, Tensor value, Tensor block_table, Tensor? rows, "
                "Tensor positions, float scale, int window) -> Tensor")
_LIBRARY.impl("paged_attention", _attend, "CPU")
torch.library.register_fake("mmserve::paged_attention", _attend_fake, lib=_LIBRARY)


def paged_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
                    positions: torch.Tensor, scale: float, window: int | None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """n queries, each over its sequence's keys up to its own position: q (n, heads, head_dim); key/value
    one layer's (blocks, block_size, kv_heads, head_dim) cache; block_table (sequences, width) int64;
    rows (n,) int64, the table row of each query (None: query i uses row i); positions (n,) int64, each
    query's position (it sees keys at positions <= it, and with a window w only those > position - w).
    Returns (n, heads * head_dim)."""
    return torch.ops.mmserve.paged_attention(q, key, value, block_table, rows, positions, scale, window or 0)
