"""kernels.gated_delta (chunked gated delta rule) against a float64 sequential recurrence."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without an install

import mlx.core as mx  # noqa: E402

from kernels import (  # noqa: E402
    gated_delta,
    gated_delta_kept,
    gated_delta_reference,
    gated_delta_rows,
    native,
    unit_lower_inverse,
)
from kernels.choice import device_kind  # noqa: E402

TOL = 1e-5  # max abs error allowed, relative to the reference output's max abs value


def make_inputs(
    T: int,
    *,
    B: int = 1,
    Hk: int = 2,
    Hv: int = 2,
    D: int = 32,
    g_range: tuple[float, float] = (0.9, 1.0),
    with_state: bool = False,
    seed: int = 0,
) -> list[mx.array | None]:
    """Realistic inputs: q, k L2-normalized per head (q also scaled by D**-0.5 as the
    model's normalize_qk does), beta in (0, 1), decays in g_range."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, D))
    k = rng.standard_normal((B, T, Hk, D))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(D)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, D))
    g = rng.uniform(*g_range, (B, T, Hv))
    beta = rng.uniform(0.0, 1.0, (B, T, Hv))
    state = rng.standard_normal((B, Hv, D, D)) * 0.5 if with_state else None
    arrays = [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta)]
    return [*arrays, None if state is None else mx.array(state.astype(np.float32))]


def assert_close(inputs: list, **kwargs) -> None:
    y_ref, s_ref = gated_delta_reference(*inputs)
    y, s = gated_delta(*inputs, **kwargs)
    assert y.dtype == inputs[0].dtype and s.dtype == mx.float32
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    err_y = np.abs(np.array(y, dtype=np.float64) - y_ref).max()
    err_s = np.abs(np.array(s, dtype=np.float64) - s_ref).max()
    assert err_y <= TOL * max(np.abs(y_ref).max(), 1e-30), err_y
    assert err_s <= TOL * max(np.abs(s_ref).max(), 1e-30), err_s


@pytest.mark.parametrize("T", [1, 2, 15])
@pytest.mark.parametrize("Hk, Hv", [(2, 2), (2, 4), (4, 8)])
@pytest.mark.parametrize("with_state", [False, True])
def test_step_matches_reference(T: int, Hk: int, Hv: int, with_state: bool) -> None:
    inputs = make_inputs(T, B=2, Hk=Hk, Hv=Hv, with_state=with_state, seed=Hv + T)
    assert_close(inputs, method="step")


def test_step_refuses_a_prefill() -> None:
    from kernels.choice import MAX_STEP_T

    with pytest.raises(ValueError, match="at most"):
        gated_delta(*make_inputs(MAX_STEP_T + 1), method="step")


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 1000, 4096])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("Hv", [2, 4])
def test_chunked_matches_reference(T: int, with_state: bool, Hv: int) -> None:
    assert_close(make_inputs(T, Hv=Hv, with_state=with_state), method="chunked")


@pytest.mark.parametrize("T", [1, 8, 65])
def test_auto_and_sequential_match_reference(T: int) -> None:
    inputs = make_inputs(T, Hv=4, with_state=True, seed=1)
    assert_close(inputs, method="auto")
    assert_close(inputs, method="sequential")


@pytest.mark.parametrize(
    "T, keep, method",
    [
        (200, [1, 20, 63, 64, 65, 128, 150, 199], "chunked"),  # inside, at and after chunk ends
        (70, [64], "chunked"),
        (130, [5, 6, 7, 129], "auto"),
        (12, [1, 5, 11], "auto"),  # short: one piece after another (fused or step)
        (40, [3, 39], "sequential"),
    ],
)
@pytest.mark.parametrize("Hv", [2, 4])
def test_kept_states_match_the_reference_at_each_position(T, keep, method, Hv) -> None:
    assert_kept_close(make_inputs(T, Hv=Hv, with_state=True, seed=T + Hv), keep, method)


def assert_kept_close(inputs: list, keep: list[int], method: str) -> None:
    """`gated_delta_kept`'s output, final state and the states at `keep` against the float64
    recurrence run up to each of those positions."""
    q, k, v, g, beta, state = inputs
    y, s, kept = gated_delta_kept(q, k, v, g, beta, state, keep, method=method)
    y_ref, s_ref = gated_delta_reference(q, k, v, g, beta, state)
    wanted = [gated_delta_reference(q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p], state)[1]
              for p in keep]  # fmt: skip
    assert len(kept) == len(keep)
    for got, ref in [(y, y_ref), (s, s_ref), *zip(kept, wanted)]:
        assert got.shape == ref.shape
        err = np.abs(np.array(got, dtype=np.float64) - ref).max()
        assert err <= TOL * np.abs(ref).max(), err


@pytest.mark.parametrize("keep", [[0], [5, 3], [4, 4], [12], [-1]])
def test_kept_positions_must_be_inside_and_increasing(keep) -> None:
    with pytest.raises(ValueError, match="keep must be increasing"):
        gated_delta_kept(*make_inputs(12), keep)


@pytest.mark.parametrize("g_range", [(1e-4, 1e-2), (0.2, 0.6), (0.999, 1.0), (1.0, 1.0)])
@pytest.mark.parametrize("with_state", [False, True])
def test_extreme_decays(g_range: tuple[float, float], with_state: bool) -> None:
    assert_close(make_inputs(300, g_range=g_range, with_state=with_state), method="chunked")


def test_blocked_inverse_path_matches_reference() -> None:
    # The matmul-only inverse used on GPUs, exercised on the CPU.
    assert_close(make_inputs(200, Hv=4, with_state=True), method="chunked", inverse="blocked")


def test_batch_and_bigger_heads() -> None:
    assert_close(make_inputs(130, B=2, Hk=2, Hv=4, D=64, with_state=True), method="chunked")


def test_bfloat16_inputs_return_bfloat16() -> None:
    q, k, v, g, beta, state = make_inputs(100, with_state=True)
    q, k, v = (x.astype(mx.bfloat16) for x in (q, k, v))
    y, s = gated_delta(q, k, v, g, beta, state, method="chunked")
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    y_ref, s_ref = gated_delta_reference(q.astype(mx.float32), k, v, g, beta, state)
    # Computed in float32; only the final cast of y to bfloat16 loses precision.
    assert np.abs(np.array(y.astype(mx.float32)) - y_ref).max() <= 1e-2 * np.abs(y_ref).max()
    assert np.abs(np.array(s) - s_ref).max() <= TOL * np.abs(s_ref).max()


@pytest.mark.parametrize("inverse", ["native", "lapack", "blocked"])
def test_correlated_keys_stay_finite(inverse: str) -> None:
    # Nearly identical keys and beta ~ 1 make I + A badly conditioned for series inverses.
    rng = np.random.default_rng(3)
    T, H, D = 256, 2, 32
    base = rng.standard_normal(D)
    k = base + 1e-4 * rng.standard_normal((1, T, H, D))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = k / np.sqrt(D)
    v = rng.standard_normal((1, T, H, D))
    g = np.ones((1, T, H))
    beta = np.full((1, T, H), 0.999)
    inputs = [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta)]
    y, s = gated_delta(*inputs, method="chunked", inverse=inverse)
    assert np.isfinite(np.array(y)).all() and np.isfinite(np.array(s)).all()
    y_ref, _ = gated_delta_reference(*inputs)
    assert np.abs(np.array(y) - y_ref).max() <= 1e-3 * np.abs(y_ref).max()


@pytest.mark.parametrize("n", [5, 16, 17, 64, 100])
@pytest.mark.parametrize("scale", [0.3, 1e-20])  # 1e-20: products below float32's normals
def test_unit_lower_inverse_methods_agree(n: int, scale: float) -> None:
    rng = np.random.default_rng(n)
    a = np.tril(rng.standard_normal((3, n, n)) * scale, -1) + np.eye(n)
    ref = np.linalg.inv(a)
    # The upper triangle is never read (the chunked rule masks it; here it holds noise).
    noisy = (a + np.triu(rng.standard_normal((3, n, n)), 1)).astype(np.float32)
    for method in ("native", "lapack", "blocked"):
        given = noisy if method == "native" else a.astype(np.float32)
        inv = np.array(unit_lower_inverse(mx.array(given), method=method))
        assert np.abs(inv - ref).max() <= 1e-4 * np.abs(ref).max(), method
        assert (np.triu(inv, 1) == 0).all() and (np.diagonal(inv, axis1=1, axis2=2) == 1).all()


def test_native_methods_say_why_without_the_module(monkeypatch) -> None:
    monkeypatch.setenv("CHATML_NATIVE", "0")
    native.reset()
    try:
        with pytest.raises(RuntimeError, match="method 'native' needs the native CPU kernels"):
            unit_lower_inverse(mx.eye(4), method="native")
        assert np.allclose(np.array(unit_lower_inverse(mx.eye(4))), np.eye(4))  # auto: lapack
        with pytest.raises(RuntimeError, match="method 'fused' needs the native CPU kernels"):
            gated_delta(*make_inputs(4), method="fused")
    finally:
        monkeypatch.undo()
        native.reset()


def test_unit_lower_inverse_native_refuses_what_it_cannot_invert() -> None:
    with pytest.raises(ValueError, match=r"float32 matrices \[\.\.\., n, n\]"):
        unit_lower_inverse(mx.zeros((2, 3, 4)), method="native")
    with pytest.raises(ValueError, match="float32"):
        unit_lower_inverse(mx.eye(4, dtype=mx.bfloat16), method="native")


def test_rejects_bad_head_ratio() -> None:
    q, k, v, g, beta, _ = make_inputs(4, Hk=2, Hv=2)
    v3 = mx.concatenate([v, v[:, :, :1]], axis=2)
    g3 = mx.concatenate([g, g[:, :, :1]], axis=2)
    with pytest.raises(ValueError):
        gated_delta(q, k, v3, g3, mx.concatenate([beta, beta[:, :, :1]], axis=2))


@pytest.fixture(scope="module")
def built():
    """The native module, which holds the fused kernel (CI has a compiler: it must build)."""
    assert native.module() is not None, native.info().reason


def split_rows(state: mx.array, groups: list[int]) -> list[mx.array]:
    """`state [B, ...]` as separate arrays of `groups[i]` rows each (copies: own buffers)."""
    out, at = [], 0
    for n in groups:
        out.append(mx.array(np.array(state[at : at + n])))
        at += n
    return out


def assert_rows_close(inputs: list, groups: list[int], method: str) -> None:
    """`gated_delta_rows` over the states split into `groups` against the float64 recurrence."""
    *qkvgb, state = inputs
    y_ref, s_ref = gated_delta_reference(*inputs)
    y, states = gated_delta_rows(*qkvgb, split_rows(state, groups), method=method)
    assert [s.shape[0] for s in states] == groups and all(s.dtype == mx.float32 for s in states)
    s = np.concatenate([np.array(x, dtype=np.float64) for x in states])
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert np.abs(np.array(y, dtype=np.float64) - y_ref).max() <= TOL * np.abs(y_ref).max()
    assert np.abs(s - s_ref).max() <= TOL * np.abs(s_ref).max()


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("B, groups", [(1, [1]), (3, [1, 1, 1]), (8, [2, 1, 5])])
@pytest.mark.parametrize("Hk, Hv", [(2, 2), (2, 4), (4, 8)])
def test_fused_rows_match_reference(built, T, B, groups, Hk, Hv) -> None:
    """The native one-pass update (each row's state its own array, or a few rows stacked)
    against the sequential recurrence in float64; the MLX fallback (stack, step, split) too."""
    inputs = make_inputs(T, B=B, Hk=Hk, Hv=Hv, with_state=True, seed=B * 10 + Hv + T)
    assert_rows_close(inputs, groups, "fused")
    assert_rows_close(inputs, groups, "step")


@pytest.mark.parametrize("T, keep", [(16, [8]), (100, [1, 37, 64, 99]), (127, []),
                                     (300, [7, 129, 299])])  # fmt: skip
def test_fused_prefill_segments_match_reference(built, T, keep) -> None:
    """Prefills take the native one-pass update on the CPU: whole, and with the states at
    ChatML boundaries kept, against the float64 recurrence."""
    assert_kept_close(make_inputs(T, Hk=2, Hv=4, with_state=True, seed=T), keep, "fused")


def test_fused_odd_head_sizes(built) -> None:
    """Dk not a multiple of the vector width (a masked tail) and Dv != Dk, heads split over
    the thread pool (a 0.8B head shape at B = 2). From 8 tokens on, the state rows go in
    blocks of one or two vector widths (8 or 16 rows each) with the rows past the last block
    one by one: Dv = 24, 40 and 56 leave both kinds of block and a tail, Dk = 37 the
    odd columns of a block."""
    rng = np.random.default_rng(7)
    for B, T, Hk, Hv, Dk, Dv in ((2, 2, 2, 4, 40, 24), (2, 1, 16, 16, 128, 128),
                                 (2, 9, 2, 4, 37, 24), (1, 20, 1, 2, 40, 40),
                                 (1, 12, 2, 2, 16, 56), (2, 24, 16, 16, 128, 128)):  # fmt: skip
        q, k = rng.standard_normal((2, B, T, Hk, Dk))
        q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(Dk)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal((B, T, Hv, Dv))
        g, beta = rng.uniform(0.9, 1.0, (B, T, Hv)), rng.uniform(0, 1, (B, T, Hv))
        state = rng.standard_normal((B, Hv, Dv, Dk)) * 0.5
        inputs = [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta, state)]
        assert_rows_close(inputs, [1] * B, "fused")
        assert_close(inputs, method="fused")


def test_fused_leaves_held_states_alone(built) -> None:
    """A state someone still holds (a snapshot) is never overwritten; one nobody holds may be
    updated in place, with the same result."""
    q, k, v, g, beta, state = make_inputs(2, B=2, Hv=4, with_state=True, seed=5)
    held = split_rows(state, [1, 1])
    before = [np.array(s) for s in held]
    y, after = gated_delta_rows(q, k, v, g, beta, held, method="fused")
    mx.eval(y, after)
    for s, b in zip(held, before):
        assert np.array_equal(np.array(s), b)
    y2, again = gated_delta_rows(q, k, v, g, beta, split_rows(state, [1, 1]), method="fused")
    assert np.array_equal(np.array(y2), np.array(y))
    for s, t in zip(again, after):
        assert np.array_equal(np.array(s), np.array(t))


def test_fused_rejects_bad_input(built) -> None:
    q, k, v, g, beta, state = make_inputs(1, B=2, with_state=True)
    with pytest.raises(ValueError, match="hold 1 rows, q has B = 2"):
        gated_delta_rows(q, k, v, g, beta, [state[:1]], method="fused")
    with pytest.raises(ValueError, match=r"= \[rows, 2, 32, 32\], got \[2, 2, 32, 16\]"):
        gated_delta_rows(q, k, v, g, beta, [state[..., :16]], method="fused")
    with pytest.raises(ValueError, match="g and beta must be"):
        gated_delta_rows(q, k, v, g[:, :, :1], beta, [state], method="fused")


# Head shapes (Hk, Hv, Dk, Dv): tiny, 0.8B and 2B, 4B/9B/35B-A3B, 27B.
HEADS = {"tiny": (4, 8, 32, 32), "0.8b": (16, 16, 128, 128), "9b": (16, 32, 128, 128),
         "27b": (16, 48, 128, 128)}  # fmt: skip


@pytest.mark.parametrize("model", sorted(HEADS))
def test_kernel_choice_per_device(model: str) -> None:
    from kernels.choice import MIN_CHUNKED_T, MIN_CHUNKED_T_CUDA, choose

    heads = HEADS[model]
    for t in (1, 7, 16, 64, 127, 128, 512):
        # CPU: decode tokens and short segments as a few broadcast ops each; chunked for
        # prefill once matmuls are fast; sequential mx.fast otherwise.
        short = t < MIN_CHUNKED_T
        assert choose("cpu", *heads, t) == ("step" if short else "chunked")
        assert choose("cpu", *heads, t, fast_matmul=False) == ("step" if short else "sequential")
        # ... and as one native pass per state row where the native module is built, for
        # decode steps and prefills of any length.
        assert choose("cpu", *heads, t, native=True) == "fused"
        assert choose("cuda", *heads, t, native=True) == choose("cuda", *heads, t)
        # CUDA: mx.fast is T steps of small ops there, so prefill goes chunked.
        assert choose("cuda", *heads, t) == ("step" if t < MIN_CHUNKED_T_CUDA else "chunked")
        # Metal: mlx-lm's own kernel, as mlx-lm runs it, for every Qwen3.5 head shape.
        assert choose("metal", *heads, t) == "mlx_lm"


def test_kernel_choice_outside_the_known_shapes() -> None:
    from kernels.choice import choose

    assert choose("metal", 2, 2, 48, 48, 64) == "sequential"  # mlx-lm's kernel needs Dk % 32
    with pytest.raises(ValueError, match="unknown device"):
        choose("tpu", 16, 16, 128, 128, 1)


def test_auto_follows_the_choice_on_this_device(monkeypatch) -> None:
    import kernels.delta_rule as dr

    picked = []
    monkeypatch.setattr(dr, "choose", lambda *a, **k: picked.append(a) or "chunked")
    inputs = make_inputs(5, with_state=True)
    assert_close(inputs, method="auto")  # 5 steps would be sequential; the choice says chunked
    assert picked == [(device_kind(), 2, 2, 32, 32, 5)]
