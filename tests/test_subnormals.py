"""Subnormals flushed to zero on the engine's threads only (kernels/subnormals.py)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from kernels import native, subnormals

pytestmark = pytest.mark.skipif(
    not subnormals.enabled(), reason=f"subnormals are {subnormals.info()} on this platform"
)

TINY = 1e-20  # normal in float32; its square (1e-40) is subnormal


def square_on_a_thread(flush: bool) -> tuple[float, float]:
    """On a new thread (flushed first, or not): 1e-20 squared by MLX and by numpy."""
    out = {}

    def run() -> None:
        if flush:
            assert subnormals.flush_on_this_thread()
        x = mx.array([TINY], dtype=mx.float32)
        out["mlx"] = (x * x).item()
        out["numpy"] = float(np.float32(TINY) * np.float32(TINY))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["mlx"], out["numpy"]


def test_flushing_is_the_calling_threads_alone() -> None:
    assert square_on_a_thread(flush=True) == (0.0, 0.0)
    mlx_product, numpy_product = square_on_a_thread(flush=False)
    assert 0 < mlx_product < 1.2e-38 and 0 < numpy_product < 1.2e-38
    # Nor does the caller's thread change (the test's own).
    assert 0 < float(np.float32(TINY) * np.float32(TINY)) < 1.2e-38


def test_flushing_block_restores_the_mode() -> None:
    with subnormals.flushing():
        assert float(np.float32(TINY) * np.float32(TINY)) == 0.0
    assert float(np.float32(TINY) * np.float32(TINY)) > 0


def test_engine_threads_flush(tiny) -> None:
    """The model thread's MLX ops, OpenBLAS's threads and the native pool's all flush."""

    def products() -> tuple[float, float, float]:
        x = mx.array([TINY], dtype=mx.float32)
        a = mx.full((512, 1024), TINY, dtype=mx.float32)
        b = mx.full((1024, 1024), TINY, dtype=mx.float32)  # sgemm over OpenBLAS's threads
        rows = native.dense_matmul(a[:4], b)  # the native GEMV, split over the pool
        return (x * x).item(), mx.abs(a @ b).max().item(), mx.abs(rows).max().item()

    assert tiny.worker.call(products) == (0.0, 0.0, 0.0)


@pytest.mark.skipif(native.module() is None, reason="needs the native kernels (a compiler)")
def test_native_pool_runs_each_job_in_its_callers_mode() -> None:
    """A pool worker that last ran a flushed job keeps subnormals for an unflushed caller."""
    a = mx.full((4, 1024), TINY, dtype=mx.float32)
    w = mx.full((8192, 1024), TINY, dtype=mx.float32)
    mx.eval(a, w)  # here: a lazy array cannot be evaluated on another thread
    out = {}

    def run(flush: bool) -> None:
        if flush:
            subnormals.flush_on_this_thread()
        y = np.array(native.dense_matmul(a, w))
        out[flush] = (y.min(), y.max())

    for flush in (True, False, True):
        t = threading.Thread(target=run, args=(flush,))
        t.start()
        t.join()
        low, high = out[flush]
        if flush:
            assert low == high == 0.0
        else:  # every output row, whichever thread computed it, holds 1024 * 1e-40
            assert 1e-38 < low <= high < 1.2e-37


def test_ftz_off_keeps_subnormals(monkeypatch) -> None:
    monkeypatch.setenv("CHATML_FTZ", "0")
    assert not subnormals.enabled() and "CHATML_FTZ=0" in subnormals.info()
    assert square_on_a_thread(flush=False)[0] > 0
    out = {}

    def run() -> None:
        out["set"] = subnormals.flush_on_this_thread()
        out["numpy"] = float(np.float32(TINY) * np.float32(TINY))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["set"] is False and out["numpy"] > 0
