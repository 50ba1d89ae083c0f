"""The model's elementwise gates: MLX's ops, or one vectorized native pass on the CPU.

MLX's CPU backend computes ``exp`` one float at a time on x86 (about 80 M/s, against several
G/s for a multiply), and a prefill computes hundreds of millions of them: silu over the Gated
DeltaNet's conv outputs and the MLPs, the attention's sigmoid gate. A 512-token prefill of
the 0.8B build spent about a third of its time there (``perf``, BENCHMARKS.md). With
``native=True`` and the native module built (``kernels.native``), float32 arrays take
``kernels/native/activations.cpp``: a vectorized exp (within ~2 ulp), the product fused into
the same pass, large arrays split over the kernels' thread pool. Anything else (another
dtype, ``native=False``: GPUs, training, which needs gradients) runs MLX's ops.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import native as _native

__all__ = ["conv_silu", "conv_silu_rows", "exp", "mul_sigmoid", "silu_mul"]


def _module(native: bool, *arrays: mx.array):
    """The native module when `native` and every array is float32 of the first's shape."""
    if not native or any(a.dtype != mx.float32 or a.shape != arrays[0].shape for a in arrays):
        return None
    return _native.module()


def exp(x: mx.array, *, native: bool = False) -> mx.array:
    """``exp(x)``: the chunked delta rule's decays (``kernels.delta_rule``). The native pass
    gives 0 below -87.3, where MLX's gives subnormals (less than 1e-38 of the largest decay)."""
    mod = _module(native, x)
    return mod.exp(x) if mod is not None else mx.exp(x)


def silu_mul(a: mx.array, b: mx.array, *, native: bool = False) -> mx.array:
    """``silu(a) * b``: the MLP's gate, the Gated DeltaNet's output gate."""
    mod = _module(native, a, b)
    return mod.silu_mul(a, b) if mod is not None else nn.silu(a) * b


def mul_sigmoid(y: mx.array, g: mx.array, *, native: bool = False) -> mx.array:
    """``y * sigmoid(g)``: the gated attention's output gate."""
    mod = _module(native, y, g)
    return mod.mul_sigmoid(y, g) if mod is not None else y * mx.sigmoid(g)


def conv_silu(window: mx.array, weight: mx.array, *, native: bool = False) -> mx.array:
    """``silu`` of the Gated DeltaNet's causal depthwise conv: ``window [B, K-1+T, C]`` (the
    conv tail, then T inputs) and ``weight [C, K]`` give ``[B, T, C]``.

    The sum over the K taps is in float32, rounded once to the window's dtype (as mlx-lm's
    ``nn.Conv1d`` rounds in half precision). MLX's ops: for one token a broadcast multiply and
    a sum (few graph nodes); for more, K shifted multiply-adds in tap order (cheaper than a
    grouped conv on the CPU), the order the native pass sums in too.
    """
    mod = _module(native, window) if weight.dtype == mx.float32 else None
    if mod is not None:
        return mod.conv_silu(window, weight)
    f32 = mx.float32
    K = weight.shape[1]
    T = window.shape[1] - K + 1
    if T == 1:
        conv = (window.astype(f32) * weight.T.astype(f32)).sum(axis=1, keepdims=True)
    else:
        w = weight.astype(f32)
        conv = window[:, 0:T].astype(f32) * w[:, 0]
        for j in range(1, K):
            conv = conv + window[:, j : j + T].astype(f32) * w[:, j]
    return nn.silu(conv.astype(window.dtype))


def conv_silu_rows(x: mx.array, weight: mx.array, tails: list[mx.array], *,
                   native: bool = False) -> tuple[mx.array, list[mx.array]]:  # fmt: skip
    """``conv_silu`` for one token of B rows whose conv tails are separate arrays (a decode
    step; each sequence keeps its own): ``x [B, C]`` (each row's new input), ``weight [C,
    K]``, ``tails[i] [b_i, K-1, C]`` with the b_i adding up to B, rows in order. Returns
    ``y [B, C]`` and each tail after the token (its last K-2 inputs, then x), one per input.

    The native pass reads every tail where it is and writes each new tail as its own array
    (over the old one where nobody else holds it): no window is built, nothing is stacked or
    split. MLX's ops join the tails and x into the window ``[B, K, C]``, take
    ``conv_silu`` of it, and cut the new tails from it. Both sum in the same order, so the
    native pass's y equals ``conv_silu``'s bit for bit.
    """
    mod = _module(native, x) if weight.dtype == mx.float32 else None
    if mod is not None and all(t.dtype == mx.float32 for t in tails):
        y, *after = mod.conv_silu_rows(x, weight, tails)
        return y, after
    stacked = tails[0] if len(tails) == 1 else mx.concatenate(tails)
    window = mx.concatenate([stacked, x[:, None]], axis=1)  # [B, K, C]
    y = conv_silu(window, weight, native=native)[:, 0]
    after = mx.contiguous(window[:, 1:])  # its own buffer, not a view pinning the window
    if len(tails) == 1:
        return y, [after]
    cuts, at = [], 0
    for t in tails[:-1]:
        at += t.shape[0]
        cuts.append(at)
    return y, mx.split(after, cuts)
