"""Native CPU kernels (kernels/native/*.cpp) built against the installed MLX, at first use.

MLX's own CPU ``quantized_matmul`` runs a decode step's 4/8-bit GEMVs at ~1 GB/s; the native
primitive (``kernels/native/qgemv.cpp``, an MLX ``Primitive`` with ``eval_cpu``) reads the
compact weights at memory speed. A decode step's float32 products of a few rows
(`DENSE_ROWS`) go through ``kernels/native/dense.cpp``: OpenBLAS's sgemm reads the weights of
so few rows at a quarter of sgemv's speed, the native kernel reads them once for all rows.
The Gated DeltaNet update of a few tokens (decode, verify, short segments) runs as
``kernels/native/delta.cpp``: one pass over each state row where MLX's ops make about four
over the whole state (see ``kernels.delta_rule.gated_delta_rows``). The gates of a prefill
(silu, sigmoid, the conv's silu) run as ``kernels/native/activations.cpp``: MLX's CPU exp is
scalar on x86 (see ``kernels.activations``). They are compiled with CMake against MLX's
exported package and nanobind into ``CHATML_HOME/kernels/<key>/``, keyed by MLX version,
nanobind version, Python, machine and a hash of the sources, so an MLX upgrade rebuilds
instead of loading a module built for another ABI. ``chatml build-kernels`` builds it explicitly.

Without a compiler, CMake or nanobind (or with ``CHATML_NATIVE=0``) everything still works
through the Python path (MLX's ops), and one line on stderr says why, once per process.
``CHATML_NATIVE=build`` is the default (build when missing); ``CHATML_NATIVE=cached`` only
loads an existing build. The build targets this CPU (``-march=native``);
``CHATML_NATIVE_MARCH=haswell`` (any GCC/Clang ``-march``) builds for another x86 level
instead, as its own build: the tests use it to run the AVX2 kernels on an AVX-512 machine.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = [
    "NativeInfo",
    "build",
    "dense_matmul",
    "dense_rows",
    "info",
    "module",
    "quantized_matmul",
]

SOURCE_DIR = Path(__file__).resolve().parent / "native"
MODULE = "_chatml_qgemv"
GEMV_ROWS = 64  # up to this many rows of x use the GEMV kernel; more: dequantize + sgemm
# Float32 rows of x that take the native dense kernel, by the kernel this CPU runs (measured
# with `bench.qgemv --batch ... --forms` and whole decode steps and prefills, BENCHMARKS.md):
# - avx512: 1-256 rows: decode steps and short prefills (a chat turn's new exchange). One row:
#   sgemv reads a matrix as fast, but OpenBLAS's threads spin after each call on the cores the
#   kernels' pool computes on next (whole decode steps 1.18-1.32x faster). Up to 24 rows the
#   kernel reads the weights once for all rows (sgemm reads so few rows' weights at a quarter
#   of sgemv's speed); from 25 it runs outer products on a register tile: 1.1-2x sgemm on the
#   0.8B's shapes up to 128 rows (40-token prefills 1.3-1.4x faster), 0.9-1.17x at 256. At 384
#   and 512 rows sgemm's blocking over K wins where K is long (MLP down: 0.88x), and 512-token
#   prefills were 5-10% faster on sgemm.
# - avx2 (4 rows of x per dot-product tile, 6 x 16 outer-product tiles): 2-256 rows. sgemv is
#   faster for one row (decode steps 1.17-1.21x); 16-128 rows 1.1-1.9x sgemm (Haswell
#   kernels), 256 even (40-token prefills 1.4x faster); whole 512-token chunks were 2-5%
#   faster on sgemm.
# - generic (the portable kernel, dot products only): 2-32 rows; one row goes to sgemv.
DENSE_ROWS = {"avx512": (1, 256), "avx2": (2, 256), "generic": (2, 32)}
# Products with long rows (K >= LONG_K: the MLP's down projection, 1024 x 3584, and the Gated
# DeltaNet's out_proj, 1024 x 2048, in the 0.8B) go to sgemm from LONG_K_ROWS + 1 rows on: on
# an Intel Xeon with two FMA units (session 28) the outer products ran them at 0.63-0.84x
# sgemm from 160 to 256 rows, on the Zen 4 of session 26 at ~0.9x at 256 rows and 1.1x or more
# up to 128. Since the kernel cuts K into slabs that stay in cache (session 29) it runs them
# 1.2-1.5x faster at 64-128 rows, and at 0.81-1.08x sgemm from 160 to 256 on that Xeon.
LONG_K, LONG_K_ROWS = 2048, 128


@dataclass(frozen=True)
class NativeInfo:
    """Which path CPU quantized matmuls take."""

    path: str  # the built module's file, or "" when the Python path runs
    isa: str = ""  # "avx512", "avx2" or "generic"
    threads: int = 0
    reason: str = ""  # why the Python path runs, if it does

    @property
    def active(self) -> bool:
        return bool(self.path)


_lock = threading.Lock()
_module: ModuleType | None = None
_info: NativeInfo | None = None


def _mode() -> str:
    value = os.environ.get("CHATML_NATIVE", "build").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "cached" if value == "cached" else "build"


def _march() -> str:
    """The x86 ``-march`` of the build: this CPU's (native) unless CHATML_NATIVE_MARCH names
    another (ignored on ARM, whose builds take the compiler's default)."""
    return os.environ.get("CHATML_NATIVE_MARCH", "").strip() or "native"


def _cpu() -> str:
    """The CPU's feature flags, digested: the build uses -march=native, so a module in a
    CHATML_HOME shared between machines (a network home, a copied cache) is only for a CPU
    with the same flags (another one would die of an illegal instruction, not fall back)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next(line for line in text.splitlines() if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):  # macOS: the chip's name stands in for its flags
        flags = platform.processor() + platform.platform()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    return {
        "mlx": version("mlx"),
        "nanobind": version("nanobind"),
        "python": sysconfig.get_config_var("SOABI") or sys.version.split()[0],
        "machine": platform.machine(),
        "cpu": _cpu(),
        "march": _march(),
    }


def _key() -> str:
    """Cache key: tool versions, interpreter ABI, machine, CPU flags, -march and the sources'
    bytes."""
    digest = hashlib.sha256(repr(sorted(_versions().items())).encode())
    for f in sorted(SOURCE_DIR.iterdir()):
        if f.suffix in (".cpp", ".h", ".txt"):
            digest.update(f.name.encode() + f.read_bytes())
    return f"mlx{_versions()['mlx']}-{digest.hexdigest()[:16]}"


def build_dir() -> Path:
    from engine.paths import chatml_home

    return chatml_home() / "kernels" / _key()


def _built_file(folder: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (folder / f"{MODULE}{suffix}").exists():
            return folder / f"{MODULE}{suffix}"
    return None


def _missing_tool() -> str | None:
    """Why a build cannot run here, or None."""
    if shutil.which("cmake") is None:
        return "no cmake on PATH"
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler on PATH"
    if importlib.util.find_spec("nanobind") is None:
        return "package nanobind is not installed"
    return None


def mlx_cmake_dir() -> Path:
    """MLX's CMake package, beside the loaded mlx.core (mlx is a namespace package: an `mlx`
    folder in a script's directory comes first in its path, and held no CMake files)."""
    import mlx.core

    return Path(mlx.core.__file__).parent / "share" / "cmake" / "MLX"


def build(*, quiet: bool = True) -> Path:
    """Compile the native module into CHATML_HOME (if not already there); returns its path.

    Raises RuntimeError naming the missing tool or the compiler's last output lines.
    """
    folder = build_dir()
    if (done := _built_file(folder)) is not None:
        return done
    if (why := _missing_tool()) is not None:
        raise RuntimeError(why)
    import nanobind

    mlx_cmake = mlx_cmake_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".build-") as tmp:
        configure = [
            "cmake", "-S", str(SOURCE_DIR), "-B", tmp, f"-DMLX_DIR={mlx_cmake}",
            f"-Dnanobind_DIR={nanobind.cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release", f"-DCHATML_MARCH={_march()}",
        ]  # fmt: skip
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        for cmd in (configure, ["cmake", "--build", tmp, "-j", str(os.cpu_count() or 1)]):
            run = subprocess.run(cmd, capture_output=quiet, text=True)
            if run.returncode != 0:
                tail = "\n".join(((run.stdout or "") + (run.stderr or "")).splitlines()[-15:])
                raise RuntimeError(f"{' '.join(cmd[:2])} failed:\n{tail}")
        made = _built_file(Path(tmp))
        if made is None:
            raise RuntimeError(f"the build left no {MODULE} module in {tmp}")
        staged = Path(tmp) / "out"
        staged.mkdir()
        shutil.copy2(made, staged / made.name)
        try:
            os.replace(staged, folder)  # atomic: a concurrent build either wins or loses whole
        except OSError:
            if _built_file(folder) is None:
                raise
    return _built_file(folder)


def _import(file: Path) -> ModuleType:
    import mlx.core as mx  # registers mx.array with nanobind before the module binds to it

    spec = importlib.util.spec_from_file_location(MODULE, file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if mod.mlx_version() != mx.__version__:
        raise RuntimeError(f"built for MLX {mod.mlx_version()}, running MLX {mx.__version__}")
    try:  # a nanobind whose ABI differs from mlx.core's cannot take an mx.array
        w, scales, biases = mx.quantize(mx.ones((1, 64)), group_size=64, bits=8)
        mx.eval(mod.quantized_gemv(mx.ones((1, 64)), w, scales, biases, 64, 8))
        mx.eval(mod.dense_gemv(mx.ones((2, 16)), mx.ones((3, 16))))
    except TypeError as err:
        raise RuntimeError(f"the module does not accept mx.array (nanobind ABI): {err}") from None
    return mod


def _load() -> tuple[ModuleType | None, NativeInfo]:
    mode = _mode()
    if mode == "off":
        return None, NativeInfo("", reason="disabled by CHATML_NATIVE=0")
    try:
        file = _built_file(build_dir())
        if file is None:
            if mode == "cached":
                raise RuntimeError("not built (CHATML_NATIVE=cached; run `chatml build-kernels`)")
            t0 = time.perf_counter()
            file = build()
            print(
                f"chatml: built native CPU kernels in {time.perf_counter() - t0:.0f} s "
                f"({file.parent})", file=sys.stderr,
            )  # fmt: skip
        mod = _import(file)
    except Exception as err:  # no compiler, failed build, ABI mismatch: the Python path runs
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"chatml: native CPU kernels unavailable ({reason}); quantized and batched float32 "
            "matmuls, the Gated DeltaNet decode update and the gates use MLX's slower ops (`chatml doctor` explains, `chatml build-kernels` "
            "retries)",
            file=sys.stderr,
        )
        return None, NativeInfo("", reason=str(err).strip())
    return mod, NativeInfo(str(file), mod.isa(), mod.threads())


def module() -> ModuleType | None:
    """The native module (built on first call if needed), or None on the Python path."""
    global _module, _info
    with _lock:
        if _info is None:
            _module, _info = _load()
        return _module


def required(what: str) -> ModuleType:
    """The native module for `what` (e.g. "method 'fused'"), or RuntimeError saying why not."""
    mod = module()
    if mod is None:
        raise RuntimeError(f"{what} needs the native CPU kernels: {_info.reason}")
    return mod


def info() -> NativeInfo:
    """Which path runs (loads or builds the module on first call, like `module()`)."""
    module()
    return _info


def reset() -> None:
    """Forget the loaded state so the next call looks again (tests, `build-kernels`)."""
    global _module, _info
    with _lock:
        _module, _info = None, None


def quantized_matmul(x, w, scales, biases, group_size: int, bits: int):
    """``x @ dequantize(w).T`` on the CPU: the native GEMV for a few rows, else float32 BLAS.

    Prefill (many rows) dequantizes the matrix per call (natively: MLX's CPU dequantize is
    slow) and multiplies in float32, which reaches the fast sgemm; MLX's quantized_matmul is
    far slower there on a CPU.
    """
    import mlx.core as mx

    mod = module()
    rows = x.size // x.shape[-1]
    if mod is not None and rows <= GEMV_ROWS and x.dtype == mx.float32 and bits in (4, 8):
        return mod.quantized_gemv(x, w, scales, biases, group_size, bits)
    if rows <= GEMV_ROWS:
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=True, group_size=group_size, bits=bits
        )
    if mod is not None and x.dtype == mx.float32 and bits in (4, 8):
        return x @ mod.dequantize(w, scales, biases, group_size, bits).T
    # scales in float32 first: dequantizing at bfloat16 scales would round the weights
    f32 = mx.float32
    weight = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size, bits)
    return x @ weight.astype(x.dtype).T


def dense_rows() -> tuple[int, int]:
    """The rows of x that take the native dense GEMV here (`DENSE_ROWS` of the kernel that
    runs; the portable kernel's where none does)."""
    return _dense_rows(info().isa)


def _dense_rows(isa: str) -> tuple[int, int]:
    return DENSE_ROWS.get(isa, DENSE_ROWS["generic"])


def dense_matmul(x, w):
    """``x @ w.T`` for a float32 weight ``w [N, K]``: the native kernel when x has `dense_rows()`
    rows (a decode step, a batched one, a speculative verify, a short prefill; at most
    `LONG_K_ROWS` where K >= `LONG_K`), MLX's matmul
    otherwise (more rows: sgemm; one row where sgemv is faster: sgemv through the BLAS shim) and
    on the Python path. The same float32 dot products either way, summed in another
    order. A weight that is a view (e.g. transposed) is copied to row-major per call: correct,
    but slow for big matrices."""
    import mlx.core as mx

    if (
        x.dtype == mx.float32
        and w.dtype == mx.float32
        and w.ndim == 2
        and x.ndim >= 1
        and x.shape[-1] == w.shape[1] > 0
        and w.shape[0] > 0  # the kernel takes no empty w; x @ w.T is [..., 0]
        and (mod := module()) is not None
    ):
        lo, hi = _dense_rows(_info.isa)  # loaded by module() just above; no second lock
        if w.shape[1] >= LONG_K:
            hi = min(hi, LONG_K_ROWS)
        if lo <= x.size // x.shape[-1] <= hi:
            return mod.dense_gemv(x, w)
    return x @ w.T
