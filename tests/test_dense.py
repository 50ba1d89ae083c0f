"""The native float32 dense kernel (kernels/native/dense.cpp) against a float64 numpy
reference and MLX's matmul, inside `mx.compile`, on awkward inputs, and in the model.

Tolerance: |y - ref| <= 2e-6 * (|x| @ |w|.T) per output. In the dot-product form (a few
rows) each output is one float32 dot product summed per SIMD lane, then across lanes (K <= 1030
here: at most 65 terms a lane); in the outer-product form (from 25 rows with AVX-512) it is one
float32 fused multiply-add after another over all K (K <= 3584 here). Rounding errors of random
sign grow as sqrt(terms): measured at most 3.5e-7 of the sum of magnitudes in either form.
MLX's sgemm rounds the same way in another order, so native and MLX agree to 1e-5 of it.
"""

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import engine
from engine.runtime.dense import CpuEmbedding, CpuLinear
from kernels import native

REL = 2e-6


def reference(x: mx.array, w: mx.array):
    xd = np.array(x, dtype=np.float64).reshape(-1, w.shape[1])
    wd = np.array(w, dtype=np.float64)
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


def offset_matrix(n: int, k: int, offset: int, seed: int) -> mx.array:
    """A row-contiguous [n, k] view starting `offset` floats into its buffer: the kernel aligns
    its loads to the weight rows' phase, so every phase must give the same answer."""
    flat = mx.random.normal((n * k + offset,), key=mx.random.key(seed))
    return flat[offset:].reshape(n, k)


@pytest.mark.parametrize("isa", ["simd", "generic"])
def test_kernel_matches_float64_reference(mod, monkeypatch, isa):
    if isa == "generic":  # the portable kernel (NEON and unknown CPUs) on this machine too
        monkeypatch.setenv("CHATML_GEMV_ISA", "generic")
    # odd K (masked last vectors, a row shorter than one vector) and odd N (tail tiles); the
    # largest matrix is split over the thread pool and into two column blocks
    shapes = ((37, 19, 0), (5, 7, 3), (200, 513, 5), (1001, 1030, 0), (301, 1024, 6))
    for N, K, offset in shapes:
        w = offset_matrix(N, K, offset, seed=N)
        for M in range(1, 17):
            x = mx.random.normal((M, K), key=mx.random.key(M))
            y = mod.dense_gemv(x, w)
            ref, mag = reference(x, w)
            assert y.shape == (M, N) and y.dtype == mx.float32
            err = np.abs(np.array(y, dtype=np.float64) - ref)
            assert (err <= REL * mag).all(), f"M={M} N={N} K={K}: {(err / mag).max():.2e}"


@pytest.mark.parametrize("form", ["auto", "dot", "outer"])
def test_prefill_rows_match_float64_reference(mod, form):
    """Prefill-sized x (17-512 rows) in both forms, forced and chosen by size: row counts on
    both sides of the switch to outer products, tiles cut short in rows (the last row repeated,
    its sums dropped) and in outputs (N not a multiple of the tile), a K longer than the
    cache."""
    shapes = ((37, 19, 0), (200, 513, 5), (1001, 1030, 0), (96, 3584, 1))
    for N, K, offset in shapes:
        w = offset_matrix(N, K, offset, seed=N)
        for M in (17, 24, 25, 33, 48, 100, 200, 512):
            x = mx.random.normal((M, K), key=mx.random.key(M))
            y = mod.dense_gemv(x, w, form=form)
            ref, mag = reference(x, w)
            assert y.shape == (M, N) and y.dtype == mx.float32
            err = np.abs(np.array(y, dtype=np.float64) - ref)
            assert (err <= REL * mag).all(), f"{form} M={M} N={N} K={K}: {(err / mag).max():.2e}"
    # more rows than one call of the kernel has ever been sent (the packing's blocks grow)
    w = offset_matrix(37, 19, 0, seed=37)
    x = mx.random.normal((3100, 19), key=mx.random.key(3100))
    ref, mag = reference(x, w)
    err = np.abs(np.array(mod.dense_gemv(x, w, form=form), dtype=np.float64) - ref)
    assert (err <= REL * mag).all()
    with pytest.raises(ValueError, match='form must be "auto", "dot" or "outer", not "gemm"'):
        mod.dense_gemv(x, w, form="gemm")


def test_outer_products_give_a_row_the_same_bits_in_any_company(mod):
    """In the outer-product form each output is one running sum over K in k order, whichever
    block of rows it sits in and however K is cut into slabs (512 rows: slabs of 128
    columns; 48 rows: of 1360; 16 rows: one slab): the rows of a long prefill get exactly what
    they get alone."""
    w = offset_matrix(200, 3584, 3, seed=7)
    x = mx.random.normal((512, 3584), key=mx.random.key(8))
    whole = np.array(mod.dense_gemv(x, w, form="outer"))
    for m0, m1 in ((0, 16), (100, 148), (495, 512)):
        alone = np.array(mod.dense_gemv(x[m0:m1], w, form="outer"))
        assert np.array_equal(alone, whole[m0:m1]), (m0, m1)


def test_matches_mlx_matmul_at_every_phase(mod):
    for offset in range(16):  # 16 floats: every placement of a row in a 64-byte line
        w = offset_matrix(96, 1024, offset, seed=offset)
        x = mx.random.normal((4, 1024), key=mx.random.key(offset))
        got, want = np.array(mod.dense_gemv(x, w)), np.array(x @ w.T)
        _, mag = reference(x, w)
        assert (np.abs(got - want) <= 1e-5 * mag).all(), offset


def test_compile_views_and_bad_input(mod):
    w = mx.random.normal((300, 77), key=mx.random.key(1))
    x = mx.random.normal((5, 77), key=mx.random.key(2))
    step = mx.compile(lambda a: mx.tanh(native.dense_matmul(2 * a, w)) + 1)
    ref, mag = reference(2 * x, w)
    want = np.tanh(ref) + 1
    for _ in range(2):  # traced, then replayed
        assert np.abs(np.array(step(x)) - want).max() < 1e-5
    # leading dims, a transposed weight, a transposed and a sliced x: copied to row-major
    x3 = mx.random.normal((2, 3, 77), key=mx.random.key(3))
    wt = mx.random.normal((77, 300), key=mx.random.key(4)).T
    xt = mx.random.normal((77, 5), key=mx.random.key(5)).T
    xs = mx.random.normal((5, 100), key=mx.random.key(6))[:, 10:87]
    for a, b in ((x3, w), (x, wt), (xt, w), (xs, w)):
        y = mod.dense_gemv(a, b)
        ref, mag = reference(a, b)
        assert y.shape == (*a.shape[:-1], 300)
        assert (np.abs(np.array(y, dtype=np.float64).reshape(ref.shape) - ref) <= REL * mag).all()
    with pytest.raises(ValueError, match="x has 10 columns, w has 77 per row"):
        mod.dense_gemv(x[:, :10], w)
    with pytest.raises(ValueError, match="x must be a float32 array"):
        mod.dense_gemv(x.astype(mx.bfloat16), w)
    with pytest.raises(ValueError, match="w must be a 2-D float32 array"):
        mod.dense_gemv(x, w[None])
    with pytest.raises(ValueError, match="w must be a 2-D float32 array"):
        mod.dense_gemv(x, w.astype(mx.float16))


def test_dense_matmul_takes_the_kernel_for_its_rows(mod, monkeypatch):
    calls = []

    class Spy:
        def dense_gemv(self, x, w):
            calls.append(x.shape)
            return mod.dense_gemv(x, w)

    monkeypatch.setattr(native, "module", lambda: Spy())
    w = mx.random.normal((64, 32))
    lo, hi = native.dense_rows()
    assert (lo, hi) == native.DENSE_ROWS[native.info().isa] and 1 <= lo <= 2 < hi
    for rows in (1, 2, hi, hi + 1):
        x = mx.random.normal((rows, 32))
        assert mx.allclose(native.dense_matmul(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    native.dense_matmul(mx.random.normal((4, 32)).astype(mx.bfloat16), w.astype(mx.bfloat16))
    # One row takes the kernel where its table says so (AVX-512); hi + 1 rows and bfloat16
    # stay with MLX.
    assert calls == [(r, 32) for r in (1, 2, hi) if lo <= r]
    # Long rows: the kernel up to LONG_K_ROWS rows only (sgemm's blocking over K pays sooner)
    calls.clear()
    cap = min(hi, native.LONG_K_ROWS)
    w = mx.random.normal((8, native.LONG_K))
    for rows in (2, cap, cap + 1):
        x = mx.random.normal((rows, native.LONG_K))
        assert mx.allclose(native.dense_matmul(x, w), x @ w.T, rtol=1e-4, atol=1e-4)
    assert calls == [(2, native.LONG_K), (cap, native.LONG_K)]


def test_dense_matmul_of_a_weight_without_rows_is_empty(mod):
    """w [0, K] (no outputs) is a valid product, [..., 0], as x @ w.T gives: the kernel,
    which refuses an empty w, is not asked (it raised ValueError from dense_matmul)."""
    x = mx.random.normal((2, 3, 16))
    y = native.dense_matmul(x, mx.zeros((0, 16)))
    assert y.shape == (2, 3, 0) and y.dtype == mx.float32


def test_two_threads_at_once(mod):
    """Two threads (each its own MLX stream) share the kernel's thread pool correctly."""
    w = np.array(mx.random.normal((2048, 512), key=mx.random.key(7)))  # big enough for the pool
    x = np.array(mx.random.normal((6, 512), key=mx.random.key(8)))
    ref, mag = np.float64(x) @ np.float64(w).T, np.abs(np.float64(x)) @ np.abs(np.float64(w)).T
    errors = []

    def worker():
        with mx.stream(mx.new_stream(mx.cpu)):
            xs, ws = mx.array(x), mx.array(w)
            for _ in range(20):
                y = np.array(mod.dense_gemv(xs, ws), dtype=np.float64)
                if not (np.abs(y - ref) <= REL * mag).all():
                    errors.append(np.abs(y - ref).max())

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def batch_logits(model, ids, steps=3):
    """Logits of a prefill of rows `ids` [B, T] then `steps` greedy one-token steps of all rows
    (the compiled per-layer decode path), concatenated over time."""
    caches = model.make_caches()
    out = [model(mx.array(ids), caches)]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), caches))
    return mx.concatenate(out, axis=1)


def test_model_rows_match_the_model_without_the_kernel(tiny, monkeypatch):
    """A forward of B rows through the native layers = the same checkpoint loaded with MLX's
    matmuls (CHATML_NATIVE=0): prefill of 4 x 4 tokens (16 rows) and decode steps of 4 rows."""
    layers = [m for m in tiny.model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    assert layers and all(type(m) in (CpuLinear, CpuEmbedding) for m in layers)
    monkeypatch.setenv("CHATML_NATIVE", "0")
    native.reset()
    plain = engine.load("tiny")
    assert not any(type(m) in (CpuLinear, CpuEmbedding) for m in plain.model.modules())
    monkeypatch.undo()
    native.reset()
    prompts = ["Hello there", "你好", "Tell me a story", "17 x 23"]
    ids = [tiny.tokenizer.encode(p)[:3] for p in prompts]
    ids = [row + [220] * (4 - len(row)) for row in ids]
    got, want = batch_logits(tiny.model, ids), batch_logits(plain.model, ids)
    scale = max(1.0, mx.abs(want).max().item())
    # float32 in another order: MLX alone, batched rows against rows one at a time, differ by
    # up to 7e-6 here (OpenBLAS), and the native path by 1.2e-5 on an AMD EPYC: the bound is
    # the cache contract's float32 1e-4 (DESIGN.md), with the same greedy tokens.
    assert mx.abs(got - want).max().item() <= 1e-4 * scale
    assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item()


def test_doctor_names_the_float32_batch_path(mod, capsys, monkeypatch):
    import json

    from engine.cli import main
    from kernels import blas

    monkeypatch.setattr(blas, "measure_gflops", lambda: 1.0)  # the report, not the speed
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    lo, hi = native.dense_rows()
    isa = native.info().isa
    outer = mod.dense_outer_from()
    assert 0 < outer <= hi or isa == "generic"  # the SIMD kernels switch within their range
    form = f": outer products from {outer} rows" if 0 < outer <= hi else ""
    long_k = f" ({lo}-{native.LONG_K_ROWS} for rows of {native.LONG_K}+ floats)"
    path = (
        f"native GEMV for {lo}-{hi} rows{long_k if native.LONG_K_ROWS < hi else ''} ({isa}{form})"
    )
    assert report["float32_batch_path"].startswith(path)
    assert report["blas_threads"] == blas.threads()
    assert report["delta_decode_path"].startswith("native fused update (")
    assert report["activation_path"] == f"native vectorized pass ({isa})"
    assert report["attention_decode_path"].startswith("native pass over every row's cache")
    assert report["sampling_path"] == "native pass over the vocabulary"
    assert report["blas_core"] == blas.core()  # e.g. SkylakeX; "" when not OpenBLAS
    monkeypatch.setenv("CHATML_NATIVE", "0")
    native.reset()
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    path = report["float32_batch_path"]
    lo, hi = native.dense_rows()  # the portable kernel's, none running
    assert path == f"BLAS sgemm (slower for {lo}-{hi} rows: disabled by CHATML_NATIVE=0)"
    assert report["delta_decode_path"] == (
        "MLX ops, compiled (no fused update: disabled by CHATML_NATIVE=0)"
    )
    assert report["activation_path"] == "MLX ops (scalar exp on x86: disabled by CHATML_NATIVE=0)"
    assert report["attention_decode_path"] == (
        "MLX's scaled_dot_product_attention, row by row (disabled by CHATML_NATIVE=0)"
    )
    assert report["sampling_path"].endswith("vocabulary: disabled by CHATML_NATIVE=0)")
    monkeypatch.undo()
    native.reset()
