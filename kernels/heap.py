"""Keep the freed buffers of a decode step mapped on glibc Linux, so the next step does not
page-fault them back in.

MLX's CPU backend keeps no buffer cache: every intermediate is malloc'd and freed within the
step. glibc moves two thresholds as it goes: blocks above the mmap threshold get their own
mapping, returned to the kernel on free, and a heap whose free top outgrows the trim threshold
is shrunk. A batched step's buffers (at batch 8 on the 0.8B: Gated DeltaNet states of 8 MiB per
layer, 7.9 MB of logits) cross both, so every other step faulted ~40,000 pages (160 MB) back
in, each zeroed by the kernel first: 4-15% of a batch-8 step (BENCHMARKS.md, "Continuous
batching").

`enable()` pins both with `mallopt`: blocks below 32 MiB (glibc's largest mmap threshold) come
from the heap, and up to 1 GiB of free heap stays mapped for the next step, as a GPU
allocator's buffer cache would keep it. Larger blocks (weights, long prefill chunks) are still
mapped and unmapped on their own.

``CHATML_MALLOC=0`` keeps glibc's own policy, as does either of glibc's own variables
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) when set: the user's choice wins.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "enable", "info"]

MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
_GLIBC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_state: str | None = None


def _skip_reason() -> str | None:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return f"not glibc ({sys.platform})"
    if os.environ.get("CHATML_MALLOC", "").strip().lower() in ("0", "off"):
        return "kept glibc's policy (CHATML_MALLOC=0)"
    if set_vars := [v for v in _GLIBC_VARS if v in os.environ]:
        return f"kept the environment's {', '.join(set_vars)}"
    return None


def enable() -> str:
    """Pin glibc's thresholds (once per process); returns what `info()` says."""
    global _state
    if _state is None:
        if (why := _skip_reason()) is not None:
            _state = why
        else:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(
                _M_TRIM_THRESHOLD, TRIM_THRESHOLD
            )
            _state = (
                f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
                f"{TRIM_THRESHOLD >> 20} MiB"
                if ok
                else "mallopt refused the thresholds"
            )
    return _state


def info() -> str:
    """The malloc policy in force, in words ("" before `enable()`)."""
    return _state or ""
