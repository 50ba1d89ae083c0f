"""Float32 layers on a CPU whose few-row products go through `kernels.native.dense_matmul`.

A batched decode step (or a speculative verify, or a short prefill) multiplies a few rows by
every weight matrix; OpenBLAS's sgemm reads the weights of so few rows at about a quarter of
sgemv's speed, so a batch of 4 would cost 4 single rows. The native kernel reads each weight
once for all rows: dot products for a few rows, outer products on a register tile for more,
up to 256 rows (`kernels.native.DENSE_ROWS`, by the CPU's kernel; one row too where it is as
fast as sgemv and leaves no BLAS threads spinning; up to 128 where the rows are 2048 floats or
longer, `LONG_K_ROWS`). Longer prefills keep MLX's matmul (sgemm).

The classes subclass MLX's layers, so parameters, their names, `nbytes` and `to_quantized`
are unchanged; only bias-free layers are switched (Qwen3.5 has no biases).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels.native import dense_matmul


class CpuLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return dense_matmul(x, self["weight"])


class CpuEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:  # the tied LM head
        return dense_matmul(x, self["weight"])


def use_dense_kernels(model: nn.Module) -> int:
    """Switch bias-free Linear layers and Embeddings to the CPU classes; returns how many."""
    count = 0
    for m in model.modules():
        if type(m) is nn.Linear and "bias" not in m:
            m.__class__ = CpuLinear
            count += 1
        elif type(m) is nn.Embedding:
            m.__class__ = CpuEmbedding
            count += 1
    return count
