"""Inverse of batched unit lower-triangular matrices: native or LAPACK on the CPU, matmuls elsewhere."""

from __future__ import annotations

import mlx.core as mx

from kernels import native

# Below this size the blocked inverse switches to row-by-row forward substitution.
_BASE = 16


def unit_lower_inverse(a: mx.array, *, method: str = "auto") -> mx.array:
    """Inverse of unit lower-triangular matrices ``a: [..., n, n]``.

    ``method``: "native" (``kernels/native/delta.cpp``: vectorized rows; float32 on the CPU),
    "lapack" (``mx.linalg.tri_inv``, which only runs on the CPU stream), "blocked" (matmul-only
    block forward substitution, runs on any device), or "auto" (on the CPU native where the
    module is built and the matrices are float32, else lapack; blocked elsewhere). All are
    exact forward substitution (no Neumann series), so they stay finite for highly correlated
    keys.
    """
    if method == "auto":
        if mx.default_device() != mx.cpu:
            method = "blocked"
        else:
            method = "native" if a.dtype == mx.float32 and native.module() is not None else "lapack"
    if method == "native":
        return native.required("method 'native'").unit_lower_inverse(a)
    if method == "lapack":
        shape = a.shape
        inv = mx.linalg.tri_inv(a.reshape(-1, *shape[-2:]), upper=False, stream=mx.cpu)
        return inv.reshape(shape)
    if method == "blocked":
        return _blocked(a)
    raise ValueError(f"unknown method {method!r}")


def _blocked(a: mx.array) -> mx.array:
    # inv([[A11, 0], [A21, A22]]) = [[X11, 0], [-X22 @ A21 @ X11, X22]], Xii = inv(Aii)
    n = a.shape[-1]
    if n <= _BASE:
        return _forward_substitution(a)
    h = n // 2
    a11, a21, a22 = a[..., :h, :h], a[..., h:, :h], a[..., h:, h:]
    if n % 2 == 0:
        # One recursive call for both diagonal blocks halves the number of ops.
        x = _blocked(mx.stack([a11, a22]))
        x11, x22 = x[0], x[1]
    else:
        x11, x22 = _blocked(a11), _blocked(a22)
    x21 = -(x22 @ (a21 @ x11))  # [..., n-h, h]
    top = mx.concatenate([x11, mx.zeros((*a.shape[:-2], h, n - h), dtype=a.dtype)], axis=-1)
    bottom = mx.concatenate([x21, x22], axis=-1)
    return mx.concatenate([top, bottom], axis=-2)


def _forward_substitution(a: mx.array) -> mx.array:
    # Row i of the inverse: x_i = e_i - a[i, :i] @ x[:i]   (a has a unit diagonal)
    n = a.shape[-1]
    eye = mx.eye(n, dtype=a.dtype)
    batch = a.shape[:-2]
    rows = [mx.broadcast_to(eye[0], (*batch, n))]
    for i in range(1, n):
        prev = mx.stack(rows, axis=-2)  # [..., i, n]
        rows.append(eye[i] - (a[..., i : i + 1, :i] @ prev)[..., 0, :])
    return mx.stack(rows, axis=-2)
