"""Joined decode projections (engine/runtime/fused.py): a layer's projections of one input
run as one product in decode steps, with the same logits as separate products, and memory
unchanged: the separate layers' parameters become row views of the joined matrix, which the
native kernels read in place (MLX's contiguous() copied such a view on every call)."""

import mlx.core as mx
import numpy as np
import pytest

import engine
import engine.engine as engine_module
from engine.runtime.fused import join_projections
from engine.runtime.generate import prefill


def test_kernels_read_row_views_in_place(mod):
    w = mx.random.normal((3000, 512), key=mx.random.key(0))
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((1, 512), key=mx.random.key(1))
    mx.eval(w, q, s, b, x)
    views = [w[1000:2500], q[1000:2500], s[1000:2500], b[1000:2500]]
    copies = [v + 0 if v.dtype != mx.uint32 else v * 1 for v in views]
    mx.eval(views, copies)
    wv, qv, sv, bv = views
    wc, qc, sc, bc = copies
    for got, want, view_bytes in (
        (lambda: mod.dense_gemv(x, wv), lambda: mod.dense_gemv(x, wc), wv.nbytes),
        (lambda: mod.quantized_gemv(x, qv, sv, bv, 64, 4),
         lambda: mod.quantized_gemv(x, qc, sc, bc, 64, 4), qv.nbytes),
    ):  # fmt: skip
        expected = want()
        mx.eval(expected)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        y = got()
        mx.eval(y)
        assert mx.get_peak_memory() - before < view_bytes / 4  # no copy of the weights
        assert mx.array_equal(y, expected).item()


def _decode_logits(net, ids, steps=3):
    caches = net.make_caches()
    prefill(net, caches, ids[:-steps], 0)
    return [net(mx.array([[t]]), caches)[0, -1] for t in ids[-steps:]]


@pytest.mark.parametrize("quantize", [None, 4])
def test_joined_decode_equals_separate_products(monkeypatch, quantize):
    joined = engine.load("tiny", quantize=quantize).model
    monkeypatch.setattr(engine_module, "join_projections", lambda net: 0)
    separate = engine.load("tiny", quantize=quantize).model
    layers = joined.layers
    assert all(
        (layer.linear_attn if layer.is_linear else layer.self_attn).joined is not None
        and layer.mlp.joined is not None
        for layer in layers
    )
    assert all(layer.mlp.joined is None for layer in separate.layers)
    ids = list(range(300, 340))
    for a, b in zip(_decode_logits(joined, ids), _decode_logits(separate, ids), strict=True):
        assert mx.array_equal(a, b).item()  # each output row is the same dot product
    # the parts are views of the joined matrix: their rows, and no second copy
    mlp = layers[0].mlp
    gate = np.array(mlp.joined.layer["weight"][: mlp.gate_proj["weight"].shape[0]])
    assert (np.array(mlp.gate_proj["weight"]) == gate).all()


def test_joining_keeps_memory(monkeypatch):
    monkeypatch.setattr(engine_module, "join_projections", lambda net: 0)
    net = engine.load("tiny").model
    mx.eval(net.parameters())
    before = mx.get_active_memory()
    assert join_projections(net) == 2 * len(net.layers)
    after = mx.get_active_memory()
    assert after <= before * 1.01, (before, after)
