"""glibc's malloc tuned for an engine's tensors on the CPU.

Role: a CPU step allocates and frees tensors of tens of MB (an encoder's activations, a long prefill's).
glibc serves each block above its mmap threshold (32 MiB at most by default) with a fresh mmap, whose
pages the kernel zero-fills on first touch, and unmaps it at free: every such tensor pays its page faults
again. Measured on the 2-core machine: a layer norm over a 52 MB tensor took 19 ms, 7 ms with the
threshold raised. Raising M_MMAP_THRESHOLD (blocks up to 64 MiB come from the heap) and M_TRIM_THRESHOLD
(the heap keeps up to 256 MiB free at its top) keeps those blocks mapped and reused, as tcmalloc (which
vLLM's CPU guide preloads) does; a KV cache or a weight above 64 MiB still gets its own mapping, returned
at free (with 1 GiB thresholds a process that builds engine after engine, as the test suite does, grew past
13 GB). Process-wide, set the first time an engine loads on the CPU. `MMSERVE_CPU_MALLOC_TUNING=0` leaves malloc
as it is; where the C library is not glibc (musl, macOS) nothing is changed.

What it does not know: tensors, engines, devices.
"""

from __future__ import annotations

import ctypes
import logging

from mmserve.envs import cpu_malloc_tuning_enabled

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# blocks up to this come from the heap (a step's activations); larger ones (a KV cache, a big weight) still get
# their own mapping, returned at free: an engine's end gives its pools back to the system
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20  # free memory the heap keeps at its top


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds (True: they are raised now or were before)."""
    if not cpu_malloc_tuning_enabled():
        return False
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):  # not glibc: its own allocator, left alone
        return False
    version.restype = ctypes.c_char_p
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and \
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    logger.debug("glibc %s malloc: mmap and trim thresholds %s", version().decode(),
                 f"raised to {MMAP_THRESHOLD_BYTES} bytes" if done else "left as they were (refused)")
    return done
