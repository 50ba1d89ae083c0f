"""chatml-engine: an on-device ChatML chat engine for Qwen3.5 hybrid models on MLX."""

from kernels import blas as _blas

_blas.enable()  # must run before MLX loads: MLX resolves cblas_sgemm at load time

from .engine import Engine, load  # noqa: E402
from .session import TurnConflict  # noqa: E402
from .stateless import ChatError  # noqa: E402

__all__ = ["ChatError", "Engine", "TurnConflict", "load"]
