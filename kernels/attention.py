"""Scaled dot-product attention: MLX's, or on the CPU with a vectorized causal softmax.

On the CPU, ``mx.fast.scaled_dot_product_attention`` is MLX's fallback: two matmuls around a
softmax whose exp is scalar on x86 (see ``kernels.activations``). A prefill's softmax grows
with the square of the prompt: 8 heads x 2048 x 2048 per attention layer of the 0.8B build
is tens of millions of exps a layer. With ``native=True`` (float32, several queries, the
native module built) the scores come from the fast BLAS and the causal softmax is one
vectorized pass per row (``kernels/native/activations.cpp``); the math is MLX's: scores
scaled, masked, softmax in float32, then times v.
"""

from __future__ import annotations

import mlx.core as mx

from . import native as _native

__all__ = ["attention"]


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, *, native: bool = False
              ) -> mx.array:  # fmt: skip
    """Causal attention of q ``[B, Hq, T, D]`` (the last T of the S positions) over k, v
    ``[B, Hkv, S, D]`` (Hq a multiple of Hkv: grouped queries); returns ``[B, Hq, T, D]``."""
    B, Hq, T, D = q.shape
    mod = _native.module() if native and T > 1 and q.dtype == mx.float32 else None
    if mod is None:
        mask = "causal" if T > 1 else None
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    Hkv, S = k.shape[1], k.shape[2]
    # the query heads of one key head as one matrix: [B, Hkv, r*T, D] (T rows per head)
    qg = (q * scale).reshape(B, Hkv, (Hq // Hkv) * T, D)
    scores = (qg @ k.swapaxes(-1, -2)).reshape(B, Hkv, Hq // Hkv, T, S)
    p = mod.causal_softmax(scores).reshape(B, Hkv, (Hq // Hkv) * T, S)
    return (p @ v).reshape(B, Hq, T, D)
