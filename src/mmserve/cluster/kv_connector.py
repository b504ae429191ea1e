"""KV transfer between replicas: one interface, a shared-memory and a Ray object-store connector.

Role: a prefill replica's `Engine.send_kv` hands `send` the byte shapes of one block in each stored
tensor (keys, values, and their scales when the KV is quantized: codes and scales move as stored) and
a `fill` that copies the request's blocks into the views it is given; `send` returns a `KVTransfer`, a
small picklable handle the server passes to the decode replica, whose `receive` maps the bytes back
as views for `Engine.receive_kv` to copy into its own storage. `discard` drops a transfer nobody will
receive (a failure on either side). Copies: one from the prefill side's storage into the segment or
object, one from there into the decode side's storage; no tensor is pickled.

- `SharedMemoryConnector` (the `mp` backend: replicas on one host): a POSIX shared-memory segment per
  transfer, created by the sender, unlinked by the receiver (or by `discard`).
- `RayConnector` (the `ray` backend): the bytes as one object in Ray's object store, put by the sender;
  on the receiver's node `ray.get` maps it without a copy where the object is local.

A GPU cluster would add a connector here that registers both sides' KV storage with NIXL or UCX and
moves blocks device to device: `send` would post the read, `KVTransfer.location` would carry the memory
descriptors, `receive` would wait for completion. The scheduler and the engine would not change.
What it does not know: requests beyond their id, scheduling, which blocks are needed.
"""

from __future__ import annotations

import math
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Protocol

import torch

Fill = Callable[[list[torch.Tensor]], None]


@dataclass(frozen=True)
class KVTransfer:
    """What travels from the prefill replica to the decode replica: where the bytes are and their shape."""

    request_id: str
    num_blocks: int
    part_shapes: tuple[tuple[int, ...], ...]  # one block of each stored tensor, in bytes, layers first
    location: Any  # the connector's: a segment name, a list holding a Ray object ref; None when no block moves
    nbytes: int


class KVConnector(Protocol):
    name: str

    def send(self, request_id: str, part_shapes: list[tuple[int, ...]], num_blocks: int, fill: Fill) -> KVTransfer: ...

    def receive(self, transfer: KVTransfer, use: Callable[[list[torch.Tensor]], Any]) -> Any: ...

    def discard(self, transfer: KVTransfer) -> None: ...


def _sizes(part_shapes: tuple[tuple[int, ...], ...] | list[tuple[int, ...]], num_blocks: int) -> list[int]:
    return [math.prod(shape) * num_blocks for shape in part_shapes]


def _views(base: torch.Tensor, part_shapes: tuple[tuple[int, ...], ...] | list[tuple[int, ...]],
           num_blocks: int) -> list[torch.Tensor]:
    """(num_layers, num_blocks, ...) byte views of each part, back to back in `base`."""
    views, offset = [], 0
    for shape, size in zip(part_shapes, _sizes(part_shapes, num_blocks)):
        views.append(base[offset:offset + size].view(shape[0], num_blocks, *shape[1:]))
        offset += size
    return views


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """The sender's segment lives as long as its transfer, not as long as the sender: without this, the
    resource tracker would unlink it (with a warning) when the sender exits. A process that attaches is
    registered again, and its `unlink` unregisters it."""
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]


class SharedMemoryConnector:
    name = "shm"

    def send(self, request_id: str, part_shapes: list[tuple[int, ...]], num_blocks: int, fill: Fill) -> KVTransfer:
        shapes = tuple(tuple(s) for s in part_shapes)
        nbytes = sum(_sizes(shapes, num_blocks))
        if num_blocks == 0:
            return KVTransfer(request_id, 0, shapes, None, 0)
        segment = shared_memory.SharedMemory(create=True, size=nbytes, name=f"mmserve-kv-{uuid.uuid4().hex[:16]}")
        try:
            base = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
            fill(_views(base, shapes, num_blocks))
            del base
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        _untrack(segment)
        segment.close()
        return KVTransfer(request_id, num_blocks, shapes, segment.name, nbytes)

    def receive(self, transfer: KVTransfer, use: Callable[[list[torch.Tensor]], Any]) -> Any:
        """`use(views)` while the segment is mapped; the segment is gone afterwards."""
        if transfer.location is None:
            return use([torch.empty((s[0], 0, *s[1:]), dtype=torch.uint8) for s in transfer.part_shapes])
        segment = shared_memory.SharedMemory(name=transfer.location)
        try:
            base = torch.frombuffer(segment.buf, dtype=torch.uint8, count=transfer.nbytes)
            views = _views(base, transfer.part_shapes, transfer.num_blocks)
            result = use(views)
            del base, views
            return result
        finally:
            segment.close()
            segment.unlink()

    def discard(self, transfer: KVTransfer) -> None:
        if transfer.location is None:
            return
        try:
            segment = shared_memory.SharedMemory(name=transfer.location)
        except FileNotFoundError:  # received already, or discarded
            return
        segment.close()
        segment.unlink()


class RayConnector:
    name = "ray"

    def __init__(self) -> None:
        import ray

        self._ray = ray

    def send(self, request_id: str, part_shapes: list[tuple[int, ...]], num_blocks: int, fill: Fill) -> KVTransfer:
        import numpy as np

        shapes = tuple(tuple(s) for s in part_shapes)
        nbytes = sum(_sizes(shapes, num_blocks))
        if num_blocks == 0:
            return KVTransfer(request_id, 0, shapes, None, 0)
        buffer = np.empty(nbytes, dtype=np.uint8)
        fill(_views(torch.from_numpy(buffer), shapes, num_blocks))
        # in a list: a bare ref inside a message would be resolved by Ray where the message is read
        return KVTransfer(request_id, num_blocks, shapes, [self._ray.put(buffer)], nbytes)

    def receive(self, transfer: KVTransfer, use: Callable[[list[torch.Tensor]], Any]) -> Any:
        if transfer.location is None:
            return use([torch.empty((s[0], 0, *s[1:]), dtype=torch.uint8) for s in transfer.part_shapes])
        buffer = self._ray.get(transfer.location[0])
        with warnings.catch_warnings():  # a read-only mapping of the object: only read from
            warnings.simplefilter("ignore", UserWarning)
            base = torch.from_numpy(buffer)
        return use(_views(base, transfer.part_shapes, transfer.num_blocks))

    def discard(self, transfer: KVTransfer) -> None:
        pass  # the object goes when the last reference to it does
