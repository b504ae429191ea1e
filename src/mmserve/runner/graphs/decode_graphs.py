"""Captured decode steps of the language model, one graph per (batch size, block-table width) bucket.

Role: a step whose every sequence decodes one token (no prefill, nothing to fuse) is padded up to a
captured bucket and replayed: token ids, positions, KV slots, block tables and query positions are
copied into the bucket's static buffers; the graph runs embed -> decoder (the paged backend's decode
path, one padded decode group) -> logits; the real rows' logits are copied out for the sampler. A
padding row decodes token 0 at position 0 over the scratch block, writing its K/V to the scratch
slot, which no request owns — so padding never touches a real sequence's cache. Prefill, mixed
steps and batches beyond the largest bucket run eagerly (vLLM and SGLang do the same).

On the CPU, with `compile` set, the step is compiled by TorchInductor instead (the CPU's counterpart
of a graph: one fused C++ program instead of a few hundred eager ops and their Python). One compiled
function serves every bucket: the batch and block-table width are marked dynamic, so it compiles
once for batch 1 and once for the rest, not once per bucket (runner/cpu/compile.py). With
`in_background` (the CPU's default) the compiling runs in a thread of its own while the engine serves
every step eagerly; the compiled buckets are handed over at once when all are built, and the next
decode step replays them. Until then, and for good if compiling fails (logged), `run` answers None.
The compile thread writes only its own static buffers and the scratch block, never a slot a request
owns, so the eager steps it runs beside are untouched.

What it does not know: requests, sampling, scheduling, any family (the model is a `FamilyModel`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmserve.models.spec import FamilyModel
from mmserve.runner.attention import DecodeGroup, PagedAttentionBackend, PagedAttentionMetadata
from mmserve.runner.cpu.compile import (
    cancel_pending_compiles,
    compile_cache_counts,
    compiler_interrupted,
    drop_failed_build_outputs,
    forget_unfinished_builds,
    frozen_compile,
)
from mmserve.runner.graphs.buckets import DecodeBucket, plan_decode_batch
from mmserve.runner.graphs.capture import (
    CapturedGraph,
    CompiledStep,
    StaticBuffers,
    capture_graph,
    new_graph_pool,
)
from mmserve.runner.graphs.decode_arrays import DecodeArrays

if TYPE_CHECKING:
    from mmserve.runner.batch import BatchBuilder

logger = logging.getLogger(__name__)

# a background compile's thread runs this much nicer than the engine's, so the steps served meanwhile keep
# most of the cores (at equal priority they slowed several-fold); the compile takes somewhat longer while
# the engine is busy, and an idle engine leaves it every core
COMPILE_THREAD_NICENESS = 10
# one compile at a time per process: Dynamo's tracing state is process-wide, so two engines' compiles (an
# offline script's second LLM built while the first still compiles) wait for each other
_COMPILE_LOCK = threading.Lock()
STOP_WAIT_S = 2.5  # how long stopping waits for a compile's thread (the kernels in flight to be built)


@dataclass(frozen=True)
class DecodeGraphSettings:
    batch_sizes: tuple[int, ...]  # captured decode batch sizes (runner/graphs/buckets.decode_batch_sizes)
    block_widths: tuple[int, ...]  # captured block-table widths (runner/graphs/buckets.decode_block_widths)
    scratch_block: int  # a KV block no request is ever given: padding rows write and read there
    num_position_rows: int  # 3 for M-RoPE, 1 for 1-D RoPE
    # the window pool's such block (its null block, core/window_kv.py), where the sliding layers keep theirs apart
    window_scratch_block: int | None = None
    # batch x width x block_size keys a graph may gather per layer: the padded decode attention gathers them
    # all, and a capture reserves that much for its temporaries; wider batches run eagerly
    max_keys: int = 1 << 17
    compile: bool = False  # CPU: torch.compile the step (otherwise the CPU runs a replay-equivalent, for tests)
    in_background: bool = False  # compile in a thread while serving eagerly (`compile` only)


@dataclass
class _DecodeGraph:
    buffers: StaticBuffers
    graph: CapturedGraph | CompiledStep


@dataclass
class DecodeGraphStats:
    captured: list[DecodeBucket] = field(default_factory=list)
    num_replays: int = 0
    state: str = "ready"  # "compiling" (in the background, steps run eagerly), "ready", "failed", "stopped"
    build_s: float | None = None  # how long capturing (or compiling) every bucket took
    error: str | None = None  # why compiling failed


class DecodeGraphRunner:
    def __init__(self, model: FamilyModel, attention: PagedAttentionBackend, settings: DecodeGraphSettings,
                 device: torch.device, forward_reads_token_ids: bool = False) -> None:
        self.model = model
        self.forward_reads_token_ids = forward_reads_token_ids  # FamilySpec's: pass the ids to the forward
        self.attention = attention
        self.settings = settings
        self.device = device
        self.block_size = attention.block_size
        self.buckets = sorted(DecodeBucket(b, w) for b in settings.batch_sizes for w in settings.block_widths
                              if b * w * self.block_size <= settings.max_keys)
        self.graphs: dict[DecodeBucket, _DecodeGraph] = {}
        self.stats = DecodeGraphStats()
        self.pool = new_graph_pool(device)
        self._step = self._forward
        self._stop = threading.Event()
        self._built = threading.Event()
        self._thread: threading.Thread | None = None
        self._holds_lock = False  # the background thread holds _COMPILE_LOCK (only it writes this)
        if settings.compile:
            if device.type != "cpu":
                raise ValueError("compiled decode steps are for the CPU; CUDA captures graphs")
            self._step = frozen_compile(self._forward)

    def start(self) -> None:
        """Capture (or compile) every bucket now, or in a background thread when the settings say so."""
        if not (self.settings.compile and self.settings.in_background):
            started = time.perf_counter()
            with _COMPILE_LOCK:
                self._publish(self._capture_all(), started)
            return
        self.stats.state = "compiling"
        self._thread = threading.Thread(target=self._compile_in_background, name="mmserve-decode-compile",
                                        daemon=True)
        # a compiler still tracing while the interpreter finalizes crashes the process: stopped first
        atexit.register(self.stop)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every bucket is built (or building failed or stopped); True when they are ready."""
        self._built.wait(timeout_s)
        return self.stats.state == "ready"

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """The engine is shutting down (or the process exiting): a background compile is interrupted at
        its next Python instruction, its kernel builds are cancelled or ended (`cancel_pending_compiles`), and
        its thread is waited for up to `timeout_s`; a thread still running then is left to end by itself."""
        self._stop.set()
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return
        # a thread still waiting for the lock sees the stop flag; one compiling is interrupted where it is
        if self._holds_lock:
            _drop_unraisable_stops()
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(CompileStopped))
            cancel_pending_compiles()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.info("decode steps: the background compile is finishing the kernel it builds")

    def _compile_in_background(self) -> None:
        started = time.perf_counter()
        try:
            _lower_this_threads_priority(COMPILE_THREAD_NICENESS)
            while not self._take_compile_lock():  # another engine's compile first
                if self._stop.is_set():
                    raise CompileStopped
            before = compile_cache_counts()
            graphs = self._capture_all_rebuilding_broken()
            self._release_compile_lock()
            if graphs is None:
                raise CompileStopped
            self._publish(graphs, started)
            logger.info("decode steps: %s, replaying from the next step",
                        _what_was_done(before, compile_cache_counts(), self.stats.build_s))
        except CompileStopped:
            self.stats.state = "stopped"
        except Exception as e:  # noqa: BLE001 (any compiler failure leaves the eager steps serving)
            self._note_failure(e)
        finally:
            self._release_compile_lock()
            self._built.set()
            atexit.unregister(self.stop)

    def _capture_all_rebuilding_broken(self) -> dict[DecodeBucket, _DecodeGraph] | None:
        """`_capture_all`, once more where the first try failed on a broken file in the compile cache (a
        library truncated by a compiler killed in an earlier run): that file is removed and rebuilt."""
        try:
            return self._capture_all()
        except Exception as e:  # noqa: BLE001 (re-raised unless a broken cached file was removed)
            if self._stop.is_set() or compiler_interrupted(e) or not drop_failed_build_outputs(e):
                raise
            logger.info("decode steps: a broken file in the compile cache was removed; compiling it again")
            return self._capture_all()

    def _note_failure(self, error: Exception) -> None:
        # what a failed or ended compiler wrote is removed, so no later start loads half a library
        drop_failed_build_outputs(error)
        if self._stop.is_set() or compiler_interrupted(error):  # stopping (or Ctrl-C reached the compiler)
            self.stats.state = "stopped"
            return
        self.stats.state, self.stats.error = "failed", f"{type(error).__name__}: {error}"
        headline = next((line for line in str(error).splitlines() if line.strip()), "")
        logger.warning("decode steps: compiling in the background failed, they stay eager: %s: %s",
                       type(error).__name__, headline.strip())
        logger.debug("decode steps: the compile failed with %s", self.stats.error)

    def _take_compile_lock(self) -> bool:
        self._holds_lock = _COMPILE_LOCK.acquire(timeout=0.1)
        return self._holds_lock

    def _release_compile_lock(self) -> None:
        if self._holds_lock:
            self._holds_lock = False
            _COMPILE_LOCK.release()

    def _publish(self, graphs: dict[DecodeBucket, _DecodeGraph], started: float) -> None:
        self.stats.captured = list(graphs)
        self.stats.build_s = time.perf_counter() - started
        self.graphs = graphs  # one assignment: a step sees no buckets or all of them
        self.stats.state = "ready"
        self._built.set()

    @torch.inference_mode()
    def _capture_all(self) -> dict[DecodeBucket, _DecodeGraph] | None:
        """Every bucket's graph; None: stopped first. Compiling, the caller holds _COMPILE_LOCK."""
        graphs = {}
        if self.settings.compile:  # an earlier engine's stopped compile may have left cancelled builds
            forget_unfinished_builds()
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
            if self._stop.is_set():
                return None
            buffers = StaticBuffers(self._static_inputs(bucket))
            self._load(buffers, bucket, DecodeArrays.padding(self.settings.num_position_rows,
                                                                self.settings.window_scratch_block is not None))
            if self.settings.compile:
                graph = CompiledStep(lambda b=buffers: self._step(b))
            else:
                graph = capture_graph(lambda b=buffers: self._step(b), self.device, self.pool)
            buffers.record()
            graphs[bucket] = _DecodeGraph(buffers, graph)
        # the captures wrote padding K/V at the scratch slot only; nothing else of the cache changed
        return graphs

    def _static_inputs(self, bucket: DecodeBucket) -> dict[str, torch.Tensor]:
        b, dev, i64 = bucket.batch_size, self.device, torch.int64
        tensors = {
            "input_ids": torch.zeros(b, dtype=i64, device=dev),
            "positions": torch.zeros(self.settings.num_position_rows, b, dtype=i64, device=dev),
            "slot_mapping": torch.zeros(b, dtype=i64, device=dev),
            "block_table": torch.zeros(b, bucket.num_blocks, dtype=i64, device=dev),
            "query_positions": torch.zeros(b, 1, dtype=i64, device=dev),
            # constants, never reloaded
            "token_index": torch.arange(b, dtype=i64, device=dev),
            "key_positions": torch.arange(bucket.num_blocks * self.block_size, dtype=i64, device=dev)[None, :],
        }
        if self.settings.window_scratch_block is not None:  # the sliding layers' slots and tables
            tensors["window_slot_mapping"] = torch.zeros(b, dtype=i64, device=dev)
            tensors["window_block_table"] = torch.zeros(b, bucket.num_blocks, dtype=i64, device=dev)
        if self.settings.compile:
            _mark_dynamic(tensors)
        return tensors

    def _forward(self, buffers: StaticBuffers) -> torch.Tensor:
        """Graph-safe: reads only the static buffers. Returns (batch, vocab) logits."""
        group = DecodeGroup(buffers["block_table"], buffers["key_positions"], buffers["query_positions"],
                            buffers["token_index"])
        # every row a decode of one token, all in the one padded decode group: the backend's per-sequence
        # lists stay empty (its prefill loop has nothing to do), so nothing here depends on the batch size
        # in Python and a compiled step serves every batch size
        meta = PagedAttentionMetadata(query_lens=[], context_lens=[], spans=[], slot_mapping=buffers["slot_mapping"],
                                      decode_groups=[group])
        if self.settings.window_scratch_block is not None:
            window_group = DecodeGroup(buffers["window_block_table"], group.key_positions, group.query_positions,
                                       group.token_index)
            meta.window = PagedAttentionMetadata(query_lens=[], context_lens=[], spans=[],
                                                 slot_mapping=buffers["window_slot_mapping"],
                                                 decode_groups=[window_group])
        embeds = self.model.embed(buffers["input_ids"])
        ids = {"token_ids": buffers["input_ids"]} if self.forward_reads_token_ids else {}
        hidden = self.model(embeds, buffers["positions"], self.attention, meta, None, **ids)
        return self.model.compute_logits(hidden)

    def _load(self, buffers: StaticBuffers, bucket: DecodeBucket, arrays: DecodeArrays) -> None:
        settings = self.settings
        for name, array in arrays.padded(bucket, self.block_size, settings.scratch_block,
                                         settings.window_scratch_block).items():
            buffers.load(name, torch.from_numpy(array))

    @torch.inference_mode()
    def run(self, builder: BatchBuilder) -> torch.Tensor | None:
        """(num_decodes, vocab) logits of a decode-only step, in batch order; None: run it eagerly."""
        if not self.graphs or not _decode_only(builder):
            return None
        arrays = DecodeArrays.from_builder(builder)
        bucket = plan_decode_batch([len(t) for t in arrays.block_tables], list(self.graphs))
        if bucket is None:
            return None
        entry = self.graphs[bucket]
        self._load(entry.buffers, bucket, arrays)
        entry.buffers.assert_unmoved()
        entry.graph.replay()
        self.stats.num_replays += 1
        logits = entry.graph.output[:len(arrays.input_ids)]
        # a static output is copied out before the next replay overwrites it; a compiled step's is its own
        return logits if isinstance(entry.graph, CompiledStep) else logits.clone()


def _what_was_done(before: tuple[int, int], after: tuple[int, int], took_s: float | None) -> str:
    """What a compile did, from Inductor's cache counters: compiled (and cached), or loaded from the cache."""
    hits, misses = after[0] - before[0], after[1] - before[1]
    if misses == 0:
        return f"loaded {hits} compiled graph(s) from the cache in {took_s or 0:.1f} s"
    return f"compiled {misses} graph(s) with TorchInductor (C++) in {took_s or 0:.1f} s, cached for the next start"


class CompileStopped(BaseException):  # noqa: N818 (not an error: not caught by `except Exception`)
    """Raised inside the background compile's thread to stop it (the engine shut down)."""


def _drop_unraisable_stops() -> None:
    """A CompileStopped that lands in code Python cannot raise from (a weakref callback, a __del__) is
    lost, and Python prints it as "Exception ignored in ..." with a traceback (seen in a server's exit):
    the process's unraisable hook drops those reports; the compile then stops at its next bucket, its
    compiler processes already ended. Installed once per process (the hook is the interpreter's)."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_compile_stops", False):
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not isinstance(unraisable.exc_value, CompileStopped):
            previous(unraisable)
    hook.drops_compile_stops = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _lower_this_threads_priority(niceness: int) -> None:
    """Where the OS lets a thread lower its own priority (Linux), the steps the engine serves meanwhile
    (and the compiler processes this thread starts, which inherit it) get the cores first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError) as e:
        logger.debug("decode steps: the compile thread keeps its priority (%s)", e)


# the dims of the static inputs that vary between buckets: (batch) and (block-table width)
_DYNAMIC_DIMS = {"input_ids": (0,), "positions": (1,), "slot_mapping": (0,), "block_table": (0, 1),
                 "query_positions": (0,), "token_index": (0,), "key_positions": (1,), "window_slot_mapping": (0,),
                 "window_block_table": (0, 1)}


def _mark_dynamic(tensors: dict[str, torch.Tensor]) -> None:
    """Mark the bucket-dependent dims dynamic so one compile serves all buckets. A dim of size 1 is left
    static: the compiler specializes sizes 0 and 1, so batch 1 gets a compile of its own."""
    for name, dims in _DYNAMIC_DIMS.items():
        for dim in dims if name in tensors else ():
            if tensors[name].shape[dim] > 1:
                torch._dynamo.mark_dynamic(tensors[name], dim)


def _decode_only(builder: BatchBuilder) -> bool:
    """Every sequence decodes one token, fuses nothing, and samples its next token."""
    n = len(builder.query_lens)
    return n > 0 and len(builder.decode_rows) == n and not builder.fusion and len(builder.sample_rows) == n
