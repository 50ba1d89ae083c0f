"""A sampled token's cuts and draw: one native pass on the CPU, or None for MLX's ops.

With Qwen's recommended cuts (`top_k` 20, `top_p` 0.95) MLX's ops make about a dozen passes
over a 248k vocabulary per pick (a partition for the k-th largest, masks, a softmax whose exp
is scalar on x86, a categorical draw with noise for every entry): ~8.5 ms a token on a CPU
core, a sixth of a 0.8B float32 decode step and more at 4 bits. ``kernels/native/sampling.cpp``
keeps only the values at or above a rising threshold in one vectorized pass and does the rest
on those: ~0.15 ms. Its cuts are `Sampler.final_logits`'s, value for value; the draw is the
inverse CDF at a uniform `u` in index order (the distribution of a categorical draw over the
cut logits, from other random numbers than MLX's Gumbel noise). The log-probabilities a
caller asks for (`logprobs`: at the token and the top k) take the same kind of passes.
"""

from __future__ import annotations

import mlx.core as mx

from . import native as _native
from .choice import device_kind

__all__ = ["logprobs", "sample", "sample_excluding", "sample_rows"]


def _module(logits: mx.array):
    if logits.dtype != mx.float32 or device_kind() != "cpu":
        return None
    return _native.module()


def sample(logits: mx.array, u: mx.array, *, temperature: float, top_k: int = 0,
           top_p: float = 1.0, min_p: float = 0.0) -> mx.array | None:  # fmt: skip
    """A token per row of float32 `logits` `[..., V]` after the cuts, drawn at the row's
    uniform `u` `[...]`, on the CPU with the native module built; None otherwise (the caller
    runs MLX's ops)."""
    if (mod := _module(logits)) is None:
        return None
    return mod.sample(logits, u, temperature, top_k, top_p, min_p)


def sample_rows(rows: list[mx.array], u: mx.array, *, temperature: float, top_k: int = 0,
                top_p: float = 1.0, min_p: float = 0.0) -> mx.array | None:  # fmt: skip
    """`sample` over rows given as arrays `[V]` of their own (a batched step's: no copy into
    one `[n, V]` array), at `u` `[n]`; None off the native path."""
    if (mod := _module(rows[0])) is None or any(r.dtype != mx.float32 for r in rows[1:]):
        return None
    return mod.sample_rows(rows, u, temperature, top_k, top_p, min_p)


def sample_excluding(logits: mx.array, u: mx.array, exclude: mx.array, *,
                     temperature: float, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> tuple[mx.array, mx.array] | None:  # fmt: skip
    """As `sample`, with the id `exclude[i]` (int32; -1: none) left out of row i's draw: (the
    tokens, the probability row i's cut distribution gives `exclude[i]`); None off the
    native path."""
    if (mod := _module(logits)) is None:
        return None
    tokens, p = mod.sample_excluding(logits, u, exclude, temperature, top_k, top_p, min_p)
    return tokens, p


def logprobs(logits: mx.array, token: mx.array, k: int
             ) -> tuple[mx.array, mx.array, mx.array] | None:  # fmt: skip
    """log_softmax of float32 `logits` `[..., V]`: (at `token` `[...]`, the `k` largest
    `[..., k]` and their ids `[..., k]`, most likely first); None off the native path."""
    if (mod := _module(logits)) is None:
        return None
    chosen, ids, values = mod.logprobs(logits, token.astype(mx.uint32), k)
    return chosen, ids, values
