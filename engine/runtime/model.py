"""The Qwen3.5 text model in MLX: Gated DeltaNet and gated-attention layers.

Three of every four layers are Gated DeltaNet (a linear-attention recurrence with a fixed-size
state); every fourth is full softmax attention with an output gate. Each layer reads and writes
its own cache object (engine/cache.py), so the caller decides what is cached and when.

Weights use our own layout: norms already include Qwen's `1 + w` offset and the depthwise
conv weight is `[C, K]`; `sanitize` maps the Hub layout onto it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kernels import gated_delta_kept, gated_delta_rows
from kernels.activations import conv_silu, conv_silu_rows, mul_sigmoid, silu_mul
from kernels.attention import attention, attention_rows

from ..checkpoints.registry import Architecture
from .cache import KVCache, MTPCache, RecurrentCache


@dataclass(frozen=True)
class ModelOptions:
    # False: always mx.fast.gated_delta_update (the sequential reference), whatever the device.
    chunked_delta: bool = True  # True: kernels.choice picks the gated delta path
    # True: the gates (silu, sigmoid, the conv's silu) and a prefill's causal softmax take
    # vectorized native CPU passes for float32 (kernels.activations, kernels.attention);
    # MLX's ops otherwise (GPUs, training, which needs gradients).
    native_activations: bool = False


def _rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return _rms_norm(x, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; its cache is (conv tail, delta state)."""

    JOINED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # one product: runtime.fused

    def __init__(self, a: Architecture, options: ModelOptions):
        super().__init__()
        self.hk, self.hv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.kernel = a.linear_conv_kernel_dim
        self.eps = a.rms_norm_eps
        self.options = options
        conv_dim = a.linear_conv_dim
        self.in_proj_qkv = nn.Linear(a.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(a.hidden_size, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(a.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(a.hidden_size, self.hv, bias=False)
        self.conv_weight = mx.zeros((conv_dim, self.kernel))  # depthwise, [C, K]
        self.dt_bias = mx.ones((self.hv,))
        self.A_log = mx.zeros((self.hv,))
        self.norm = RMSNorm(self.dv, a.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, a.hidden_size, bias=False)
        self.joined = None  # qkv, z, b, a as one product in decode (runtime.fused)
        self._rows_step = None  # `_rows` compiled, made at first use (see packed)

    def _inputs(self, x: mx.array) -> list[mx.array]:
        """qkv, z, b and a of one token `x [B, H]`."""
        if self.joined is not None:
            return self.joined(x)
        return [self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)]

    def __call__(self, x: mx.array, cache: RecurrentCache) -> mx.array:
        return self.packed(x, [(0, x.shape[1])], [cache])

    def packed(self, x: mx.array, spans: list[tuple[int, int]], caches: list) -> mx.array:
        """Several rows' tokens packed along T (`x [1, T, H]`, row i at `x[:, s_i:e_i]` with
        its own cache `caches[i]`): the projections run once over all of them, the conv and
        the delta rule per row, except that rows decoding one token go together through the
        decode step's own math (`_rows`, compiled), as in a batched decode step."""
        products = (self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x))
        ys: list = [None] * len(spans)
        ones = [i for i, ((s, e), c) in enumerate(zip(spans, caches))
                if e - s == 1 and c.conv is not None and not c.capture]  # fmt: skip
        if len(ones) > 1:
            at = mx.array([spans[i][0] for i in ones])
            y, tails, states = self._rows_compiled()(
                *(p[0, at] for p in products),
                [caches[i].conv for i in ones],
                [caches[i].state for i in ones],
            )
            for j, i in enumerate(ones):
                caches[i].update(tails[j], states[j], 1)
                ys[i] = y[None, j : j + 1]
        for i, ((s, e), c) in enumerate(zip(spans, caches)):
            if ys[i] is None:
                ys[i] = self._mix(*(p[:, s:e] for p in products), c)
        return self.out_proj(ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1))

    def _rows_compiled(self):
        if self._rows_step is None:
            self._rows_step = mx.compile(self._rows, inputs=self)
        return self._rows_step

    def _mix(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array,
             cache: RecurrentCache) -> mx.array:  # fmt: skip
        """The conv and the gated delta rule over one row's projections (`[B, T, *]`) from its
        cache: the gated output `[B, T, Hv*Dv]`, before `out_proj`."""
        B, T, _ = qkv.shape
        if cache.conv is None:
            tail = mx.zeros((B, self.kernel - 1, qkv.shape[-1]), dtype=qkv.dtype)
        else:
            tail = cache.conv
        window = mx.concatenate([tail, qkv], axis=1)  # [B, K-1+T, C]
        native = self.options.native_activations
        conv = conv_silu(window, self.conv_weight, native=native)  # [B, T, C]

        kd = self.hk * self.dk
        q = conv[..., :kd].reshape(B, T, self.hk, self.dk)
        k = conv[..., kd : 2 * kd].reshape(B, T, self.hk, self.dk)
        v = conv[..., 2 * kd :].reshape(B, T, self.hv, self.dv)
        # L2-normalize q and k (eps 1e-6 on the sum of squares), fold Dk^-1/2 into q.
        inv = self.dk**-0.5
        q = (inv * inv) * mx.fast.rms_norm(q, None, 1e-6 * inv * inv)
        k = inv * mx.fast.rms_norm(k, None, 1e-6 * inv * inv)

        # g in float32 from a softplus in the compute dtype, rounded where mlx-lm rounds it.
        beta = mx.sigmoid(b)  # [B, T, Hv]
        f32 = mx.float32
        g = mx.exp(-mx.exp(self.A_log.astype(f32)) * nn.softplus(a + self.dt_bias))  # [B, T, Hv]

        state = cache.state
        if state is None:
            state = mx.zeros((B, self.hv, self.dv, self.dk), dtype=mx.float32)
        # The states at the positions the caller wants snapshots of (cache.capture) come from
        # the same pass over the chunk.
        keep = sorted({c for c in cache.capture if 0 < c < T})
        method = "auto" if self.options.chunked_delta else "sequential"
        y, state, kept = gated_delta_kept(q, k, v, g, beta, state, keep, method=method)
        for cut, at in zip(keep, kept):  # the conv tail at `cut` is the K-1 inputs before it
            cache.record(cut, _tail(window, cut, self.kernel - 1), at)
        cache.update(_tail(window, T, self.kernel - 1), state, T)

        z = z.reshape(B, T, self.hv, self.dv)
        y = _rms_norm(y, self.norm.weight, self.eps)
        y = silu_mul(z.astype(f32), y.astype(f32), native=native).astype(qkv.dtype)
        return y.reshape(B, T, -1)

    def decode(self, x: mx.array, tails: list[mx.array], states: list[mx.array]):
        """One token `x [B, H]` (2-D: matmuls need no reshapes) from the conv tails and the
        delta states, one of each per sequence (`tails[i]` `[b_i, K-1, C]`, `states[i]`
        `[b_i, Hv, Dv, Dk]`, B rows in all: each row of a batch keeps its own, see
        `conv_silu_rows` and `gated_delta_rows`): the same math as `__call__`, as a pure
        function for `mx.compile`; returns (output `[B, H]`, new tails, new states)."""
        y, tails, states = self._rows(*self._inputs(x), tails, states)
        return self.out_proj(y), tails, states

    def _rows(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array,
              tails: list[mx.array], states: list[mx.array]):  # fmt: skip
        """`decode` after the projections (qkv `[B, C]`, z `[B, Hv*Dv]`, b and a `[B, Hv]`):
        the gated output `[B, Hv*Dv]` before `out_proj`, the new tails and states."""
        B = qkv.shape[0]
        f32 = mx.float32
        native = self.options.native_activations
        conv, tails = conv_silu_rows(qkv, self.conv_weight, tails, native=native)  # [B, C]
        kd = self.hk * self.dk
        q = conv[..., :kd].reshape(B, 1, self.hk, self.dk)
        k = conv[..., kd : 2 * kd].reshape(B, 1, self.hk, self.dk)
        v = conv[..., 2 * kd :].reshape(B, 1, self.hv, self.dv)
        inv = self.dk**-0.5
        q = (inv * inv) * mx.fast.rms_norm(q, None, 1e-6 * inv * inv)
        k = inv * mx.fast.rms_norm(k, None, 1e-6 * inv * inv)
        a = a[:, None]
        beta = mx.sigmoid(b)[:, None]
        g = mx.exp(-mx.exp(self.A_log.astype(f32)) * nn.softplus(a + self.dt_bias))
        method = "auto" if self.options.chunked_delta else "sequential"
        y, states = gated_delta_rows(q, k, v, g, beta, states, method=method)
        z = z.reshape(B, 1, self.hv, self.dv)
        y = _rms_norm(y, self.norm.weight, self.eps)
        y = silu_mul(z.astype(f32), y.astype(f32), native=native).astype(qkv.dtype)
        return y.reshape(B, -1), tails, states


def _tail(window: mx.array, start: int, n: int) -> mx.array:
    """`window[:, start:start+n]` as its own buffer: a slice would keep the whole window alive
    (a `[1, 3, 8192]` tail pinned 16.9 MB of a 512-token chunk) while `nbytes` says 98 KB."""
    return mx.contiguous(window[:, start : start + n])


def _rotate(x: mx.array, dims: int, cos: mx.array, sin: mx.array) -> mx.array:
    """Non-traditional RoPE on the first `dims` features of x `[..., T, D]`, the same ops in
    the same order as `mx.fast.rope`'s CPU path."""
    half = dims // 2
    x1, x2 = x[..., :half], x[..., half:dims]
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return mx.concatenate(parts, axis=-1)


class Attention(nn.Module):
    """Grouped-query softmax attention with q/k norms, partial RoPE and a sigmoid output gate."""

    JOINED = ("q_proj", "k_proj", "v_proj")  # one product in decode steps: runtime.fused

    def __init__(self, a: Architecture, native: bool = False):
        super().__init__()
        self.native = native  # ModelOptions.native_activations
        self.nq, self.nkv, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.rotary = int(a.head_dim * a.partial_rotary_factor)
        self.theta = a.rope_theta
        self.q_proj = nn.Linear(a.hidden_size, 2 * self.nq * self.d, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nq * self.d, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, a.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, a.rms_norm_eps)
        # RoPE frequencies for the CPU path (see _angles); "_": not a parameter.
        half = self.rotary // 2
        step = mx.array(math.log(self.theta) / half, mx.float32)
        self._inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)
        mx.eval(self._inv_freqs)
        self.joined = None  # q, k and v as one product in decode (runtime.fused)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        return self.packed(x, [(0, x.shape[1])], [cache])

    def packed(self, x: mx.array, spans: list[tuple[int, int]], caches: list) -> mx.array:
        """Several rows' tokens packed along T (`x [1, T, H]`, row i at `x[:, s_i:e_i]` with
        its own KV cache `caches[i]`): the projections run once over all of them, attention
        per row over that row's cache, except that rows of one token go together through a
        batched decode step's heads and attention (`attend_rows`: one pass for all)."""
        products = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        ys: list = [None] * len(spans)
        gates: list = [None] * len(spans)
        ones = [i for i, (s, e) in enumerate(spans) if e - s == 1]
        if len(ones) > 1:
            at = mx.array([spans[i][0] for i in ones])
            offsets = mx.array([caches[i].offset for i in ones])
            q, k, v, gate = self.heads(*(p[0, at] for p in products), offsets)
            y = self.attend_rows(q, k, v, [caches[i] for i in ones])
            for j, i in enumerate(ones):
                ys[i], gates[i] = y[j : j + 1], gate[j : j + 1]
        for i, ((s, e), c) in enumerate(zip(spans, caches)):
            if ys[i] is None:
                q, k, v, gates[i] = self.heads(*(p[:, s:e] for p in products), c.offset)
                ys[i] = self.attend(q, k, v, c)
        if len(ys) == 1:
            return self.output(ys[0], gates[0])
        return self.output(mx.concatenate(ys, axis=1), mx.concatenate(gates, axis=1))

    def project(self, x: mx.array, offset: int | mx.array):
        """q `[B, Hq, T, D]`, k and v `[B, Hkv, T, D]` at positions from `offset`, and the
        output gate `[B, T, Hq*D]`, from x `[B, T, H]` or, for one token, `[B, H]`."""
        if x.ndim == 2 and self.joined is not None:
            return self.heads(*self.joined(x), offset)
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), offset)

    def heads(self, q: mx.array, k: mx.array, v: mx.array, offset: int | mx.array):
        """`project` from the products: q (with the gate), k and v `[B, T, *]` or `[B, *]`."""
        B, T = q.shape[0], q.shape[1] if q.ndim == 3 else 1
        q, gate = mx.split(q.reshape(B, T, self.nq, 2 * self.d), 2, axis=-1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)  # [B, Hq, T, D]
        k = self.k_norm(k.reshape(B, T, self.nkv, self.d)).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.nkv, self.d).transpose(0, 2, 1, 3)
        # Text-only positions are equal in all three M-RoPE sections: plain RoPE on `rotary` dims.
        if mx.default_device() == mx.cpu:
            cos, sin = self._angles(T, offset, q.dtype)
            q, k = _rotate(q, self.rotary, cos, sin), _rotate(k, self.rotary, cos, sin)
        elif isinstance(offset, mx.array) and offset.ndim == 1:  # one offset per row
            q = mx.concatenate([self._rope(q[i : i + 1], offset[i]) for i in range(B)])
            k = mx.concatenate([self._rope(k[i : i + 1], offset[i]) for i in range(B)])
        else:
            q, k = self._rope(q, offset), self._rope(k, offset)
        return q, k, v, gate.reshape(B, T, -1)

    def _rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.rotary, traditional=False, base=self.theta, scale=1.0, offset=offset
        )

    def _angles(self, T: int, offset: int | mx.array, dtype: mx.Dtype):
        """cos and sin `[T, rotary/2]` of positions offset..offset+T-1, as MLX's CPU RoPE
        computes them (its CPU path is this very graph, built afresh for q and for k and
        with the frequencies recomputed every call: ~60 nodes where this is ~15). With one
        offset per row (`[B]`, a batched decode step) they are `[B, 1, T, rotary/2]`."""
        positions = mx.arange(T, dtype=mx.float32)
        if isinstance(offset, mx.array) and offset.ndim == 1:
            positions = (positions + offset[:, None].astype(mx.float32))[:, None]  # [B, 1, T]
        else:
            positions = positions + offset
        theta = positions[..., None] * self._inv_freqs
        return mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache) -> mx.array:
        """Append k, v to the cache and attend; returns `[B, T, Hq*D]`."""
        B, _, T, _ = q.shape
        if B == 1:
            return self.attend_rows(q, k, v, [cache])
        k, v = cache.update(k, v)
        y = attention(q, k, v, self.d**-0.5, native=self.native)
        return y.transpose(0, 2, 1, 3).reshape(B, T, -1)

    def attend_rows(self, q: mx.array, k: mx.array, v: mx.array, caches: list) -> mx.array:
        """Row i of q, k, v `[B, H, T, D]` appends to its own cache `caches[i]` (of batch 1)
        and attends over it, whatever its length; returns `[B, T, Hq*D]`."""
        B, _, T, _ = q.shape
        if B == 1:  # no slice nodes for a lone row
            caches[0].update(k, v)
        else:
            for i, c in enumerate(caches):
                c.update(k[i : i + 1], v[i : i + 1])
        y = attention_rows(q, [c.keys for c in caches], [c.values for c in caches],
                           [c.offset for c in caches], self.d**-0.5, native=self.native)  # fmt: skip
        return y.transpose(0, 2, 1, 3).reshape(B, T, -1)

    def output(self, y: mx.array, gate: mx.array) -> mx.array:
        return self.o_proj(mul_sigmoid(y, gate, native=self.native))


class MLP(nn.Module):
    JOINED = ("gate_proj", "up_proj")  # one product in decode steps: runtime.fused

    def __init__(self, dims: int, hidden: int, native: bool = False):
        super().__init__()
        self.native = native  # ModelOptions.native_activations
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)
        self.joined = None  # gate and up as one product in decode (runtime.fused)

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 2 and self.joined is not None:  # a decode step's [B, H]
            gate, up = self.joined(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(silu_mul(gate, up, native=self.native))


class SparseMoE(nn.Module):
    """Top-k routed experts plus one always-on shared expert (Qwen3.5-35B-A3B)."""

    def __init__(self, a: Architecture, native: bool = False):
        super().__init__()
        from mlx_lm.models.switch_layers import SwitchGLU

        self.top_k = a.num_experts_per_tok
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(a.hidden_size, a.moe_intermediate_size, a.num_experts)
        self.shared_expert = MLP(a.hidden_size, a.shared_expert_intermediate_size, native)
        self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        # Router in the compute dtype with a float32 softmax, rounded where mlx-lm rounds it
        # (the same ops in float32; in half precision the top-k weights must round alike).
        probs = mx.softmax(self.gate(x), axis=-1, precise=True)
        idx = mx.stop_gradient(mx.argpartition(probs, kth=-self.top_k, axis=-1)[..., -self.top_k :])
        w = mx.take_along_axis(probs, idx, axis=-1)
        w = w / w.sum(axis=-1, keepdims=True)
        y = (self.switch_mlp(x, idx) * w[..., None]).sum(axis=-2)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: Architecture, kind: str, options: ModelOptions):
        super().__init__()
        self.is_linear = kind == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(a, options)
        else:
            self.self_attn = Attention(a, options.native_activations)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        native = options.native_activations
        self.mlp = (SparseMoE(a, native) if a.is_moe
                    else MLP(a.hidden_size, a.intermediate_size, native))  # fmt: skip
        self._steps = None  # the compiled decode step, made at first use (see _decode)

    def __call__(self, x: mx.array, cache) -> mx.array:
        if x.shape[1] == 1 and cache.offset and not getattr(cache, "capture", None):
            return self._decode(x, cache)
        return self.packed(x, [(0, x.shape[1])], [cache])

    def packed(self, x: mx.array, spans: list[tuple[int, int]], caches: list) -> mx.array:
        """Rows packed along T (`x [B, T, H]`, row i at `x[:, s_i:e_i]`, its cache `caches[i]`):
        every product (the mixer's projections, the MLP) runs once over all the rows' tokens,
        which reads the weights once and gives the matmul its best shape; the conv, the delta
        rule and attention run per row on the row's own cache."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer.packed(self.input_layernorm(x), spans, caches)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _decode(self, x: mx.array, cache) -> mx.array:
        """One token through the layer, traced once and replayed by `mx.compile`: a decode
        step is hundreds of small ops, each costing microseconds to build in Python and to
        dispatch; compiled, elementwise chains fuse and no Python runs per op. The same math
        as `__call__`. A Gated DeltaNet layer compiles whole; an attention layer in two parts
        around its cache update and attention, whose shapes grow with every token. The
        layer's weights are the compiled functions' implicit inputs, so new weights need no
        recompilation."""
        steps = self._compiled()
        if self.is_linear:
            h, (conv,), (state,) = steps[0](x, [cache.conv], [cache.state])
            cache.update(conv, state, 1)
            return h
        attention_in, attention_out = steps
        q, k, v, gate = attention_in(x, mx.array(cache.offset))
        return attention_out(x, self.self_attn.attend(q, k, v, cache), gate)

    def decode_rows(self, x: mx.array, caches: list) -> mx.array:
        """One token for each of B rows, `x [B, 1, H]`, each row with its own cache (`caches[i]`
        of batch 1): the projections and the MLP run as one `[B, H]` product, which reads the
        weights once for all rows. A Gated DeltaNet layer hands the conv and the delta rule
        each row's conv tail and state as they are (`conv_silu_rows`, `gated_delta_rows`: the
        CPU kernels read and write them where a stack and split would copy them); an attention
        layer attends over each row's own KV cache, whatever its length, every row in one
        pass on the CPU (`attention_rows`). The same compiled functions as `_decode`, at
        batch B."""
        steps = self._compiled()
        if self.is_linear:
            h, tails, states = steps[0](x, [c.conv for c in caches], [c.state for c in caches])
            for c, tail, state in zip(caches, tails, states, strict=True):
                c.update(tail, state, 1)
            return h
        attention_in, attention_out = steps
        offsets = mx.array([c.offset for c in caches])
        q, k, v, gate = attention_in(x, offsets)
        return attention_out(x, self.self_attn.attend_rows(q, k, v, caches), gate)

    def _compiled(self) -> tuple:
        if self._steps is None:
            if self.is_linear:
                self._steps = (mx.compile(self._linear_step, inputs=self),)
            else:
                self._steps = (
                    mx.compile(self._attention_in, inputs=self),
                    mx.compile(self._attention_out, inputs=self),
                )
        return self._steps

    def _linear_step(self, x: mx.array, tails: list[mx.array], states: list[mx.array]):
        x2 = x.reshape(x.shape[0], -1)  # [B, H]
        y, tails, states = self.linear_attn.decode(self.input_layernorm(x2), tails, states)
        return self._mlp_residual(x2 + y).reshape(x.shape), tails, states

    def _attention_in(self, x: mx.array, offset: mx.array):
        return self.self_attn.project(self.input_layernorm(x.reshape(x.shape[0], -1)), offset)

    def _attention_out(self, x: mx.array, y: mx.array, gate: mx.array) -> mx.array:
        B = x.shape[0]
        h = x.reshape(B, -1) + self.self_attn.output(y.reshape(B, -1), gate.reshape(B, -1))
        return self._mlp_residual(h).reshape(x.shape)

    def _mlp_residual(self, h: mx.array) -> mx.array:
        return h + self.mlp(self.post_attention_layernorm(h))


class LanguageHead:
    """The LM head over `hidden`'s states, shared by every model with this interface (the
    whole model here; rank 0 of a pipeline, runtime.shard): `arch`, `embed_tokens`, and
    `lm_head` when the embeddings are not tied."""

    def logits(self, h: mx.array) -> mx.array:
        if self.arch.tie_word_embeddings:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, ids: mx.array, caches: list, *, last_only: bool = False) -> mx.array:
        h = self.hidden(ids, caches)
        return self.logits(h[:, -1:] if last_only else h)


class Qwen35(LanguageHead, nn.Module):
    """The text model. `__call__(ids, caches)` advances the caches and returns logits.

    With `mtp`, the checkpoint's MTP head (runtime.mtp) is built too, and its cache rides
    last in `make_caches()`: every pass keeps it in step with the target (the head itself
    runs when a draft needs its rows: see runtime.mtp)."""

    def __init__(self, arch: Architecture, options: ModelOptions | None = None, *,
                 mtp: bool = False):  # fmt: skip
        super().__init__()
        self.arch = arch
        options = options or ModelOptions()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = [DecoderLayer(arch, kind, options) for kind in arch.layer_types]
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if mtp:
            from .mtp import MTPHead

            if arch.mtp_num_hidden_layers != 1:
                raise ValueError(f"MTP drafting supports one MTP layer; the config has "
                                 f"mtp_num_hidden_layers={arch.mtp_num_hidden_layers}")  # fmt: skip
            self.mtp = MTPHead(arch, options)

    def make_caches(self) -> list[KVCache | RecurrentCache]:
        caches = [RecurrentCache() if layer.is_linear else KVCache() for layer in self.layers]
        return caches + [MTPCache()] if "mtp" in self else caches

    def decode_rows(self, ids: mx.array, caches: list[list]) -> mx.array:
        """One token per row (`ids [B]`, row i's caches `caches[i]`, all past their first
        token): the final-normed hidden states `[B, 1, H]`. Batched decoding: see
        `DecoderLayer.decode_rows`."""
        x = self.embed_tokens(ids)[:, None]
        for i, layer in enumerate(self.layers):
            x = layer.decode_rows(x, [row[i] for row in caches])
        h = self.norm(x)
        n = len(self.layers)
        for i, row in enumerate(caches):  # the MTP head's cache follows each row's target
            if len(row) > n:
                self.mtp.advance(ids[i : i + 1, None], h[i : i + 1], row[n], self.embed_tokens)
        return h

    def packed(self, ids: mx.array, spans: list[tuple[int, int]], caches: list[list]
               ) -> mx.array:  # fmt: skip
        """Several rows in one pass: row i feeds `ids[s_i:e_i]` (`ids [T]`, `spans[i]`) from its
        own caches `caches[i]`, any number of tokens each (a prefill chunk, a decode step).
        Returns the final-normed hidden states `[T, H]`, packed as `ids` is. See
        `DecoderLayer.packed`."""
        x = self.embed_tokens(ids)[None]
        for i, layer in enumerate(self.layers):
            x = layer.packed(x, spans, [row[i] for row in caches])
        h = self.norm(x)
        n = len(self.layers)
        for (s, e), row in zip(spans, caches):  # the MTP head's cache follows each row's target
            if len(row) > n:
                self.mtp.advance(ids[None, s:e], h[:, s:e], row[n], self.embed_tokens)
        return h[0]

    def hidden(self, ids: mx.array, caches: list) -> mx.array:
        """Run the layers on ids `[B, T]`; returns the final-normed hidden states `[B, T, H]`."""
        x = self.embed_tokens(ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        h = self.norm(x)
        if len(caches) > len(self.layers):  # the MTP head's cache follows the target (lazily)
            self.mtp.advance(ids, h, caches[len(self.layers)], self.embed_tokens)
        return h


_NORM_SUFFIXES = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
    "k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
)  # fmt: skip


_NORMS = ("norm.weight", "mtp.norm.weight")  # the target's final norm and the head's


def local_path(key: str, *, mtp: bool = False) -> str | None:
    """A checkpoint's tensor or module path in this model's naming (None: not ours, e.g.
    the vision tower, or the MTP head unless `mtp`). Shared by the weights and mlx-lm's
    per-path quantization settings, which name modules the same way."""
    if key.startswith(("model.visual", "vision_tower")):
        return None
    if key.startswith(("mtp.", "model.mtp.")):
        return "mtp." + key.split("mtp.", 1)[1] if mtp else None
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def sanitize(weights: dict[str, mx.array], arch: Architecture, *, mtp: bool = False
             ) -> dict[str, mx.array]:  # fmt: skip
    """Map checkpoint tensors (Hub, transformers text-only, or mlx-lm layout) onto ours; the
    MTP head's (`mtp.*`) are kept only with `mtp`. Routed experts come fused
    (`experts.gate_up_proj`, `experts.down_proj`), per expert (`experts.{e}.gate_proj.weight`
    ...) or as mlx-lm's `switch_mlp`; a per-expert set missing an expert is a ValueError."""
    # The Hub layout stores the conv as [C, 1, K] and norms as offsets from 1; mlx-lm
    # conversions store [C, K, 1] and the norms with the 1 already added.
    hub_layout = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())
    out, per_expert = {}, {}
    for key, value in weights.items():
        key = local_path(key, mtp=mtp)
        if key is None:
            continue
        if key == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        if key.endswith("conv1d.weight"):
            key = key.replace("conv1d.weight", "conv_weight")
            value = value[:, 0, :] if hub_layout else value[:, :, 0]
        elif hub_layout and (key.endswith(_NORM_SUFFIXES) or key in _NORMS):
            value = value + 1.0
        if key.endswith("mlp.experts.gate_up_proj"):
            mid = value.shape[-2] // 2
            base = key[: -len("experts.gate_up_proj")] + "switch_mlp."
            out[base + "gate_proj.weight"] = value[..., :mid, :]
            out[base + "up_proj.weight"] = value[..., mid:, :]
            continue
        if key.endswith("mlp.experts.down_proj"):
            key = key[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"
        if m := _PER_EXPERT.fullmatch(key):
            per_expert.setdefault((m["mlp"], m["proj"]), {})[int(m["e"])] = value
            continue
        out[key] = value
    for (mlp, proj), experts in per_expert.items():
        if sorted(experts) != list(range(arch.num_experts)):
            have = f"{len(experts)} of experts 0-{max(experts)}" if experts else "none"
            raise ValueError(
                f"{mlp}.experts.N.{proj}.weight: need one tensor for each of the "
                f"{arch.num_experts} experts, found {have}"
            )
        out[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in sorted(experts)])
    return out


# One expert's projection in the per-expert layout (Qwen3-Next, and the MTP layer of
# Qwen3.5-35B-A3B, whose decoder layers store the experts fused as `experts.gate_up_proj`).
_PER_EXPERT = re.compile(
    r"(?P<mlp>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
)
