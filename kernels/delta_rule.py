"""Chunked (WY / UT-transform) gated delta rule in MLX ops, for prefill.

Recurrence (per batch, value head; S: [Dv, Dk]), identical to ``mx.fast.gated_delta_update``:
    S_t = g_t S_{t-1};  u_t = beta_t (v_t - S_t k_t);  S_t += u_t k_t^T;  y_t = S_t q_t

Within a chunk of C steps starting from state S0, with b_t = sum_{r<=t} log g_r,
Gamma_t = exp(b_t) and D[t, s] = exp(b_t - b_s) for s <= t (0 above the diagonal):
    (I + A) U = diag(beta) V - diag(beta Gamma) K S0^T,  A[t, s] = beta_t D[t, s] k_t.k_s, s < t
    Y = diag(Gamma) Q S0^T + (D * Q K^T) U
    S_C = Gamma_{C-1} S0 + U^T diag(D[C-1, :]) K
Everything except the small chunk-to-chunk recurrence runs for all chunks at once as
batched matmuls, plus one unit lower-triangular inverse per chunk. Decays are taken as
direct segment sums in log space (never ratios of cumulative products), so nothing
overflows or loses precision when g is close to 0 or 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kernels import activations
from kernels.choice import MAX_STEP_T, MIN_CHUNKED_T, choose, device_kind
from kernels.triangular import unit_lower_inverse

CHUNK = 64

__all__ = ["CHUNK", "MIN_CHUNKED_T", "gated_delta", "gated_delta_kept", "gated_delta_rows"]


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    *,
    method: str = "auto",
    inverse: str = "auto",
) -> tuple[mx.array, mx.array]:
    """Gated delta rule over a sequence; same shapes and meaning as ``mx.fast.gated_delta_update``.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g (decay in (0, 1)), beta: [B, T, Hv];
    state: [B, Hv, Dv, Dk] (zeros if None). Hv must be a multiple of Hk: key head j serves
    value heads j*r .. j*r+r-1 (r = Hv/Hk), as mlx-lm does. Returns ``(y [B, T, Hv, Dv]`` in
    q's dtype, ``state [B, Hv, Dv, Dk]`` float32). Computation is float32 throughout.

    ``method``:
      - "chunked": this module's chunked algorithm (triangular inverse by LAPACK on the CPU,
        by matmul-only blocked forward substitution on a GPU, see ``unit_lower_inverse``).
      - "sequential": ``mx.fast.gated_delta_update`` (one step at a time).
      - "step": up to ``MAX_STEP_T`` tokens one after another as a few broadcast ops each:
        decode steps and short prefill segments on the CPU and CUDA.
      - "fused": the native CPU kernel (``kernels/native/delta.cpp``): the tokens one after
        another in one pass over each state row; see ``gated_delta_rows``.
      - "mlx_lm": mlx-lm's Metal kernel (Metal only).
      - "auto": ``kernels.choice.choose`` for the default device, this head shape and T.
    ``inverse``: how the chunked path inverts its triangular matrices ("auto", "lapack" or
    "blocked"; see ``kernels.triangular.unit_lower_inverse``).
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    method = _resolve(method, q, v)
    if method == "fused":
        y, (state,) = _fused(q, k, v, g, beta, [state])
        return y, state
    if method == "step":
        if T > MAX_STEP_T:
            raise ValueError(f"method 'step' takes at most {MAX_STEP_T} tokens, got T={T}")
        return _step(q, k, v, g, beta, state)
    if method == "sequential":
        # mx.fast casts every input to q's dtype: float32 q, k keep g (and so the decay) in
        # float32 as mlx-lm's kernels do; in bfloat16 a rounded g near 1 costs ~10x the error.
        f32 = mx.float32
        y, state = mx.fast.gated_delta_update(
            q.astype(f32), k.astype(f32), v, g, beta, state.astype(f32)
        )
        return y.astype(q.dtype), state.astype(f32)
    if method == "mlx_lm":
        from mlx_lm.models.gated_delta import gated_delta_kernel

        y, state = gated_delta_kernel(q, k, v, g.astype(mx.float32), beta, state)
        return y.astype(q.dtype), state
    if method != "chunked":
        raise ValueError(f"unknown method {method!r}")
    y, state, _ = _chunked(q, k, v, g, beta, state, inverse)
    return y, state


def gated_delta_kept(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    keep: Sequence[int],
    *,
    method: str = "auto",
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """``gated_delta``, plus the state after each of the first `keep[i]` steps (0 < keep[i] < T,
    increasing): the snapshots a prefill takes at ChatML boundaries inside a chunk.

    The chunked path reads them off the pass over the whole sequence (one small matmul each,
    see ``_chunked``); splitting the sequence at each of them instead would pad every piece to a
    whole chunk (a 300-token prefill with 14 snapshots cost 1.6x one without). Other methods
    go from one kept position to the next.
    """
    T = q.shape[1]
    keep = list(keep)
    if any(not 0 < a < T for a in keep) or keep != sorted(set(keep)):
        raise ValueError(f"keep must be increasing positions inside (0, {T}), got {keep}")
    if state is None:
        state = mx.zeros((q.shape[0], *v.shape[2:], q.shape[-1]), dtype=mx.float32)
    if _resolve(method, q, v) == "chunked":
        return _chunked(q, k, v, g, beta, state, keep=keep)
    ys, kept, start = [], [], 0
    for end in [*keep, T]:
        seg = slice(start, end)
        args = (x[:, seg] for x in (q, k, v, g, beta))
        y, state = gated_delta(*args, state, method=method)
        ys.append(y)
        kept.append(state)
        start = end
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), state, kept[:-1]


def gated_delta_rows(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    states: list[mx.array],
    *,
    method: str = "auto",
) -> tuple[mx.array, list[mx.array]]:
    """``gated_delta`` for B rows whose states are separate arrays, as in a batched decode
    step where each sequence keeps its own: ``states[i]`` is ``[b_i, Hv, Dv, Dk]`` with the
    b_i adding up to B (rows in order). Returns y and the states after, one array per input.

    "fused" (``auto`` picks it for a few tokens on the CPU where the native module is built)
    reads each state where it is and writes each row's new state as its own array: one read
    and one write per state. Any other method stacks the states for the step (a copy) and
    returns slices of the stacked result.
    """
    method = _resolve(method, q, v)
    if method == "fused":
        return _fused(q, k, v, g, beta, states)
    if len(states) == 1:
        y, state = gated_delta(q, k, v, g, beta, states[0], method=method)
        return y, [state]
    y, state = gated_delta(q, k, v, g, beta, mx.concatenate(states), method=method)
    cuts, at = [], 0
    for s in states[:-1]:
        at += s.shape[0]
        cuts.append(at)
    return y, mx.split(state, cuts)


def _resolve(method: str, q: mx.array, v: mx.array) -> str:
    """`method`, or for "auto" what ``kernels.choice.choose`` picks here for these heads."""
    if method != "auto":
        return method
    _, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    device = device_kind()
    native = device == "cpu" and _native() is not None
    # the BLAS asked only where it matters: a CPU prefill without the native pass
    fast = device != "cpu" or native or T < MIN_CHUNKED_T or _fast_matmul()
    return choose(device, Hk, Hv, Dk, Dv, T, fast_matmul=fast, native=native)


def _native():
    from kernels import native

    return native.module()


def _fused(q, k, v, g, beta, states: list[mx.array]) -> tuple[mx.array, list[mx.array]]:
    """The native kernel; float32 inside, y in q's dtype."""
    from kernels import native

    mod = native.required("method 'fused'")
    f32 = mx.float32
    inputs = (x.astype(f32) for x in (q, k, v, g, beta))
    y, *states = mod.gated_delta_rows(*inputs, [s.astype(f32) for s in states])
    return y.astype(q.dtype), states


def _step(q, k, v, g, beta, state) -> tuple[mx.array, mx.array]:
    """A few tokens of the recurrence, one after another, as broadcast ops (float32): what
    ``mx.fast.gated_delta_update`` does on the CPU and CUDA, in about a quarter of the graph
    nodes per token (9 against ~34; each node costs microseconds to dispatch, and a short
    prefill segment or a decode step is all dispatch). Value heads are grouped under their key
    head (``[B, Hk, r, ...]``) instead of repeating q and k; the inputs are cast and split once.
    """
    f32 = mx.float32
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk

    def per_token(x: mx.array, *shape: int) -> list[mx.array]:
        x = x.astype(f32).reshape(B, T, *shape)
        return [x] if T == 1 else mx.split(x, T, axis=1)

    qs, ks = per_token(q, Hk, 1, 1, Dk), per_token(k, Hk, 1, 1, Dk)
    vs, gs = per_token(v, Hk, r, Dv, 1), per_token(g, Hk, r, 1, 1)
    bs = per_token(beta, Hk, r, 1, 1)
    S = state.astype(f32).reshape(B, 1, Hk, r, Dv, Dk)
    ys = []
    for qt, kt, vt, gt, bt in zip(qs, ks, vs, gs, bs):
        S = S * gt
        delta = (vt - (S * kt).sum(axis=-1, keepdims=True)) * bt  # [B, 1, Hk, r, Dv, 1]
        S = S + delta * kt
        ys.append((S * qt).sum(axis=-1))  # [B, 1, Hk, r, Dv]
    y = ys[0] if T == 1 else mx.concatenate(ys, axis=1)
    return y.reshape(B, T, Hv, Dv).astype(q.dtype), S.reshape(B, Hv, Dv, Dk)


def _fast_matmul() -> bool:
    import sys

    if sys.platform == "darwin":
        return True
    from kernels import blas

    return blas.info().fast


def _segsum(a: mx.array) -> mx.array:
    """seg[..., t, s] = sum_{s < r <= t} a[..., r] for s <= t, -inf above the diagonal.

    Summed directly (masked cumsum) rather than as b_t - b_s, so small segments do not
    inherit the rounding error of a long cumulative sum. a: [..., C] -> [..., C, C].
    """
    C = a.shape[-1]
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    x = mx.where(strict, a[..., :, None], 0.0)  # x[t, s] = a_t for t > s
    seg = mx.cumsum(x, axis=-2)
    return mx.where(lower, seg, -mx.inf)


def _chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    inverse: str = "auto",
    keep: Sequence[int] = (),
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """y, the final state, and the states after the first `keep[i]` steps."""
    out_dtype = q.dtype
    f32 = mx.float32
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    C = CHUNK
    N = -(-T // C)
    pad = N * C - T

    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if Hv > Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    a = mx.log(g)  # [B, T, Hv]
    if pad:
        # Padded steps are identities: k = 0, beta = 0 (no write), log g = 0 (no decay).
        zpad = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v = mx.pad(q, zpad), mx.pad(k, zpad), mx.pad(v, zpad)
        a, beta = mx.pad(a, zpad[:3]), mx.pad(beta, zpad[:3])

    def chunks(x: mx.array) -> mx.array:  # [B, N*C, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, Hv, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)  # [B, H, N, C, D]
    a, beta = chunks(a)[..., 0], chunks(beta)[..., 0]  # [B, H, N, C]

    # D[t, s]: [B, H, N, C, C], 0 above the diagonal. C exps per step: on a CPU the native
    # vectorized exp (MLX's is scalar on x86: a fifth of this function at 512 tokens).
    decay = activations.exp(_segsum(a), native=device_kind() == "cpu")
    gamma = mx.exp(mx.cumsum(a, axis=-1))  # Gamma_t: [B, H, N, C]
    kt = k.swapaxes(-1, -2)  # [B, H, N, Dk, C]

    # (I + A)^-1, one unit lower-triangular inverse per chunk.
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    attn_kk = mx.where(strict, beta[..., :, None] * decay * (k @ kt), 0.0)  # [B, H, N, C, C]
    inv = unit_lower_inverse(attn_kk + mx.eye(C, dtype=f32), method=inverse)

    w = inv @ (k * (beta * gamma)[..., None])  # [B, H, N, C, Dk]
    u0 = inv @ (v * beta[..., None])  # [B, H, N, C, Dv]
    attn_qk = decay * (q @ kt)  # [B, H, N, C, C], causal incl. the diagonal
    # y = Gamma Q S0^T + P (u0 - w S0^T) = P u0 + (Gamma Q - P w) S0^T
    q_eff = q * gamma[..., None] - attn_qk @ w  # [B, H, N, C, Dk]
    y_intra = attn_qk @ u0  # [B, H, N, C, Dv]
    k_dec = k * decay[..., -1, :, None]  # k_s exp(b_{C-1} - b_s): [B, H, N, C, Dk]
    g_chunk = gamma[..., -1]  # total decay per chunk: [B, H, N]
    # Stack w and q_eff so each chunk step needs one matmul against the state.
    wq = mx.concatenate([w, q_eff], axis=-2)  # [B, H, N, 2C, Dk]

    s = state.astype(f32)  # [B, H, Dv, Dk]
    ys, kept = [], []
    for n in range(N):
        r = wq[:, :, n] @ s.swapaxes(-1, -2)  # [B, H, 2C, Dv]
        u = u0[:, :, n] - r[:, :, :C]  # [B, H, C, Dv]
        ys.append(y_intra[:, :, n] + r[:, :, C:])
        for j in (p - n * C for p in keep if n * C < p < (n + 1) * C):
            # after j steps of this chunk: S_j = Gamma_{j-1} S0 + U[:j]^T diag(D[j-1, :j]) K[:j]
            k_j = k[:, :, n, :j] * decay[:, :, n, j - 1, :j, None]
            s_j = s * gamma[:, :, n, j - 1, None, None] + u[:, :, :j].swapaxes(-1, -2) @ k_j
            kept.append(s_j)
        s = s * g_chunk[:, :, n, None, None] + u.swapaxes(-1, -2) @ k_dec[:, :, n]
        if (n + 1) * C in keep:
            kept.append(s)
    y = mx.stack(ys, axis=2)  # [B, H, N, C, Dv]
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, N * C, Hv, Dv)[:, :T]
    return y.astype(out_dtype), s, kept
