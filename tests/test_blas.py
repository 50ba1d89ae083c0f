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
