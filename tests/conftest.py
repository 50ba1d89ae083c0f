"""Shared fixtures: one CHATML_HOME per test run, so `tiny` is built once and reused."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# Native kernel builds kept across test runs (`native` keys each build by its sources, MLX,
# nanobind, Python and the CPU's flags). CHATML_TEST_KERNELS= (empty) builds afresh every run.
KERNEL_CACHE = os.environ.get(
    "CHATML_TEST_KERNELS", str(Path.home() / ".cache" / "chatml-engine-tests" / "kernels")
)


def _throwaway_home() -> str:
    """This run's CHATML_HOME; its kernels/ is the cross-run cache (a ~30 s build saved)."""
    home = Path(tempfile.mkdtemp(prefix="chatml-test-home-"))
    if KERNEL_CACHE:
        cache = Path(KERNEL_CACHE)  # builds are keyed by CPU flags too (native._key)
        cache.mkdir(parents=True, exist_ok=True)
        (home / "kernels").symlink_to(cache, target_is_directory=True)
    return str(home)


# Set before any test imports engine: every build goes to a throwaway home for this run, one
# per pytest-xdist worker (never the user's CHATML_HOME: two workers would build into it at
# once, and tests must not touch a real home).
os.environ["CHATML_HOME"] = _throwaway_home()
# The suite's exactness bounds are float32's: on a GPU the registry would load bfloat16 (tests of
# half precision ask for it by name). engine sets MLX_ENABLE_TF32=0 for the same reason.
os.environ.setdefault("CHATML_DTYPE", "float32")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core: OpenBLAS at one thread each, or its threads (which spin after each
    # call) take the core another worker computes on. The native kernels' pool keeps its
    # default, so its threaded paths still run in process.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import engine  # noqa: E402,F401  (first: the fast BLAS must load before any test imports mlx)


@pytest.fixture(scope="session", autouse=True)
def native_kernels():
    """Build the native CPU kernels into this run's CHATML_HOME before any test: every float32
    CPU engine uses them, and a first build inside a CLI subprocess under a test's timeout
    (~30 s of CPU, minutes on a loaded machine) would fail that test instead. Built once per
    kernel sources (KERNEL_CACHE), not once per run."""
    from kernels import native

    lock = native.build_dir().parent / ".test-build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:  # concurrent runs sharing the cache build once, not each
        fcntl.flock(f, fcntl.LOCK_EX)
        native.module()


@pytest.fixture
def first_logits(monkeypatch):
    """Record the logits each turn's prefill returns (the ones that start the answer)."""
    import engine.runtime.sequence as sequence_module

    seen = []
    real = sequence_module.prefill_steps

    def recording(*args, **kwargs):
        logits, pos = yield from real(*args, **kwargs)
        seen.append(logits)
        return logits, pos

    monkeypatch.setattr(sequence_module, "prefill_steps", recording)
    return seen


@pytest.fixture(scope="module")
def mod():
    """The native kernels' module, loaded afresh for the test module (a test before may have
    left `kernels.native` reset or forced off)."""
    from kernels import native

    native.reset()
    m = native.module()
    assert m is not None, native.info().reason  # a compiler is present in CI: it must build
    return m


@pytest.fixture(scope="module")
def server(tiny):
    """A live server on `tiny` per test module (context window `helpers.SERVER_WINDOW`). No
    idle-time warm-up, so reuse is what each request itself found (deterministic); no
    grammar tokenizer built at start-up (a module that needs it builds it once, on use)."""
    from helpers import SERVER_WINDOW

    from engine.serving.server import BackgroundServer, ServerConfig

    config = ServerConfig(port=0, context_window=SERVER_WINDOW, warm=False, prepare_grammar=False)
    with BackgroundServer(tiny, config) as srv:
        yield srv


@pytest.fixture(scope="session")
def tiny():
    """The embedded `tiny` engine, float32, loaded once per run."""

    return engine.load("tiny")


@pytest.fixture(scope="session")
def tiny_sequential():
    """`tiny` with the sequential gated-delta path (the reference for the chunked kernel)."""

    return engine.load("tiny", chunked_delta=False)


@pytest.fixture(scope="session")
def tiny_bf16():
    """The embedded `tiny` engine computing in bfloat16 (the GPU dtype), on this CPU."""

    return engine.load("tiny", dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """tiny with a mixture-of-experts FFN (the 35B-A3B layout: routed + shared experts)."""
    import dataclasses

    from engine.checkpoints import registry
    from engine.checkpoints.builder import build

    t = registry.get("tiny")
    arch = dataclasses.replace(
        t.arch, intermediate_size=0, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    path = build(
        dataclasses.replace(t, name="tiny-moe", arch=arch), tmp_path_factory.mktemp("m") / "moe"
    )
    return engine.load(str(path), chunked_delta=False)
