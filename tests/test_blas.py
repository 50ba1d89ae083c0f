"""kernels.blas: fast BLAS for MLX, each case in a fresh interpreter (mlx loads once)."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run without an install

from kernels.shim import forwarding_library  # noqa: E402

linux_x86 = pytest.mark.skipif(
    not (sys.platform == "linux" and os.uname().machine == "x86_64"), reason="Linux x86-64 only"
)
needs_openblas = pytest.mark.skipif(
    importlib.util.find_spec("scipy_openblas32") is None, reason="scipy-openblas32 not installed"
)

CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import kernels.blas as blas
        mlx_before = "mlx.core" in sys.modules
        first = blas.enable()
        second = blas.enable()  # idempotent: same answer, no second warning
    import mlx.core as mx
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((257, 129)).astype(np.float32)
    b = rng.standard_normal((129, 65)).astype(np.float32)
    c = np.array(mx.array(a) @ mx.array(b))
    info = blas.info()
    print(json.dumps({
        "mlx_before": mlx_before,
        "same": first == second,
        "library": info.library,
        "provider": info.provider,
        "fast": info.fast,
        "warnings": [str(w.message) for w in caught],
        "err": float(np.abs(c - a.astype(np.float64) @ b).max()),
        "gflops": blas.measure_gflops(n=256, repeats=2),
    }))
    """
)


def run_child(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CHATML_BLAS"}
    if env_value is not None:
        env["CHATML_BLAS"] = env_value
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_does_not_import_mlx() -> None:
    code = "import sys, kernels, kernels.blas; assert 'mlx' not in sys.modules, sorted(sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


@linux_x86
@needs_openblas
def test_enable_uses_openblas_and_matmul_is_correct() -> None:
    r = run_child(None)
    assert not r["mlx_before"] and r["same"] and r["warnings"] == []
    assert r["fast"] and r["provider"] == "scipy-openblas32"
    assert "openblas" in Path(r["library"]).name
    assert r["err"] < 1e-3 and r["gflops"] > 0


def test_disabled_reports_reference() -> None:
    r = run_child("0")
    assert r["library"] == "reference" and not r["fast"] and r["warnings"] == []
    assert r["err"] < 1e-3


@linux_x86
def test_missing_library_warns_once_and_falls_back() -> None:
    r = run_child("/nonexistent/libopenblas.so")
    assert r["library"] == "reference" and r["same"]
    assert len(r["warnings"]) == 1 and "pip install" in r["warnings"][0]
    assert r["err"] < 1e-3


@linux_x86
def test_forwarding_shim_calls_target(tmp_path: Path) -> None:
    # Forward a made-up name to libc's strlen and call it through the shim.
    path = tmp_path / "libfwd.so"
    path.write_bytes(forwarding_library({"chatml_test_strlen": "strlen"}, "libfwd.so", []))
    ctypes.CDLL(ctypes.util.find_library("c"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(path))
    lib.chatml_test_strlen.restype = ctypes.c_size_t
    assert lib.chatml_test_strlen(b"hello, shim") == 11


def _openblas() -> ctypes.CDLL:
    import scipy_openblas32

    lib_dir = Path(scipy_openblas32.get_lib_dir())
    return ctypes.CDLL(str(sorted(lib_dir.glob("libscipy_openblas*.so*"))[0]), ctypes.RTLD_GLOBAL)


@linux_x86
@needs_openblas
def test_gemv_dispatch_matches_sgemv_for_one_row_and_sgemm_otherwise(tmp_path: Path) -> None:
    """Every sgemm argument pattern through the dispatcher: single-row row-major products must
    come out bit for bit as a direct sgemv call, all others as a direct sgemm call, and both
    must equal a float64 reference (strides wider than the matrices, alpha and beta != 0/1)."""
    import numpy as np

    from kernels.shim import gemv_dispatch

    blas = _openblas()
    soname = Path(blas._name).name
    path = tmp_path / "libdispatch.so"
    routine = gemv_dispatch("scipy_cblas_sgemm", "scipy_cblas_sgemv")
    path.write_bytes(forwarding_library({}, "libdispatch.so", [soname], {"t_sgemm": routine}))
    shim = ctypes.CDLL(str(path))
    P, f32 = ctypes.c_void_p, ctypes.c_float
    rng = np.random.default_rng(0)
    row, col, no, tr = 101, 102, 111, 112

    def buf(rows: int, cols: int, ld: int) -> np.ndarray:  # a [rows, cols] view of a wider buffer
        return rng.standard_normal((rows, ld)).astype(np.float32)

    def call(fn, order, ta, tb, M, N, K, a, lda, b, ldb, c, ldc, alpha=0.75, beta=0.5):
        fn(order, ta, tb, M, N, K, f32(alpha), P(a.ctypes.data), lda, P(b.ctypes.data), ldb,
           f32(beta), P(c.ctypes.data), ldc)  # fmt: skip

    checked = 0
    for order in (row, col):
        for ta in (no, tr):
            for tb in (no, tr):
                for M, N, K in ((1, 37, 19), (1, 1, 5), (3, 37, 19), (1, 300, 1)):
                    # Row-major shapes of the stored matrices (column-major: the transpose).
                    a_shape = (M, K) if ta == no else (K, M)
                    b_shape = (K, N) if tb == no else (N, K)
                    if order == col:
                        a_shape, b_shape = a_shape[::-1], b_shape[::-1]
                    lda, ldb = a_shape[1] + 3, b_shape[1] + 2
                    a, b = buf(a_shape[0], lda, lda), buf(b_shape[0], ldb, ldb)
                    c_shape = (M, N) if order == row else (N, M)
                    ldc = c_shape[1] + 1
                    c0 = buf(c_shape[0], ldc, ldc)
                    got, direct = c0.copy(), c0.copy()
                    call(shim.t_sgemm, order, ta, tb, M, N, K, a, lda, b, ldb, got, ldc)
                    if order == row and M == 1:
                        x_inc = 1 if ta == no else lda
                        rows, cols = (N, K) if tb == tr else (K, N)
                        blas.scipy_cblas_sgemv(row, no if tb == tr else tr, rows, cols, f32(0.75),
                                               P(b.ctypes.data), ldb, P(a.ctypes.data), x_inc,
                                               f32(0.5), P(direct.ctypes.data), 1)  # fmt: skip
                    else:
                        call(blas.scipy_cblas_sgemm, order, ta, tb, M, N, K, a, lda, b, ldb,
                             direct, ldc)  # fmt: skip
                    assert np.array_equal(got, direct), (order, ta, tb, M, N, K)
                    # float64 reference, in row-major terms
                    A = a[:, : a_shape[1]].astype(np.float64)
                    B = b[:, : b_shape[1]].astype(np.float64)
                    C = c0[:, : c_shape[1]].astype(np.float64)
                    if order == col:
                        A, B, C = A.T, B.T, C.T
                    opA = A if ta == no else A.T
                    opB = B if tb == no else B.T
                    want = 0.75 * opA @ opB + 0.5 * C
                    out = got[:, : c_shape[1]] if order == row else got[:, : c_shape[1]].T
                    assert np.abs(out - want).max() < 1e-4, (order, ta, tb, M, N, K)
                    checked += 1
    assert checked == 32


_GEMV_CHILD = textwrap.dedent(
    """
    import json
    import kernels.blas as blas
    blas.enable()
    import mlx.core as mx
    import numpy as np
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 64)).astype(np.float32)
    errs = []
    for x in (rng.standard_normal((1, 64)), rng.standard_normal((1, 1, 64))):
        x = x.astype(np.float32)
        errs.append(float(np.abs(np.array(mx.array(x) @ mx.array(w).T) - x @ w.T.astype(np.float64)).max()))
    v = rng.standard_normal((1, 300)).astype(np.float32)
    errs.append(float(np.abs(np.array(mx.array(v) @ mx.array(w)) - v @ w.astype(np.float64)).max()))
    m = mx.array(w)[::2, :32]  # a strided view: MLX copies or passes a leading dimension
    errs.append(float(np.abs(np.array(mx.array(x[0]) [:, :32] @ m.T) - x[0][:, :32] @ w[::2, :32].T.astype(np.float64)).max()))
    print(json.dumps({"gemv": blas.gemv_enabled(), "errs": errs}))
    """
)


@linux_x86
@needs_openblas
@pytest.mark.parametrize("gemv", ["1", "0"])
def test_mlx_single_row_matmuls_are_exact_with_and_without_gemv(gemv: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CHATML_BLAS"}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), CHATML_GEMV=gemv)
    out = subprocess.run([sys.executable, "-c", _GEMV_CHILD], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["gemv"] is (gemv == "1")
    assert max(r["errs"]) < 1e-4, r


@linux_x86
@needs_openblas
@pytest.mark.parametrize("preset", [None, "20"])
def test_idle_openblas_workers_sleep_soon_unless_the_user_says(preset) -> None:
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT as it loads: enable() sets the engine's default
    (workers sleep after 2^12 cycles instead of spinning ~0.1 s on the cores the native kernels
    compute on next) before it loads the library, and keeps a value the user set."""
    code = "import kernels.blas as b, os; b.enable(); "
    code += "print(os.environ['OPENBLAS_THREAD_TIMEOUT'], '|', b.threads())"
    env = {
        k: v for k, v in os.environ.items() if k not in ("CHATML_BLAS", "OPENBLAS_THREAD_TIMEOUT")
    }
    env.update(PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="2")
    if preset:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    want = preset or "12"
    assert out.stdout.split("|")[0].strip() == want
    assert out.stdout.split("|")[1].strip() == f"2 (idle workers sleep after 2^{want} cycles)"
