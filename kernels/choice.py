"""Which gated delta implementation runs where: a pure function of (device, head shape, T).

The candidates:
  - "sequential": ``mx.fast.gated_delta_update``. On the CPU one step at a time (about 4x mlx-lm's
    ops loop). On Metal a fused kernel, but only for Dk = Dv = 128 with (Hk, Hv) in
    ``METAL_FUSED_HEADS`` (MLX 0.32 ``GatedDeltaUpdate::use_fallback``); every other shape,
    and every CUDA device, falls back to T steps of small ops (MLX PR #4522).
  - "chunked": ``kernels.delta_rule`` (matmuls over chunks of 64 plus one triangular inverse
    per chunk; LAPACK on the CPU, matmul-only blocked inverse on a GPU).
  - "step": decode tokens and short prefill segments (T < MIN_CHUNKED_T) as a few broadcast
    ops per token (``kernels.delta_rule._step``): on the CPU and CUDA, ``mx.fast`` runs the
    same math as ~34 small graph nodes per token, this as 9.
  - "fused": the tokens one after another in one native pass over each state row
    (``kernels/native/delta.cpp``), where the native CPU module is built: decode steps and
    prefill segments of any length. "step" makes about four passes over the whole state per
    token, each a trip to memory once a batch's states outgrow the caches; the chunked path is
    a few hundred MLX ops per 64 tokens (copies, small matmuls, elementwise passes), 4-5x the
    native pass at 240-512 tokens once that keeps a block of rows in L1 (BENCHMARKS.md, "The
    Gated DeltaNet prefill in blocks of rows").
  - "mlx_lm": mlx-lm's own Metal kernel (``mlx_lm.models.gated_delta.gated_delta_kernel``),
    what mlx-lm itself runs on Metal for any Dk that is a multiple of 32.

``import kernels.choice`` does not import mlx: ``choose`` is testable as plain Python, and
``device_kind`` asks MLX only when called.
"""

from __future__ import annotations

# (Hk, Hv) pairs that MLX 0.32's fused Metal kernel covers (with Dk = Dv = 128).
METAL_FUSED_HEADS = frozenset({(24, 24), (32, 32), (16, 32), (16, 48)})
# CPU: below this many steps the sequential kernel wins (chunk setup costs more than it saves).
# Measured on 2 x86 cores with OpenBLAS, 16 heads x 128 x 128: break-even near T = 8
# (T=4: 6.0 vs 2.7 ms; T=8: 5.9 vs 5.6 ms; T=16: 6.3 vs 13.0 ms chunked vs sequential).
MIN_CHUNKED_T = 16
# CUDA: mx.fast there is T steps of ~10 small kernels each, the chunked path a fixed few
# hundred per 64 steps. An assumption until bench/gpu_check.py measures it on a CUDA device.
MIN_CHUNKED_T_CUDA = 16

# CPU with the native module: "fused" at every length. Measured on 2 AVX2 cores (Zen 3), 0.8B
# heads (16 x 128 x 128), one layer, fused vs chunked: T=16 1.0 vs 6.3 ms, T=40 2.6 vs 6.4, T=94
# 4.9 vs 12.8, T=128..512 even within the noise (10-60 ms both), so prefills of 128 tokens and
# more went chunked. Since the fused pass takes a prefill segment's rows in blocks held in L1
# (session 29), on an AVX-512 Xeon: T=128 2.5 vs 9.3 ms, T=240 4.8 vs 21, T=512 11 vs 50.

# "step" builds 9 graph nodes per token in a Python loop: a guard against asking it for a prefill.
MAX_STEP_T = 64

METHODS = ("sequential", "chunked", "mlx_lm", "step", "fused")


def choose(
    device: str,
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    t: int,
    *,
    fast_matmul: bool = True,
    native: bool = False,
) -> str:
    """The method for `t` steps of heads (Hk, Hv, Dk, Dv) on `device` ("cpu", "metal", "cuda").

    `fast_matmul`: whether CPU float32 matmuls are fast (Accelerate, or a fast BLAS on Linux);
    with the reference BLAS the chunked path is ~0.8x the sequential one, not a win.
    `native`: whether the native CPU module (kernels.native) is built, for "fused".
    """
    if device == "cpu" and native:
        return "fused"
    if device in ("cpu", "cuda") and t < MIN_CHUNKED_T:
        return "step"
    if device == "cpu":
        return "chunked" if t >= MIN_CHUNKED_T and fast_matmul else "sequential"
    if device == "metal":
        # mlx-lm's choice, which this engine cannot measure without a Mac: its own kernel for
        # every head shape it takes, at any T. MLX's fused kernel (METAL_FUSED_HEADS) is the
        # candidate to measure against it; the per-token fallback never wins.
        return "mlx_lm" if dk >= 32 and dk % 32 == 0 else "sequential"
    if device == "cuda":
        return "chunked" if t >= MIN_CHUNKED_T_CUDA else "sequential"
    raise ValueError(f"unknown device {device!r} (expected cpu, metal or cuda)")


def device_kind() -> str:
    """ "cpu", "metal" or "cuda": where MLX's default device computes."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"
