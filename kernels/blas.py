"""Fast BLAS for MLX on Linux CPUs, from pip packages alone.

The ``mlx-cpu`` wheel links the reference (netlib) BLAS, so float32 matmuls run at a few
GFLOP/s. MLX resolves ``cblas_sgemm`` (also dgemm, cgemm) through the dynamic linker's
global scope first, so loading an optimized BLAS with ``RTLD_GLOBAL`` *before* mlx's shared
library is loaded makes every CPU float32 matmul use it. The library used is the OpenBLAS
from the ``scipy-openblas32`` wheel (the one numpy/scipy build against; no gfortran or system
packages needed). It exports prefixed names (``scipy_cblas_sgemm``), so a tiny forwarding
shared object is written in memory (``kernels.shim``) that exports the plain names.

``CHATML_BLAS``: unset/"1"/"auto" = this; "0"/"off" = keep the reference BLAS; a path to a
shared library = use that one (plain ``cblas_sgemm`` or ``scipy_``-prefixed exports).

The shim's ``cblas_sgemm`` also sends single-row products (``M == 1``, every matmul of a
decode step) to ``sgemv``, which OpenBLAS streams the weights through several times faster
than ``sgemm`` with one row (``kernels.shim.gemv_dispatch``). ``CHATML_GEMV=0`` turns that off
(benchmarks measure both).
This module never imports mlx at import time; ``enable()`` must run before ``import mlx.core``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlasInfo", "core", "enable", "info", "measure_gflops", "threads"]

FIX_HINT = "pip install scipy-openblas32"
# OpenBLAS's idle workers spin for 2^OPENBLAS_THREAD_TIMEOUT cycles after each call before they
# sleep (its default, 28, is ~0.1 s). The native kernels' pool computes on the same cores right
# after most of a prefill's sgemm calls (attention, the chunked delta rule): spinning workers
# made a 40-token prefill of the 0.8B 1.4x slower than sleeping ones (BENCHMARKS.md). 12 (~1 us)
# measured the same as 4 and 16; the user's own setting wins.
THREAD_TIMEOUT = "12"
# Everything libmlx imports from a CBLAS (checked with nm -D on mlx 0.32).
_CBLAS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
_PREFIX = "scipy_"


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's CPU matmuls use."""

    library: str  # path of the shared library providing cblas_sgemm, or "reference"
    provider: str  # "scipy-openblas32", "custom", "system" or "reference"
    reason: str = ""  # why the reference BLAS is in use, if it is

    @property
    def fast(self) -> bool:
        return self.library != "reference"


_state: BlasInfo | None = None
_handles: list[ctypes.CDLL] = []  # keep libraries loaded for the life of the process


def _skip_reason() -> str | None:
    """Why enabling makes no sense here, or None."""
    if sys.platform != "linux":
        return f"not needed on {sys.platform}"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no forwarding shim for {platform.machine()}"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mlx-cuda"):  # MLX's CUDA backend: matmuls run on the GPU
            return f"GPU backend installed ({name})"
    return None


def _scipy_openblas_path() -> str | None:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    libs = sorted(lib_dir.glob("libscipy_openblas*.so*"))
    return str(libs[0]) if libs else None


def _dlopen_bytes(data: bytes, name: str) -> ctypes.CDLL:
    """dlopen a shared object from memory (memfd), falling back to a temporary file."""
    try:
        fd = os.memfd_create(name, 0)
    except (AttributeError, OSError):
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".so", delete=False) as f:
            f.write(data)
        try:
            return ctypes.CDLL(f.name, mode=ctypes.RTLD_GLOBAL)
        finally:
            os.unlink(f.name)
    try:
        os.write(fd, data)
        return ctypes.CDLL(f"/proc/self/fd/{fd}", mode=ctypes.RTLD_GLOBAL)
    finally:
        os.close(fd)  # the mapping outlives the descriptor


def _load(path: str, provider: str) -> BlasInfo:
    from kernels import subnormals

    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)  # read as the library loads
    with subnormals.flushing():  # OpenBLAS starts its threads now: they keep FTZ/DAZ
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _handles.append(lib)
    if not hasattr(lib, "cblas_sgemm"):
        if not hasattr(lib, _PREFIX + "cblas_sgemm"):
            raise OSError(f"{path} exports neither cblas_sgemm nor {_PREFIX}cblas_sgemm")
        from kernels.shim import forwarding_library, gemv_dispatch

        names = [n for n in _CBLAS if hasattr(lib, _PREFIX + n)]
        forwards = {n: _PREFIX + n for n in names}
        routines = {}
        if gemv_enabled() and hasattr(lib, _PREFIX + "cblas_sgemv"):
            del forwards["cblas_sgemm"]
            routines["cblas_sgemm"] = gemv_dispatch(
                _PREFIX + "cblas_sgemm", _PREFIX + "cblas_sgemv"
            )
        soname = Path(path).name
        shim = forwarding_library(forwards, "libchatml_cblas.so", [soname], routines)
        _handles.append(_dlopen_bytes(shim, "libchatml_cblas.so"))
    return BlasInfo(library=path, provider=provider)


def core() -> str:
    """The kernel set OpenBLAS runs on this CPU (e.g. "SkylakeX", "Haswell"), or "" when the
    BLAS loaded here is not OpenBLAS. OPENBLAS_CORETYPE forces one: some machines set it to
    an older kernel (Haswell: AVX2), which halves float32 sgemm on an AVX-512 CPU."""
    for lib in _handles:
        for name in (_PREFIX + "openblas_get_corename", "openblas_get_corename"):
            try:
                fn = getattr(lib, name)
            except AttributeError:
                continue
            fn.restype = ctypes.c_char_p
            return (fn() or b"").decode().strip()
    return ""


def threads() -> str:
    """OpenBLAS's worker threads and how long idle ones spin, e.g. "2 (idle workers sleep
    after 2^12 cycles)"; "" when the BLAS loaded here is not OpenBLAS."""
    for lib in _handles:
        for name in (_PREFIX + "openblas_get_num_threads", "openblas_get_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                timeout = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "28")
                return f"{fn()} (idle workers sleep after 2^{timeout} cycles)"
    return ""


def gemv_enabled() -> bool:
    """Whether single-row float32 products go to sgemv (``CHATML_GEMV=0`` turns it off)."""
    return os.environ.get("CHATML_GEMV", "1").strip().lower() not in ("0", "off", "false", "no")


def enable() -> BlasInfo:
    """Make MLX's CPU matmuls use an optimized BLAS; idempotent, call before importing mlx.

    Never raises: on any problem it warns once with the fix and keeps the reference BLAS.
    """
    global _state
    if _state is not None:
        return _state
    setting = os.environ.get("CHATML_BLAS", "auto").strip()
    if setting.lower() in ("0", "off", "false", "no", "reference"):
        _state = BlasInfo("reference", "reference", "disabled by CHATML_BLAS=0")
        return _state
    skip = _skip_reason()
    if skip is not None:
        _state = info() if sys.platform == "linux" else BlasInfo("reference", "reference", skip)
        return _state
    if "mlx.core" in sys.modules and not _resolved_path():
        _state = BlasInfo("reference", "reference", "mlx was imported before kernels.blas.enable()")
        warnings.warn(
            "kernels.blas.enable() was called after mlx was imported; MLX keeps the slow "
            "reference BLAS. Call it before the first `import mlx.core`.",
            RuntimeWarning,
            stacklevel=2,
        )
        return _state
    if "/" in setting:
        path, provider = setting, "custom"
    else:
        path, provider = _scipy_openblas_path(), "scipy-openblas32"
    try:
        if path is None:
            raise OSError("package scipy-openblas32 is not installed")
        _state = _load(path, provider)
    except OSError as err:
        _state = BlasInfo("reference", "reference", str(err))
        warnings.warn(
            f"fast BLAS unavailable ({err}); MLX CPU matmuls use the slow reference BLAS "
            f"(~30-50x slower). Fix: `{FIX_HINT}` (or set CHATML_BLAS to a libopenblas/"
            "libmkl_rt path; CHATML_BLAS=0 silences this).",
            RuntimeWarning,
            stacklevel=2,
        )
    return _state


def _resolved_path() -> str | None:
    """Path of the library that the global symbol scope resolves cblas_sgemm to, if any."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None)
    try:
        addr = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:  # not in the global scope: MLX uses its own reference BLAS
        return None

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    dl = _DlInfo()
    if not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(dl)) or not dl.dli_fname:
        return "unknown"
    return dl.dli_fname.decode()


def info() -> BlasInfo:
    """The BLAS MLX's CPU matmuls resolve to (``library == "reference"`` if the stock one)."""
    if _state is not None and _state.fast:
        return _state
    resolved = _resolved_path()
    if resolved:  # e.g. LD_PRELOAD or an application that loaded a BLAS globally itself
        return BlasInfo(resolved, "system")
    if _state is not None:
        return _state
    return BlasInfo("reference", "reference", "enable() not called")


def measure_gflops(n: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of an n x n x n MLX matmul on the CPU (for `chatml doctor`)."""
    import mlx.core as mx

    dt = getattr(mx, dtype)
    a = mx.random.normal((n, n)).astype(dt)
    b = mx.random.normal((n, n)).astype(dt)
    mx.eval(a, b, a @ b)  # warm-up: thread pools, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9
