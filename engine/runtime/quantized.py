"""Quantized layers that keep their compact weights on a CPU and multiply through
`kernels.native.quantized_matmul` (the native GEMV for decode, float32 BLAS for prefill).

They subclass MLX's quantized layers, so parameters, their names and `nbytes` are unchanged
and a checkpoint loads into them as it does into `nn.QuantizedLinear`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels.native import quantized_matmul


class CpuQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits
        )
        return y + self["bias"] if "bias" in self else y


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:  # the tied LM head
        return quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits
        )


def _affine(m) -> bool:
    return getattr(m, "mode", "affine") == "affine" and m.get("biases") is not None


def use_cpu_kernels(model: nn.Module) -> int:
    """Switch affine quantized Linear/Embedding layers to the CPU classes; returns how many."""
    count = 0
    for m in model.modules():
        if type(m) is nn.QuantizedLinear and _affine(m):
            m.__class__ = CpuQuantizedLinear
            count += 1
        elif type(m) is nn.QuantizedEmbedding and _affine(m):
            m.__class__ = CpuQuantizedEmbedding
            count += 1
    return count


def quantize_model(model: nn.Module, bits: int, group_size: int = 64) -> None:
    """Quantize a float model in place as `mlx_lm.convert` does for dense Qwen3.5: every
    Linear and Embedding whose rows split into whole groups, affine, `bits` wide."""
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    mx.clear_cache()  # the float weights' buffers: memory back to the system, not MLX's cache
