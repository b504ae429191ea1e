"""Captured graphs and their static buffers, with a CPU stand-in so the bookkeeping is testable.

Role: the mechanics every graph runner shares.
- `StaticBuffers`: named device tensors a graph reads. A CUDA graph replays on the addresses it was
  captured with, so inputs are copied *into* these buffers (from pinned memory, non_blocking), never
  rebound; `record()` notes every `data_ptr` at capture and `assert_unmoved()` checks them before
  each replay (a moved pointer would replay on stale memory).
- `capture_graph(fn, device)`: on CUDA a `torch.cuda.CUDAGraph` of `fn` (after warm-up runs on a side
  stream, in a memory pool shared by the runner's graphs); on the CPU a `ReplayEquivalent` that runs
  `fn` again on the same buffers at every replay and writes the result into the same output tensor —
  the same contract (static inputs in, static output overwritten), so padding, slicing and
  copy-out are tested on the CPU against the eager model.
- `CompiledStep`: the CPU's compiled counterpart, same replay-then-read-output contract, a fresh output.
- `GraphMemoryMeter`: device memory taken by captures (CUDA: reserved bytes; the CPU: not measured).

What it does not know: buckets, models, what the buffers mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

GraphFn = Callable[[], torch.Tensor]
NUM_WARMUP_RUNS = 2  # lazy inits (cuBLAS workspaces, kernel autotuning) must not happen inside a capture


class StaticBuffers:
    """Named static tensors on the device; the only memory a captured graph reads."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self._pointers: dict[str, int] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def record(self) -> None:
        """Note every buffer's address: the ones the graph is captured with."""
        self._pointers = {name: t.data_ptr() for name, t in self.tensors.items()}

    def assert_unmoved(self) -> None:
        if self._pointers is None:
            raise RuntimeError("static buffers checked before capture: record() them when capturing")
        for name, t in self.tensors.items():
            if t.data_ptr() != self._pointers[name]:
                raise RuntimeError(f"static buffer {name!r} moved from {self._pointers[name]:#x} to "
                                   f"{t.data_ptr():#x} after capture: a replay would read stale memory")

    def load(self, name: str, host: torch.Tensor) -> None:
        """Copy a CPU tensor into the leading rows of buffer `name`, in place (rows past it keep what they
        held: padding the graph tolerates). From pinned memory with non_blocking on CUDA."""
        buffer = self.tensors[name]
        if host.shape[0] > buffer.shape[0] or tuple(host.shape[1:]) != tuple(buffer.shape[1:]):
            raise ValueError(f"static buffer {name!r} is {tuple(buffer.shape)}; cannot hold {tuple(host.shape)}")
        if buffer.device.type == "cuda":
            host = host.pin_memory()
        buffer[:host.shape[0]].copy_(host, non_blocking=True)


class CapturedGraph(Protocol):
    output: torch.Tensor  # static: overwritten by every replay

    def replay(self) -> None: ...


class ReplayEquivalent:
    """The CPU stand-in for a CUDA graph: `replay()` runs the captured callable again on the same static
    buffers and overwrites the same output tensor, as a graph replay does."""

    def __init__(self, fn: GraphFn) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output.copy_(self.fn())


class CompiledStep:
    """The CPU's compiled step over static buffers (runner/cpu/compile.py): `replay()` runs it and binds
    `output` to the fresh result. Unlike a graph's, the output is not a static tensor: nothing reads it
    at a fixed address, so it is neither copied into one nor copied out again."""

    def __init__(self, fn: GraphFn) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output = self.fn()


class CudaGraph:
    """`fn` captured once as a CUDA graph; `replay()` relaunches its kernels on the captured addresses."""

    def __init__(self, fn: GraphFn, device: torch.device, pool: object | None) -> None:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


def new_graph_pool(device: torch.device) -> object | None:
    """One memory pool for a runner's graphs (they never replay concurrently); None on the CPU."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


def capture_graph(fn: GraphFn, device: torch.device, pool: object | None = None) -> CapturedGraph:
    if device.type == "cuda":
        return CudaGraph(fn, device, pool)
    return ReplayEquivalent(fn)


class GraphMemoryMeter:
    """Device bytes taken since construction (CUDA: reserved by the caching allocator, graph pools
    included). Not measured on the CPU: 0, so a memory budget never stops CPU captures."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start_bytes = self._reserved()

    def _reserved(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device)

    def used_bytes(self) -> int:
        return self._reserved() - self.start_bytes
