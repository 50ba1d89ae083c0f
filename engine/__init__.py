"""chatml-engine: an on-device ChatML chat engine for Qwen3.5 hybrid models on MLX."""

import importlib.util as _util
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

from kernels import blas as _blas  # noqa: E402
from kernels import heap as _heap  # noqa: E402

_blas.enable()  # must run before MLX loads: MLX resolves cblas_sgemm at load time
_heap.enable()  # before the weights and the first step: freed step buffers stay mapped

from .engine import Engine, load  # noqa: E402
from .session import TurnConflict  # noqa: E402
from .stateless import ChatError  # noqa: E402

__all__ = ["ChatError", "Engine", "TurnConflict", "load"]
