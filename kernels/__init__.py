"""Compute kernels: chunked gated delta rule, fast BLAS for MLX on Linux CPUs, native
quantized GEMV (`kernels.native`, built at first use).

``import kernels`` and ``import kernels.blas`` must not import mlx: ``kernels.blas.enable()``
has to load the BLAS library before mlx's shared library is loaded. The MLX kernels are
therefore imported lazily, on first attribute access.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "gated_delta",
    "gated_delta_kept",
    "gated_delta_reference",
    "gated_delta_rows",
    "unit_lower_inverse",
]

_LAZY = {
    "gated_delta": "kernels.delta_rule",
    "gated_delta_kept": "kernels.delta_rule",
    "gated_delta_rows": "kernels.delta_rule",
    "gated_delta_reference": "kernels.reference",
    "unit_lower_inverse": "kernels.triangular",
}


def __getattr__(name: str) -> Any:
    # Lazy so that importing the package (e.g. for kernels.blas) never pulls in mlx.
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
