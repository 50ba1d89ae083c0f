"""kernels.heap: with glibc's thresholds pinned, a step that allocates and frees several
multi-MiB buffers (as a batched decode step does) stops page-faulting them back in."""

import json
import os
import platform
import subprocess
import sys

import pytest

from kernels import heap

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's (Linux); other platforms keep their allocator",
)

# Eight "steps", each evaluating eight 8 MiB arrays at once and freeing them: glibc's own
# policy hands most of the 64 MiB back to the kernel after every such step.
STEPS = """
import json, resource
import engine
import mlx.core as mx
from kernels import heap

faults = []
for i in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [mx.arange(2 << 20, dtype=mx.float32) * (i + j) for j in range(8)]
    mx.eval(xs)
    del xs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults[2:], "policy": heap.info()}))
"""


def run_steps(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("CHATML_MALLOC", *heap._GLIBC_VARS)}
    out = subprocess.run([sys.executable, "-c", STEPS], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def test_pinned_thresholds_stop_refaulting_freed_step_buffers():
    pages = (8 * (8 << 20)) // os.sysconf("SC_PAGE_SIZE")  # touched per step
    glibc = run_steps(CHATML_MALLOC="0")
    pinned = run_steps()
    assert "CHATML_MALLOC=0" in glibc["policy"]
    assert pinned["policy"].startswith("mmap threshold 32 MiB")
    # glibc's policy refaults the buffers' pages every step; pinned, almost none are
    assert sum(glibc["faults"]) >= len(glibc["faults"]) * pages // 4, glibc
    assert sum(pinned["faults"]) <= len(pinned["faults"]) * pages // 50, pinned


def test_the_environment_and_chatml_malloc_0_keep_glibcs_policy(monkeypatch):
    monkeypatch.delenv("CHATML_MALLOC", raising=False)
    for var in heap._GLIBC_VARS:
        monkeypatch.delenv(var, raising=False)
    assert heap._skip_reason() is None
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert heap._skip_reason() == "kept the environment's MALLOC_TRIM_THRESHOLD_"
    monkeypatch.setenv("CHATML_MALLOC", "off")
    assert "CHATML_MALLOC=0" in heap._skip_reason()
    assert heap.info()  # this process pinned them (or said why not) when engine was imported
