"""The vectorized gates, causal softmax and per-row decode attention
(kernels/native/activations.cpp and attention.cpp, through kernels.activations and
kernels.attention) against a float64 numpy reference, on awkward inputs, and in the model
against MLX's ops.

Tolerance: 1e-6 relative per element (the kernel's exp is within ~2 ulp, so silu and sigmoid
land within a few float32 ulps, ~1e-7; 1e-6 leaves room without hiding a wrong polynomial,
which is off by 1e-4 or more). The conv sums K products in float32 in tap order, as MLX's
ops do: its tolerance is float32 rounding of the sum of magnitudes.
"""

import mlx.core as mx
import numpy as np
import pytest

from kernels import activations
from kernels.attention import attention, attention_rows

REL = 1e-6


def sigmoid64(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def f64(a: mx.array) -> np.ndarray:
    return np.array(a).astype(np.float64)


def close(got: mx.array, ref: np.ndarray, rel: float = REL) -> None:
    g = f64(got)
    assert g.shape == ref.shape
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(ref))
    np.testing.assert_array_equal(g[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)])
    # below float32's normal range (1.2e-38) results may flush to 0, as MLX's do
    err = np.abs(g[finite] - ref[finite])
    assert (err <= rel * np.abs(ref[finite]) + 1e-37).all(), f"max error {err.max():.2e}"


# 1 and 15 floats: shorter than a vector; 4099: a tail after whole vectors; 100003: split
# over the thread pool with a ragged last part
@pytest.mark.parametrize("n", [1, 15, 4099, 100003])
def test_gates_match_float64(mod, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 8).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    a, b = mx.array(x), mx.array(y)
    close(activations.silu_mul(a, b, native=True), xd * sigmoid64(xd) * yd)
    close(activations.mul_sigmoid(b, a, native=True), yd * sigmoid64(xd))
    close(mod.silu(a), xd * sigmoid64(xd))
    close(activations.exp(a, native=True), np.exp(xd))  # |x| < 88 here: no overflow


def test_extremes(mod):
    """exp's range ends: underflow to 0 below -87.3, overflow to inf above 88.7 (so sigmoid
    saturates at 0 and 1), infinities and NaN as float math has them."""
    x = np.array([0.0, -87.0, -87.4, -88.0, -100.0, -1e30, 88.0, 88.8, 100.0, 1e30,
                  np.inf, -np.inf, np.nan, 1e-30, -1e-30, 20.0], dtype=np.float32)  # fmt: skip
    xd = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        ref_silu = xd * sigmoid64(xd)
    ref_silu[np.isneginf(xd)] = np.nan  # -inf * 0
    close(mod.silu(mx.array(x)), ref_silu)
    ones = mx.ones(x.shape)
    close(activations.mul_sigmoid(ones, mx.array(x), native=True), sigmoid64(xd))
    with np.errstate(over="ignore"):
        ref_exp = np.exp(xd)
    ref_exp[ref_exp > np.finfo(np.float32).max] = np.inf  # float32 overflows above 88.72
    close(activations.exp(mx.array(x), native=True), ref_exp)  # exp(-inf) = 0


def test_views_and_inputs_left_alone(mod):
    """Transposed and sliced inputs read right; an input still referenced afterwards is not
    overwritten (the kernel writes in place only over arrays nobody else holds)."""
    a = mx.random.normal((64, 48), key=mx.random.key(1))
    b = mx.random.normal((48, 64), key=mx.random.key(2))
    at, bt = a.T, b[:, ::-1]  # [48, 64] views: transposed, reversed columns
    before = np.array(at)
    got = activations.silu_mul(at, bt, native=True)
    ref = f64(at) * sigmoid64(f64(at)) * f64(bt)
    close(got, ref)
    np.testing.assert_array_equal(np.array(at), before)
    # a lazy input nobody else holds (donated): same values
    close(activations.mul_sigmoid(a * 2, b.T, native=True), f64(a) * 2 * sigmoid64(f64(b.T)))
    # The views a batched step hands over: each half of a joined projection's rows (rows
    # apart, each row in one piece), heads of wider rows, and a run of two dimensions
    # inside a third; copied a run at a time.
    joined = mx.random.normal((4, 2 * 37), key=mx.random.key(3))
    gate, up = joined[:, :37], joined[:, 37:]
    close(activations.silu_mul(gate, up, native=True), f64(gate) * sigmoid64(f64(gate)) * f64(up))
    x = mx.random.normal((3, 2, 5, 7), key=mx.random.key(4))
    heads, other = x[:, 1:], x[:, :1]  # [3, 1, 5, 7]: runs of 35 floats, 70 apart
    close(activations.mul_sigmoid(heads, other, native=True), f64(heads) * sigmoid64(f64(other)))
    mid = x[:, :, 1:4]  # [3, 2, 3, 7]: runs of 21 floats, 35 apart
    close(activations.silu_mul(mid, mid, native=True), f64(mid) * sigmoid64(f64(mid)) * f64(mid))


@pytest.mark.parametrize(
    "B,T,C,K", [(1, 1, 6144, 4), (2, 5, 37, 4), (1, 100, 1030, 4), (3, 7, 16, 2)]
)
def test_conv_silu_matches_float64(mod, B, T, C, K):
    key = mx.random.key(T * C)
    window = mx.random.normal((B, K - 1 + T, C), key=key)
    weight = mx.random.normal((C, K), key=mx.random.key(K))
    w, x = f64(weight), f64(window)
    conv = sum(x[:, j : j + T] * w[:, j] for j in range(K))
    mag = sum(np.abs(x[:, j : j + T] * w[:, j]) for j in range(K))
    ref = conv * sigmoid64(conv)
    got = f64(activations.conv_silu(window, weight, native=True))
    assert got.shape == (B, T, C)
    # silu'(s) <= 1.1: the conv's float32 rounding (a few ulps of `mag`) carries through
    assert (np.abs(got - ref) <= 1e-6 * mag + REL * np.abs(ref)).all()
    mlx_ops = f64(activations.conv_silu(window, weight, native=False))
    assert (np.abs(got - mlx_ops) <= 2e-6 * mag + 2 * REL * np.abs(ref)).all()


def test_a_temporary_input_is_written_in_place(mod):
    """A gate's input that nobody else holds (an intermediate of the graph) gives its buffer
    to the output: the pass adds one buffer to the peak, not two."""
    n = 1 << 22  # 16 MiB of float32
    a = mx.random.normal((n,), key=mx.random.key(0))
    mx.eval(a)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    y = activations.silu_mul(a * 2, a, native=True)
    mx.eval(y)
    assert mx.get_peak_memory() - base < 1.5 * n * 4
    assert mx.array_equal(y, activations.silu_mul(mx.array(np.array(a * 2)), a, native=True))


@pytest.mark.parametrize("groups, C, K", [([1], 6144, 4), ([1, 1, 1], 37, 4), ([2, 1, 5], 40, 4),
                                           ([1, 2], 16, 2)])  # fmt: skip
def test_conv_silu_rows_match_the_window(mod, groups, C, K):
    """One token of B rows, each row's conv tail its own array (or a few rows stacked):
    y is conv_silu over the window [tail, x] bit for bit (the same sums in the same order),
    within the float64 conv's bound, and each new tail is the window's last K-1 inputs."""
    B = sum(groups)
    key = mx.random.key(B * C + K)
    window = mx.random.normal((B, K, C), key=key)
    weight = mx.random.normal((C, K), key=mx.random.key(K))
    tails, at = [], 0
    for n in groups:  # own buffers, as a cache holds them
        tails.append(mx.array(np.array(window[at : at + n, :-1])))
        at += n
    x = mx.array(np.array(window[:, -1]))
    y, after = activations.conv_silu_rows(x, weight, tails, native=True)
    assert mx.array_equal(y, activations.conv_silu(window, weight, native=True)[:, 0])
    w, xs = f64(weight), f64(window)
    conv = sum(xs[:, j] * w[:, j] for j in range(K))
    mag = sum(np.abs(xs[:, j] * w[:, j]) for j in range(K))
    assert (np.abs(f64(y) - conv * sigmoid64(conv)) <= 1e-6 * mag + REL * np.abs(conv)).all()
    assert [a.shape for a in after] == [t.shape for t in tails]
    assert mx.array_equal(mx.concatenate(after), window[:, 1:])
    y_ops, after_ops = activations.conv_silu_rows(x, weight, tails, native=False)
    assert (np.abs(f64(y_ops) - f64(y)) <= 2e-6 * mag + 2 * REL * np.abs(conv)).all()
    assert all(mx.array_equal(a, b) for a, b in zip(after_ops, after))


def test_conv_silu_rows_leave_held_tails_alone(mod):
    """A tail someone still holds (a snapshot shares it) is never overwritten; one nobody
    holds may be updated in place, with the same result."""
    x = mx.random.normal((2, 24), key=mx.random.key(1))
    weight = mx.random.normal((24, 4), key=mx.random.key(2))
    base = np.array(mx.random.normal((2, 3, 24), key=mx.random.key(3)))
    held = [mx.array(base[:1]), mx.array(base[1:])]
    y, after = activations.conv_silu_rows(x, weight, held, native=True)
    mx.eval(y, after)
    assert all(np.array_equal(np.array(t), base[i : i + 1]) for i, t in enumerate(held))
    y2, again = activations.conv_silu_rows(
        x, weight, [mx.array(base[:1]), mx.array(base[1:])], native=True
    )
    assert mx.array_equal(y2, y) and all(mx.array_equal(a, b) for a, b in zip(again, after))


def attention64(q, k, v, scale):
    """Causal grouped-query attention in float64, the T queries being the last of S."""
    q, k, v = f64(q), f64(k), f64(v)
    B, Hq, T, D = q.shape
    S, r = k.shape[2], Hq // k.shape[1]
    k, v = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale
    seen = np.arange(S)[None, :] <= (S - T + np.arange(T))[:, None]
    scores = np.where(seen, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


# T = S (a first prefill), T < S (a later chunk), T = 1 (decode: MLX's kernel), one key head
# per query head and 4 per key head, S below one SIMD vector
@pytest.mark.parametrize(
    "T,S,Hq,Hkv", [(37, 37, 8, 2), (20, 300, 4, 4), (1, 50, 8, 2), (3, 5, 2, 1)]
)
def test_attention_matches_float64(mod, T, S, Hq, Hkv):
    D = 64
    q = mx.random.normal((2, Hq, T, D), key=mx.random.key(T))
    k = mx.random.normal((2, Hkv, S, D), key=mx.random.key(S))
    v = mx.random.normal((2, Hkv, S, D), key=mx.random.key(S + 1))
    ref = attention64(q, k, v, D**-0.5)
    for use in (True, False):
        got = f64(attention(q, k, v, D**-0.5, native=use))
        assert np.abs(got - ref).max() <= 1e-5, (use, np.abs(got - ref).max())


# Rows of different lengths in buffers with room to spare (whose unused positions hold NaN:
# never read): one decode query a row (0.8B's heads), a short verify pass, one key head, key
# and value widths that differ and are not whole vectors, a row as short as its queries.
@pytest.mark.parametrize(
    "T,lengths,Hq,Hkv,Dk,Dv",
    [(1, [1000], 8, 2, 256, 256), (1, [5, 300, 77], 8, 2, 256, 256),
     (3, [3, 50], 6, 3, 40, 24), (4, [7, 8, 100, 4], 2, 1, 17, 33)],
)  # fmt: skip
def test_attention_rows_match_float64(mod, T, lengths, Hq, Hkv, Dk, Dv):
    B = len(lengths)
    q = mx.random.normal((B, Hq, T, Dk), key=mx.random.key(T))
    keys, values = [], []
    for b, n in enumerate(lengths):
        nan = float("nan")
        k = mx.random.normal((1, Hkv, n, Dk), key=mx.random.key(n))
        v = mx.random.normal((1, Hkv, n, Dv), key=mx.random.key(n + 9999))
        keys.append(mx.concatenate([k, mx.full((1, Hkv, 9 + b, Dk), nan)], axis=2))
        values.append(mx.concatenate([v, mx.full((1, Hkv, 9 + b, Dv), nan)], axis=2))
    ref = np.concatenate([
        attention64(q[b : b + 1], k[:, :, :n], v[:, :, :n], Dk**-0.5)
        for b, (k, v, n) in enumerate(zip(keys, values, lengths))
    ])  # fmt: skip
    for use in (True, False):  # the native pass, and MLX's op row by row
        got = f64(attention_rows(q, keys, values, lengths, Dk**-0.5, native=use))
        assert got.shape == (B, Hq, T, Dv)
        assert np.abs(got - ref).max() <= 1e-5, (use, np.abs(got - ref).max())


def test_attention_rows_take_each_row_as_alone(mod):
    """A row's output is the same bits in a batch of rows as alone: a batched decode step's
    row attends as that sequence decoding by itself does."""
    lengths = [40, 513, 7]
    q = mx.random.normal((3, 8, 1, 64), key=mx.random.key(1))
    keys = [mx.random.normal((1, 2, 600, 64), key=mx.random.key(n)) for n in lengths]
    values = [mx.random.normal((1, 2, 600, 64), key=mx.random.key(n + 9999)) for n in lengths]
    together = mod.attention_rows(q, keys, values, lengths, 0.125)
    for b, n in enumerate(lengths):
        alone = mod.attention_rows(q[b : b + 1], keys[b : b + 1], values[b : b + 1], [n], 0.125)
        assert mx.array_equal(together[b : b + 1], alone)


def test_causal_softmax_rows(mod):
    """Each row sums to 1 over the keys it sees and is 0 beyond; -inf scores give 0."""
    # scores of spread 30 (a float32 x - max carries |x - max| * 6e-8 relative error into exp)
    x = mx.random.normal((3, 6, 40), key=mx.random.key(9)) * 30
    x[0, 2, 5] = -float("inf")
    p = np.array(mod.causal_softmax(x))
    seen = np.arange(40)[None, :] <= (34 + np.arange(6))[:, None]
    assert (p[:, ~seen] == 0).all() and p[0, 2, 5] == 0
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    xd = np.where(seen, f64(x), -np.inf)
    ref = np.exp(xd - xd.max(-1, keepdims=True))
    spread = np.nan_to_num(np.abs(xd - xd.max(-1, keepdims=True)), posinf=0.0)  # -inf: p is 0
    err = np.abs(p - ref / ref.sum(-1, keepdims=True))[:, seen]
    assert (err <= ((spread[:, seen] + 2) * 1.2e-7) * p[:, seen] + 1e-37).all()


def test_other_dtypes_and_shapes_take_mlx_ops(mod):
    """bfloat16, broadcasting shapes and native=False give MLX's own ops, bit for bit."""
    a = mx.random.normal((4, 32), key=mx.random.key(3))
    b = mx.random.normal((32,), key=mx.random.key(4))
    assert mx.array_equal(activations.mul_sigmoid(a, b, native=True), a * mx.sigmoid(b))
    h = a.astype(mx.bfloat16)
    out = activations.silu_mul(h, h, native=True)
    assert out.dtype == mx.bfloat16
    assert mx.array_equal(out, mx.sigmoid(h) * h * h)
    assert mx.array_equal(activations.silu_mul(a, a, native=False), mx.sigmoid(a) * a * a)
    window = mx.random.normal((1, 8, 32), key=mx.random.key(5)).astype(mx.bfloat16)
    weight = mx.random.normal((32, 4), key=mx.random.key(6))
    assert activations.conv_silu(window, weight, native=True).dtype == mx.bfloat16
    assert mx.array_equal(activations.conv_silu(window, weight, native=True),
                          activations.conv_silu(window, weight, native=False))  # fmt: skip


def test_bad_input_is_named(mod):
    with pytest.raises(ValueError, match="float32"):
        mod.silu_mul(mx.ones((2,), dtype=mx.float16), mx.ones((2,), dtype=mx.float16))
    with pytest.raises(ValueError, match="one shape"):
        mod.mul_sigmoid(mx.ones((2, 3)), mx.ones((3,)))
    with pytest.raises(ValueError, match=r"0 < T <= S"):
        mod.causal_softmax(mx.ones((2, 5, 3)))
    with pytest.raises(ValueError, match=r"window \[B, K-1\+T, C\]"):
        mod.conv_silu(mx.ones((1, 2, 8)), mx.ones((8, 4)))
    with pytest.raises(ValueError, match=r"tails \[rows, K-1, C\] = \[rows, 3, 8\]"):
        mod.conv_silu_rows(mx.ones((2, 8)), mx.ones((8, 4)), [mx.ones((2, 2, 8))])
    with pytest.raises(ValueError, match="the tails hold 1 rows, x has B = 2"):
        mod.conv_silu_rows(mx.ones((2, 8)), mx.ones((8, 4)), [mx.ones((1, 3, 8))])
    q, kv = mx.ones((2, 8, 1, 16)), [mx.ones((1, 2, 10, 16))] * 2
    with pytest.raises(ValueError, match="one length per row"):
        mod.attention_rows(q, kv, kv, [3], 1.0)
    with pytest.raises(
        ValueError, match=r"row 1: its length 11 must be at least T \(1\) and at most"
    ):
        mod.attention_rows(q, kv, kv, [3, 11], 1.0)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        mod.attention_rows(mx.ones((2, 3, 1, 16)), kv, kv, [3, 3], 1.0)
    with pytest.raises(ValueError, match="row 0: keys"):
        mod.attention_rows(q, [mx.ones((1, 2, 10, 8))] * 2, kv, [3, 3], 1.0)


def test_model_logits_match_mlx_ops(tiny):
    """tiny with the native gates against the same weights on MLX's ops: a 40-token prefill
    (the chunked path), then decode steps (the compiled one-token path)."""
    from engine.runtime.generate import prefill
    from engine.runtime.model import ModelOptions, Qwen35

    assert tiny.model.layers[0].linear_attn.options.native_activations  # CPU float32 default
    plain = Qwen35(tiny.model.arch, ModelOptions(native_activations=False))
    plain.update(tiny.model.parameters())
    ids = list(range(3000, 3040))
    outs = []
    for net in (tiny.model, plain):
        caches = net.make_caches()
        logits, _ = prefill(net, caches, ids, 0)
        steps = [logits]
        for token in (11, 12, 13):
            steps.append(net(mx.array([[token]]), caches)[0, -1])
        outs.append(mx.stack(steps))
    native_out, ops_out = (np.array(o) for o in outs)
    assert np.abs(native_out - ops_out).max() <= 1e-4 * max(1.0, np.abs(ops_out).max())
    assert (native_out.argmax(-1) == ops_out.argmax(-1)).all()
