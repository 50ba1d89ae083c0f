"""Plain sequential gated delta recurrence in numpy float64, the ground truth for tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def gated_delta_reference(
    q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Sequential recurrence in float64, same shapes and meaning as ``kernels.gated_delta``.

    Per step: S = S * g; kv = S @ k; delta = (v - kv) * beta; S += delta ⊗ k; y = S @ q.
    Accepts numpy or mlx arrays; returns float64 numpy ``(y [B,T,Hv,Dv], S [B,Hv,Dv,Dk])``.
    """
    q, k, v, g, beta = (_f64(x) for x in (q, k, v, g, beta))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    if Hv > Hk:  # key head j serves value heads j*r .. j*r+r-1, like mlx-lm's mx.repeat
        q = np.repeat(q, Hv // Hk, axis=2)
        k = np.repeat(k, Hv // Hk, axis=2)
    S = np.zeros((B, Hv, Dv, Dk)) if state is None else _f64(state).copy()
    y = np.empty((B, T, Hv, Dv))
    for t in range(T):
        S *= g[:, t, :, None, None]
        kv = np.einsum("bhvk,bhk->bhv", S, k[:, t])  # [B, Hv, Dv]
        delta = (v[:, t] - kv) * beta[:, t, :, None]  # [B, Hv, Dv]
        S += delta[..., None] * k[:, t, :, None, :]
        y[:, t] = np.einsum("bhvk,bhk->bhv", S, q[:, t])
    return y, S


def _f64(x: Any) -> np.ndarray:
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):  # mlx bfloat16 has no numpy buffer format
        import mlx.core as mx

        return np.asarray(x.astype(mx.float32), dtype=np.float64)
