"""One `process`-backend encoder worker, and the messages it shares with its pool.

Role: `worker_main` is the body of a worker process (the pool starts it with the spawn start
method, so this module is what the child imports). It builds the family's encoder once with
`build_encoder`, says it is ready, then loops: wait for a job, take whatever else is already
queued (up to `MAX_BATCH_ITEMS`), encode those as one batch, and send back one message per item:
its output tensor or why it failed. A batch that raises fails each of its items; it does not
end the worker.

Also here, the wire format both sides use: the message dataclasses, and `to_shared` /
`from_shared`, which swap the numpy arrays inside a payload for shared-memory tensors and back,
so pixels cross the process boundary as a shared-memory handle rather than a pickled copy, and
the family code in the worker sees the payload type it made. torch.multiprocessing queues move
any tensor they carry to shared memory; outputs are put there by the worker itself, one segment
per item, so an arriving output owns exactly its own bytes.

Every result message stays far below PIPE_BUF (4096 bytes): tensors travel as handles and error
texts are cut short, so a worker killed mid-send never leaves half a message in its result pipe.
A job message the worker cannot read (its shared memory could not be fetched) ends the worker:
the pool then gives its items to another worker, where an item that is silently dropped would
wait forever.

What it does not know: other workers, redispatch and restarts (the pool's), requests, what a
payload means (it walks dataclasses, tuples, lists and dicts only to find numpy arrays).
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  registers the reductions that send tensors as shared memory

from mmserve.runner.encoder.runner import EncodeFn
from mmserve.workers.spec import WorkerSpec, build_encoder

MAX_BATCH_ITEMS = 4  # small batches: outputs come back in pieces, and a failing batch takes few items
PARENT_CHECK_S = 1.0  # how often an idle worker checks that its pool's process still exists
MAX_ERROR_CHARS = 1000  # keeps every message one atomic pipe write (see the module docstring)


# ---- messages -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedArray:
    """A numpy array's data in a shared-memory tensor of the same shape and dtype."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class JobMessage:
    key: str
    payload: Any  # the family's payload with its arrays as SharedArray


@dataclass(frozen=True)
class StopMessage:
    """Wakes a worker blocked on its queue at shutdown (the stop flag says the rest)."""


@dataclass(frozen=True)
class ReadyMessage:
    generation: int


@dataclass(frozen=True)
class StartFailed:
    error: str


@dataclass(frozen=True)
class ItemDone:
    key: str
    output: torch.Tensor  # (streams, rows, width), in shared memory


@dataclass(frozen=True)
class ItemFailed:
    key: str
    error: str


# ---- payloads in shared memory ------------------------------------------------------------------
def _map_leaves(obj: Any, convert: Callable[[Any], Any]) -> Any:
    """`obj` with `convert` applied to every leaf inside dataclasses, tuples, lists and dicts; an
    unchanged object is returned as itself (no needless copies of frozen payloads)."""
    new = convert(obj)
    if new is not obj:
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if f.init:  # replace() cannot set the others; they travel as they are
                value = getattr(obj, f.name)
                mapped = _map_leaves(value, convert)
                if mapped is not value:
                    changes[f.name] = mapped
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, (tuple, list)):
        items = [_map_leaves(v, convert) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, dict):
        mapped = {k: _map_leaves(v, convert) for k, v in obj.items()}
        return obj if all(mapped[k] is v for k, v in obj.items()) else type(obj)(mapped)
    return obj


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor allocated straight in shared memory (`share_memory_()` on a
    new tensor would fault in private pages, then copy them into a new segment: twice the work)."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _share_array(obj: Any) -> Any:
    if type(obj) is not np.ndarray:  # subclasses (masked arrays, ...) keep their pickled form
        return obj
    try:
        dtype = torch.from_numpy(np.empty(0, dtype=obj.dtype)).dtype
    except (TypeError, ValueError):  # object, string or byte-swapped arrays: torch has no such tensor
        return obj
    shared = shared_empty(obj.shape, dtype)
    shared.numpy()[...] = obj  # the one copy: into shared memory
    return SharedArray(shared)


def _unshare_array(obj: Any) -> Any:
    if not isinstance(obj, SharedArray):
        return obj
    array = obj.tensor.numpy()
    # the pool still holds these bytes and resends them if this worker dies: never write to them
    array.flags.writeable = False
    return array


def to_shared(payload: Any) -> Any:
    """The payload with every numpy array inside it moved into a shared-memory tensor."""
    return _map_leaves(payload, _share_array)


def from_shared(payload: Any) -> Any:
    """The payload as the family made it: numpy arrays (read-only views of the shared memory)."""
    return _map_leaves(payload, _unshare_array)


def in_shared_memory(output: torch.Tensor) -> torch.Tensor:
    """`output` in a shared-memory segment of exactly its size: a view of a batch's output would
    otherwise carry (and pin) the whole batch's storage into the pool."""
    if output.is_shared() and output.untyped_storage().nbytes() == output.numel() * output.element_size():
        return output
    shared = shared_empty(tuple(output.shape), output.dtype)
    shared.copy_(output)
    return shared


def bounded_text(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


# ---- the worker ---------------------------------------------------------------------------------
def worker_main(spec: WorkerSpec, generation: int, parent_pid: int, stop: Any, jobs: Any,
                results: Any) -> None:
    """A worker process: build the encoder, then encode batches until stopped or orphaned.

    jobs / results: this worker's own torch.multiprocessing queues; stop: the pool's shared stop flag
    (a lock-free `RawValue`: a worker killed while holding an Event's lock would hang the others)."""
    try:
        torch.set_num_interop_threads(spec.threads)
        encode = build_encoder(spec)
    except Exception as exc:
        results.put(StartFailed(bounded_text(f"{type(exc).__name__}: {exc}")))
        results.close()
        results.join_thread()  # flush the reason before exiting (a short message, the pipe is empty)
        raise SystemExit(1) from None
    # from here on, exiting never waits to flush results: at shutdown (or when orphaned) nobody reads them
    results.cancel_join_thread()
    results.put(ReadyMessage(generation))
    while not stop.value:
        batch = _next_batch(jobs, stop, parent_pid)
        if batch is None:
            break
        if generation == 0 and spec.die_on_key is not None and any(j.key == spec.die_on_key for j in batch):
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: a hard death with items in flight
        _encode_batch(encode, batch, results)


def _next_batch(jobs: Any, stop: Any, parent_pid: int) -> list[JobMessage] | None:
    """The next batch: one job waited for, plus whatever is already queued. None: time to exit."""
    while True:
        try:
            message = jobs.get(timeout=PARENT_CHECK_S)
            break
        except queue.Empty:
            # reparented: the pool's process is gone (killed without shutting down); exit with it
            if stop.value or os.getppid() != parent_pid:
                return None
    batch: list[JobMessage] = []
    while True:
        if isinstance(message, StopMessage):
            return None
        batch.append(message)
        if len(batch) >= MAX_BATCH_ITEMS:
            return batch
        try:
            message = jobs.get_nowait()
        except queue.Empty:
            return batch


def _encode_batch(encode: EncodeFn, batch: list[JobMessage], results: Any) -> None:
    try:
        outputs = encode([from_shared(j.payload) for j in batch])
        if len(outputs) != len(batch):
            raise RuntimeError(f"encoder returned {len(outputs)} outputs for {len(batch)} items")
        shared = [in_shared_memory(o) for o in outputs]
    except Exception as exc:  # the batch as a whole failed: cannot be pinned to one item
        error = bounded_text(f"encoder failed: {type(exc).__name__}: {exc}")
        for job in batch:
            results.put(ItemFailed(job.key, error))
        return
    for job, output in zip(batch, shared):
        results.put(ItemDone(job.key, output))
