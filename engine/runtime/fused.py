"""Projections of one input multiplied as one matrix in decode steps.

A decode step of the 0.8B build issued 186 products; on a CPU each costs a fixed ~15-20 us
(MLX's dispatch, the native pool's start and end) on top of its bytes, and a 16-row
projection is nothing else. The projections that read the same input (a Gated DeltaNet
layer's qkv, z, b and a; an attention layer's q, k and v; the MLP's gate and up) are
concatenated row-wise once at load, and a one-token step multiplies them as one: 96
products instead of 186. Each output row is the same dot product as before (the native
GEMV computes rows independently). The separate layers keep their names and parameters,
now views of the joined matrix, so memory, checkpoints and prefill (which keeps the separate
products: a split of a `[T, N]` product would copy) are unchanged.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

_KEYS = ("weight", "scales", "biases")


class Joined:
    """Layers of one input as one product: `Joined(layers)(x)` returns their outputs."""

    def __init__(self, layers: list[nn.Module]):
        self.layer = copy.copy(layers[0])  # the class and its settings (bits, group size)
        self.cuts = []
        keys = [k for k in _KEYS if k in layers[0]]
        for k in keys:
            self.layer[k] = mx.concatenate([m[k] for m in layers])
        mx.eval([self.layer[k] for k in keys])
        at = 0
        for m in layers:  # each layer's parameters become views of the joined ones
            n = m["weight"].shape[0]
            for k in keys:
                m[k] = self.layer[k][at : at + n]
            mx.eval([m[k] for k in keys])
            at += n
            self.cuts.append(at)

    def __call__(self, x: mx.array) -> list[mx.array]:
        return mx.split(self.layer(x), self.cuts[:-1], axis=-1)


def joinable(layers: list[nn.Module]) -> bool:
    """Same class, settings and parameter dtypes, no biases of their own."""
    first = layers[0]
    if "bias" in first or any(type(m) is not type(first) for m in layers):
        return False
    settings = ("bits", "group_size", "mode")
    for m in layers[1:]:
        if set(m.keys()) != set(first.keys()) or any(
            getattr(m, s, None) != getattr(first, s, None) for s in settings
        ):
            return False
        if any(m[k].dtype != first[k].dtype or m[k].shape[1:] != first[k].shape[1:]
               for k in _KEYS if k in first):  # fmt: skip
            return False
    return True


def join_projections(model: nn.Module) -> int:
    """Join the projections each module names in its `JOINED` (the layers of one input) into
    its `joined`, where they can be; returns how many modules were joined."""
    count = 0
    for m in model.modules():
        names = getattr(type(m), "JOINED", None)
        if names and joinable(parts := [m[n] for n in names]):
            m.joined = Joined(parts)
            count += 1
    return count
