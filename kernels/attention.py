"""Scaled dot-product attention: MLX's, or on the CPU with a vectorized causal softmax.

On the CPU, ``mx.fast.scaled_dot_product_attention`` is MLX's fallback: two matmuls around a
softmax whose exp is scalar on x86 (see ``kernels.activations``). A prefill's softmax grows
with the square of the prompt: 8 heads x 2048 x 2048 per attention layer of the 0.8B build
is tens of millions of exps a layer. With ``native=True`` (float32, several queries, the
native module built) the scores come from the fast BLAS and the causal softmax is one
vectorized pass per row (``kernels/native/activations.cpp``); the math is MLX's: scores
scaled, masked, softmax in float32, then times v.

``attention_rows`` is a decode step's attention: each row's few queries over its own KV
cache's buffer, rows of any lengths together. MLX's op reads a 1024-position cache at ~5 GB/s
for one query and a batched step called it once per row; natively (float32 on the CPU,
``kernels/native/attention.cpp``) every row goes in one pass over the pool's threads, reading
the buffers in place at memory speed (BENCHMARKS.md, "Attention over each row's cache").
"""

from __future__ import annotations

import mlx.core as mx

from . import native as _native

__all__ = ["attention", "attention_rows"]


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


# Queries a row where the native pass beats the scores-by-BLAS path (BENCHMARKS.md): one
# always; up to 4 (a short verify pass) while the rows hold at most 2048 keys.
ROWS_QUERIES = 4
ROWS_KEYS = 2048


def attention_rows(q: mx.array, keys: list[mx.array], values: list[mx.array],
                   lengths: list[int], scale: float, *, native: bool = False) -> mx.array:  # fmt: skip
    """Causal attention of each row b of q ``[B, Hq, T, D]`` (its queries the last T of
    ``lengths[b]`` positions) over ``keys[b]`` and ``values[b]``, a KV cache's buffers
    ``[1, Hkv, capacity, D]`` whose first ``lengths[b]`` positions hold the row; returns
    ``[B, Hq, T, D]``."""
    T = q.shape[2]
    short = T == 1 or (T <= ROWS_QUERIES and max(lengths) <= ROWS_KEYS)
    mod = _native.module() if native and short and q.dtype == mx.float32 else None
    if mod is not None:
        return mod.attention_rows(q, keys, values, lengths, scale)
    if len(lengths) == 1:
        return attention(q, keys[0][:, :, : lengths[0]], values[0][:, :, : lengths[0]], scale,
                         native=native)  # fmt: skip
    return mx.concatenate([
        attention(q[b : b + 1], k[:, :, :n], v[:, :, :n], scale, native=native)
        for b, (k, v, n) in enumerate(zip(keys, values, lengths, strict=True))
    ])  # fmt: skip
