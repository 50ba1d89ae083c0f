"""chatml-engine: an on-device ChatML chat engine for Qwen3.5 hybrid models on MLX."""

import importlib.util as _util
import os as _os
from pathlib import Path as _Path

# This repo's `kernels/` sits beside `engine/` (source tree or site-packages). Another
# distribution's top-level `kernels` found first (Hugging Face's, which transformers >= 5.25
# installs) would fail later with a puzzling ImportError: name it now.
_found = _util.find_spec("kernels")
_where = _Path(_found.origin).resolve().parent if _found and _found.origin else None
if _where != _Path(__file__).resolve().parent.parent / "kernels":
    raise ImportError(
        f"chatml-engine's `kernels` package is shadowed by {_found.origin if _found else None} "
        "(another package of that name, e.g. Hugging Face's `kernels`, which transformers >= "
        "5.25 installs): `pip uninstall kernels` and keep transformers < 5.25"
    )

# float32 means float32 on GPUs too: MLX computes float32 matmuls in TF32 on CUDA (and, its docs
# say, on M5-class Apple GPUs) unless told not to, before its first such product. Measured on an
# H200: 3e-4 relative error per product, and a chunked prefill's recurrent state 5e-4 off the
# sequential recurrence instead of 2e-7, beyond the cache contract's float32 bound. bfloat16
# (the GPU default) is unaffected; MLX_ENABLE_TF32=1 opts back in.
_os.environ.setdefault("MLX_ENABLE_TF32", "0")

from kernels import blas as _blas  # noqa: E402
from kernels import heap as _heap  # noqa: E402

_blas.enable()  # must run before MLX loads: MLX resolves cblas_sgemm at load time
_heap.enable()  # before the weights and the first step: freed step buffers stay mapped

# On Linux the `mlx` wheel holds no libmlx.so: the backend packages (mlx-cpu, mlx-cuda-12/13)
# ship it, and setup.py adds none where an NVIDIA driver is present. Name the way out.
try:
    import mlx.core  # noqa: E402, F401
except ImportError as _e:
    if "libmlx" not in str(_e):
        raise
    raise ImportError(
        f"MLX has no backend installed ({_e}): install exactly one, with "
        'pip install -e ".[cpu]" (or ".[cuda]" for CUDA 12, ".[cuda13]") in this checkout'
    ) from None

from .engine import Engine, load  # noqa: E402
from .session import TurnConflict  # noqa: E402
from .stateless import ChatError  # noqa: E402

__all__ = ["ChatError", "Engine", "TurnConflict", "load"]
