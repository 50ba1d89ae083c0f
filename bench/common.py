"""What every benchmark shares: the conditions of a run, the checkpoints, mlx-lm loading.

Benchmarks record where they ran (CPU, cores, mlx and mlx-lm versions, BLAS, dtype, thread
settings) next to every number, because the numbers mean nothing without them. Checkpoints of
the true architectures are built once from the registry with seeded random weights (speed does
not depend on the values) and cached under `$CHATML_HOME/bench-models/`, never in git.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Thread settings that change CPU numbers; recorded, never set behind the user's back.
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MLX_NUM_THREADS", "CHATML_BLAS",
               "CHATML_GEMV_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # fmt: skip


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


ROOT = Path(__file__).resolve().parents[1]  # the repository: where child interpreters run


def child_env(blas: str) -> dict[str, str]:
    """Environment for a benchmark's child interpreter: CHATML_BLAS=`blas`, this repo importable.

    The BLAS must be chosen before mlx is first imported, so settings that differ run in
    interpreters of their own.
    """
    env = dict(os.environ, CHATML_BLAS=blas)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def write_json(path: str | None, result: dict) -> None:
    """Write a bench result where `--json` asked for it (its folder created)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))


def save_plot(fig, axes, file: str) -> None:
    """Grid and legend on each of `axes`, then `fig` to the PNG `file` (its folder made)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(file).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(file, dpi=90)
    plt.close(fig)


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def conditions(**extra) -> dict:
    """The machine and software a measurement ran on (call after `import engine`)."""
    import mlx.core as mx

    from kernels import blas

    info = blas.info()
    out = {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": info.provider,
        "blas_library": info.library,
        "blas_core": blas.core(),  # OpenBLAS's kernel set (OPENBLAS_CORETYPE can force one)
        "env": {k: os.environ[k] for k in THREAD_VARS if k in os.environ},
        "load_average": _load_average(),
    }
    out.update(extra)
    return out


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def bench_models_dir() -> Path:
    from engine.paths import chatml_home

    return chatml_home() / "bench-models"


def model_path(name: str, models_dir: str | None = None, dtype: str = "float32") -> Path:
    """A checkpoint folder for `name`: a folder as given, `tiny` embedded, or built once."""
    from engine.checkpoints import registry
    from engine.checkpoints.builder import build
    from engine.checkpoints.loader import resolve

    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    entries = registry.registry()
    if name not in entries:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(entries)} or a folder")
    entry = entries[name]
    if entry.embedded:
        return resolve(name)[0]
    out = Path(models_dir).expanduser() if models_dir else bench_models_dir()
    out = out / f"{name}-{dtype}"
    if not (out / "config.json").exists():
        print(f"building {name} ({dtype}) under {out} (once)", file=sys.stderr)
        build(entry, out, dtype=dtype, progress=True)
    return out


def mlx_lm_model(path: Path):
    """mlx-lm's model for a checkpoint folder, without its tokenizer: building that is nearly
    all of `mlx_lm.load`'s time, and a logits comparison never uses it."""
    from mlx_lm.utils import load_model

    return load_model(Path(path))[0]


def load_mlx_lm(path: Path):
    """mlx-lm's own loader on the same folder, computing in float32 like the engine on CPU."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)  # fairness: bfloat16 matmuls skip BLAS on CPUs
    mx.eval(model.parameters())  # weights load lazily: keep that out of the first timing
    return model, tokenizer


def special_ids(vocab_size: int) -> list[int]:
    """Ids the benchmarks never sample: special tokens and the unused rows past them.

    Masking these gives every engine the same fixed decode length (no EOS), and keeps
    random-weight gibberish from opening think or tool-call blocks that would change the
    conversation's shape.
    """
    from engine.checkpoints.tokenizer import special_tokens

    first = min(i for i, _ in special_tokens())
    return list(range(first, vocab_size))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def best_seconds(fn: Callable[[], object], repeats: int, *, warmup: bool = False) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one untimed call with `warmup`:
    page faults, thread pools)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fresh_greedy(eng, ids, max_tokens: int = 5, bias: dict[int, float] | None = None):
    """The reference for anything cached or drafted: greedy tokens after one full prefill of
    `ids` on fresh caches (the model's own forward; no session, no snapshots), stopping at a
    stop token, and the logits that started them. `bias` ({token id: amount}, OpenAI's
    logit_bias) is added to the logits in numpy before each argmax."""
    import mlx.core as mx
    import numpy as np

    caches = eng.model.make_caches()
    logits = first = eng.model(mx.array([list(ids)]), caches)[0, -1]
    out = []
    while len(out) < max_tokens:
        if bias:
            x = np.array(logits.astype(mx.float32), dtype=np.float64)
            for t, b in bias.items():
                x[t] += b
            token = int(np.argmax(x))
        else:
            token = mx.argmax(logits).item()
        if token in eng.stop_ids:
            break
        out.append(token)
        if len(out) < max_tokens:
            logits = eng.model(mx.array([[token]]), caches)[0, -1]
    return out, first
