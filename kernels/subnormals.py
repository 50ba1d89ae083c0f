"""Subnormal floats flushed to zero on the engine's own threads (x86-64 Linux: MXCSR's FTZ, DAZ).

A float32 below 1.2e-38 is subnormal, and on x86 each subnormal operand or result of an SSE or
AVX instruction costs a microcode assist of a hundred cycles or more. The chunked Gated DeltaNet
prefill (``kernels.delta_rule``) multiplies decays, keys and betas whose products fall there
for any head that forgets fast (a decay of 0.01-0.3 a step, common in trained checkpoints):
such a layer ran 3.4x slower, and a 512-token prefill of the 0.8B build 1.5x (BENCHMARKS.md,
"Subnormals"). With FTZ (results) and DAZ (operands) set, those values are 0 instead: a change
below 1.2e-38 of quantities whose sums are of order one, as GPUs do by default.

MXCSR belongs to a thread, and a new thread starts with a copy of its creator's. So:

- the engine's model thread (``engine.runtime.worker``) calls `flush_on_this_thread` before its
  first MLX call; the MLX stream thread it then creates, which runs its CPU ops, copies it, and
  so does the native kernels' thread pool, started from there;
- OpenBLAS starts its worker threads when it is loaded (``kernels.blas``), inside `flushing()`.

The caller's own threads (the user's Python) keep IEEE subnormals. ``CHATML_FTZ=0`` keeps them
everywhere. Elsewhere than x86-64 Linux with glibc nothing changes (ARM cores handle subnormals
in hardware at full speed).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import sys
from collections.abc import Iterator

__all__ = ["enabled", "flush_on_this_thread", "flushing", "info"]

_FENV_BYTES = 32  # glibc's fenv_t on x86-64: the x87 environment, then MXCSR
_MXCSR_AT = 28
_FTZ_DAZ = 0x8040  # MXCSR bits 15 (flush to zero) and 6 (denormals are zero)
_MASKED = 0x1F80  # every exception masked: what a sane fenv_t read back holds

_libm: ctypes.CDLL | None = None


def _skip_reason() -> str | None:
    if os.environ.get("CHATML_FTZ", "").strip().lower() in ("0", "off", "false", "no"):
        return "kept (CHATML_FTZ=0)"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"kept (no x86 assists to avoid on {sys.platform} {platform.machine()})"
    if platform.libc_ver()[0] != "glibc":
        return "kept (not glibc)"
    return None


def enabled() -> bool:
    return _skip_reason() is None


def info() -> str:
    """What `chatml doctor` says."""
    return _skip_reason() or "flushed to zero on the engine's threads (FTZ/DAZ)"


def _mxcsr() -> tuple[ctypes.Array, int] | None:
    """This thread's fenv_t and the MXCSR in it, or None where the layout is not as expected."""
    global _libm
    if _libm is None:
        _libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    env = ctypes.create_string_buffer(_FENV_BYTES)
    if _libm.fegetenv(env) != 0:
        return None
    mxcsr = int.from_bytes(env.raw[_MXCSR_AT : _MXCSR_AT + 4], "little")
    return (env, mxcsr) if mxcsr & _MASKED == _MASKED else None


def _set(env: ctypes.Array, mxcsr: int) -> None:
    env[_MXCSR_AT : _MXCSR_AT + 4] = mxcsr.to_bytes(4, "little")
    _libm.fesetenv(env)


def flush_on_this_thread() -> bool:
    """Set FTZ and DAZ on the calling thread (for good); True if they are set."""
    if not enabled() or (got := _mxcsr()) is None:
        return False
    env, mxcsr = got
    _set(env, mxcsr | _FTZ_DAZ)
    return True


@contextlib.contextmanager
def flushing() -> Iterator[None]:
    """FTZ and DAZ on the calling thread for the block (threads started inside keep them)."""
    got = _mxcsr() if enabled() else None
    if got is None:
        yield
        return
    env, mxcsr = got
    _set(env, mxcsr | _FTZ_DAZ)
    try:
        yield
    finally:
        _set(env, mxcsr)
