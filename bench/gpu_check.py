"""One-shot check of the engine on a GPU (or, with --quick, on any machine): one JSON line.

    python -m bench.gpu_check            # on the GPU machine: 3-5 minutes
    python -m bench.gpu_check --quick    # small sizes, ~1 minute on a CPU (tests run this)

Sections (each one's failure is recorded in "errors" and the others still run):
- device: MLX version and backend packages, device kind/name, memory limits;
- kernels: for the linear-attention heads of tiny, 0.8B, 9B and 27B at T in {1, 7, 64, 512},
  in bfloat16 (what a GPU runs), every gated delta path against the float64 recurrence
  (kernels.reference): max error relative to the output's scale, output dtypes, time, and
  what kernels.choice picks; "fast_raw" is mx.fast with bfloat16 q, k (g rounded, as the
  engine no longer does);
- bf16_vs_mlx_lm: tiny in bfloat16, teacher-forced logits against mlx-lm, greedy agreement
  (and the MoE layout on a GPU; MLX's CPU gather_mm is float32 only); quantized_vs_mlx_lm:
  tiny converted by mlx-lm to 4 bits (kept quantized on a GPU);
- threads: 300 threads each evaluating one small op on the default device (failures, and the
  OS threads left: MLX keeps a stream per thread);
- memory: active MLX memory held after 10 snapshots against what the byte budget counts;
- picks: a batched step's sampled picks, 8 seeded rows over Qwen3.5's vocabulary, made
  together (`sampling.pick_rows`: one set of MLX ops over the stacked rows on a GPU) against
  one pick per row (`bench.sampling.measure_rows`);
- speed: prefill and decode tokens/s of the 0.8B build (random weights, bfloat16) against
  mlx-lm on the same device, each warmed first; the engine's first decode step apart (it
  compiles the step: on CUDA through NVRTC, 13-55 s with MLX's kernel cache cold);
- tests (GPU only): the model, kernel, warm, cache and quantized test files on this device
  (float32 as the suite sets it, bfloat16 in test_bfloat16), failures named.

Getting MLX's CUDA backend onto a lent machine without network (first done on 2026-12-04 for
an H200 whose image had CUDA 13 wheels beside torch cu130, Python 3.12, and a 64 MiB allowance
for files): `python -m bench.gpu_carry` downloads the wheels the image lacks, cuts mlx-cuda-13
0.32.4 (89.8 MB; libmlx.so 146 MB, 67 MB of it CUDA fatbin at ~9 MB per architecture, 23 MB
symbol table) to sm_90 and stripped (20 MB as tar.xz), and writes `.whl/run.sh`, which
installs everything with `pip install --no-index --no-deps --target`, merges the image's
nvidia/ folder beside the crt headers (nvidia-cuda-crt: without them NVRTC cannot compile
kernels that include mma.h) and runs this check with `CHATML_NATIVE=off`. One device call:
`bash .whl/run.sh`, carrying `.whl` (27.5 MiB).
A user's machine needs none of this: `pip install -e ".[cuda13]"` (or `.[cuda]` for CUDA 12).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import threading
import time

HEADS = {
    "tiny": (4, 8, 32, 32),
    "0.8b": (16, 16, 128, 128),
    "9b": (16, 32, 128, 128),
    "27b": (16, 48, 128, 128),
}  # fmt: skip  (Hk, Hv, Dk, Dv)
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHello, 你好! Tell me about the weather in 北京 today.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _timed(fn, repeats: int = 3) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: compilation, allocation
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best


def device_section() -> dict:
    import mlx.core as mx

    from engine.cli import mlx_backend_packages
    from engine.runtime.memory import device_memory

    mem = device_memory()
    return {
        "mlx": mx.__version__,
        "mlx_backend_packages": mlx_backend_packages(),
        "python": platform.python_version(),
        "default_device": str(mx.default_device()),
        "kind": mem.kind,
        "info": {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))},
        "tf32": os.environ.get("MLX_ENABLE_TF32"),  # engine sets 0: float32 stays float32
        "memory_limit": mem.limit,
        "usable": mem.usable,
    }


def kernel_inputs(hk, hv, dk, dv, t, seed=0):
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, t, hk, dk))
    k = rng.standard_normal((1, t, hk, dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, t, hv, dv))
    g = rng.uniform(0.9, 1.0, (1, t, hv))
    beta = rng.uniform(0.0, 1.0, (1, t, hv))
    state = rng.standard_normal((1, hv, dv, dk)) * 0.5
    bf = mx.bfloat16
    return [mx.array(q, bf), mx.array(k, bf), mx.array(v, bf), mx.array(g, mx.float32),
            mx.array(beta, bf), mx.array(state, mx.float32)]  # fmt: skip


def kernels_section(models: list[str], ts: list[int]) -> list[dict]:
    import mlx.core as mx
    import numpy as np

    from kernels import gated_delta, gated_delta_reference
    from kernels.choice import MAX_STEP_T, choose, device_kind

    kind = device_kind()
    base = ["sequential", "chunked", "fast_raw"] + (["mlx_lm"] if kind == "metal" else [])
    rows = []
    for model in models:
        hk, hv, dk, dv = HEADS[model]
        for t in ts:
            inputs = kernel_inputs(hk, hv, dk, dv, t)
            y_ref, s_ref = gated_delta_reference(*inputs)
            row = {"model": model, "T": t, "choice": choose(kind, hk, hv, dk, dv, t)}
            for method in base + (["step"] if t <= MAX_STEP_T else []):
                if method == "fast_raw":
                    run = lambda a=inputs: mx.fast.gated_delta_update(*a)  # noqa: E731
                else:
                    run = lambda a=inputs, m=method: gated_delta(*a, method=m)  # noqa: E731
                try:
                    y, s = run()
                    err_y = np.abs(np.array(y.astype(mx.float32), np.float64) - y_ref).max()
                    err_s = np.abs(np.array(s, np.float64) - s_ref).max()
                    row[method] = {
                        "err_y": float(err_y / np.abs(y_ref).max()),
                        "err_state": float(err_s / np.abs(s_ref).max()),
                        "dtypes": [str(y.dtype).rsplit(".")[-1], str(s.dtype).rsplit(".")[-1]],
                        "ms": round(_timed(run) * 1e3, 3),
                    }
                except Exception as e:  # a path this device lacks: recorded, not fatal
                    row[method] = {"error": f"{type(e).__name__}: {e}"[:200]}
            rows.append(row)
    return rows


def bf16_section(quick: bool, moe: bool = False) -> dict:
    import engine

    path = _bf16_tiny(moe)
    return compare_with_mlx_lm(engine.load(str(path), dtype="bfloat16"), path, quick)


def quantized_section(quick: bool) -> dict:
    """tiny converted by mlx-lm to 4 bits: kept quantized on every device (on a CPU through
    the native GEMV or MLX's ops, see engine/runtime/quantized.py); float32 activations on
    both sides (mlx-lm computes in the scales' dtype)."""
    from mlx_lm import convert

    import engine
    from engine.checkpoints.loader import resolve
    from engine.paths import chatml_home

    out = chatml_home() / "bench-models" / "tiny-4bit"
    if not (out / "config.json").exists():
        convert(str(resolve("tiny")[0]), mlx_path=str(out), quantize=True, q_bits=4,
                q_group_size=64)  # fmt: skip
    eng = engine.load(str(out), dtype="float32")
    return {"kept_quantized": _has_quantized(eng.model), **compare_with_mlx_lm(eng, out, quick)}


def _has_quantized(model) -> bool:
    import mlx.nn as nn

    leaves = nn.utils.tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    return any(hasattr(m, "bits") for _, m in leaves)


def compare_with_mlx_lm(eng, path, quick: bool) -> dict:
    """Teacher-forced logits of the engine against mlx-lm on the same folder and ids."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from bench.common import mlx_lm_model

    ref = mlx_lm_model(path)
    prompt = eng.tokenizer.encode(PROMPT * (1 if quick else 3))
    answer = [t for t, _ in generate_step(mx.array(prompt), ref, max_tokens=12)]
    ids = prompt + answer
    ours = eng.model(mx.array([ids]), eng.model.make_caches())[0].astype(mx.float32)
    theirs = ref(mx.array([ids]), cache=ref.make_cache())[0].astype(mx.float32)
    diff = mx.abs(ours - theirs)
    top2 = mx.topk(theirs, 2, axis=-1)  # a partition, not a sort of the 248k vocabulary
    clear = mx.abs(top2[:, 1] - top2[:, 0]) > 0.05
    agree = mx.argmax(ours, -1) == mx.argmax(theirs, -1)
    return {
        "tokens": len(ids),
        "max_diff": diff.max().item(),
        "mean_diff": diff.mean().item(),
        "argmax_agree": agree.mean().item(),
        "clear_positions": clear.sum().item(),
        "clear_disagree": mx.where(clear, ~agree, False).sum().item(),
    }


def _bf16_tiny(moe: bool = False):
    """tiny (or tiny with the 35B-A3B expert layout) saved in bfloat16, built once."""
    import dataclasses

    from engine.checkpoints import registry
    from engine.checkpoints.builder import build
    from engine.paths import chatml_home

    entry = registry.get("tiny")
    if moe:
        arch = dataclasses.replace(entry.arch, intermediate_size=0, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)  # fmt: skip
        entry = dataclasses.replace(entry, name="tiny-moe", arch=arch)
    out = chatml_home() / "bench-models" / f"{entry.name}-bfloat16"
    if not (out / "config.json").exists():
        build(entry, out, dtype="bfloat16")
    return out


def threads_section(n: int) -> dict:
    import mlx.core as mx

    errors = []

    def work(i):
        try:
            a = mx.full((64, 64), float(i % 7))
            mx.eval(a @ a)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:200])

    before = _os_threads()
    for i in range(n):
        t = threading.Thread(target=work, args=(i,))
        t.start()
        t.join()
    return {"threads": n, "failures": len(errors), "first_error": errors[:1],
            "os_threads_before": before, "os_threads_after": _os_threads()}  # fmt: skip


def _os_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def memory_section() -> dict:
    import mlx.core as mx

    import engine
    from engine.runtime.sequence import CachedSequence

    eng = engine.load("tiny")
    text = "<|im_start|>user\n" + "Hello there, 你好! How are you doing today? " * 20
    ids = eng.tokenizer.encode(text)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    seq = CachedSequence(eng)
    step = max(1, len(ids) // 11)
    seq.extend(ids, stops=range(step, len(ids), step)[:10], chunk=64)
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    return {"snapshots": len(seq.snapshots), "held_bytes": held,
            "counted_bytes": seq.cache_bytes, "ratio": held / max(seq.cache_bytes, 1),
            "budget_bytes": eng.budget.max_bytes}  # fmt: skip


def picks_section(quick: bool) -> dict:
    from bench.sampling import measure_rows

    return measure_rows(4096 if quick else 248320, 8, 3 if quick else 20)


def speed_section(model: str, prefill_t: int, decode_n: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    import engine
    from bench.common import mlx_lm_model, model_path
    from engine.runtime.generate import decode, prefill
    from engine.runtime.sampling import Sampler, SamplingParams

    path = model_path(model, dtype="bfloat16")
    ids = np.random.default_rng(prefill_t).integers(0, 151000, prefill_t).tolist()
    out = {"model": model, "prefill_tokens": prefill_t, "decode_tokens": decode_n}

    eng = engine.load(str(path), dtype="bfloat16")

    def ours_prefill():
        caches = eng.model.make_caches()
        t = time.perf_counter()
        logits, _ = prefill(eng.model, caches, ids, 0)
        mx.eval(logits)
        return time.perf_counter() - t, caches, logits

    def ours_decode(n):
        """(the first decode step's seconds, tokens/s over the steps after it)"""
        _, caches, logits = ours_prefill()
        steps = decode(eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=n,
                       stop_ids=(), history=list(ids))  # fmt: skip
        next(steps)  # the prefill's token
        t = time.perf_counter()
        next(steps)
        first = time.perf_counter() - t
        rest = sum(1 for _ in steps)
        return first, rest / (time.perf_counter() - t - first)

    ours_prefill()  # warm-up
    dt, _, _ = ours_prefill()
    out["engine_prefill_tps"] = prefill_t / dt
    # The first decode step of a process compiles the step (mx.compile): on CUDA its kernels
    # go through NVRTC, 13-55 s on an H200 with MLX's kernel cache cold; timed apart.
    out["engine_first_decode_step_s"] = round(ours_decode(4)[0], 3)
    out["engine_decode_tps"] = ours_decode(decode_n)[1]
    eng = None  # free the engine's weights before mlx-lm loads its own
    gc.collect()

    ref = mlx_lm_model(path)
    mx.eval(ref.parameters())

    def mlx_lm_prefill():
        cache = make_prompt_cache(ref)
        t = time.perf_counter()
        next(generate_step(mx.array(ids), ref, max_tokens=1, prompt_cache=cache))
        return time.perf_counter() - t

    mlx_lm_prefill()
    out["mlx_lm_prefill_tps"] = prefill_t / mlx_lm_prefill()

    def mlx_lm_decode(n):
        gen = generate_step(mx.array(ids), ref, max_tokens=n, prompt_cache=make_prompt_cache(ref))
        next(gen)
        t = time.perf_counter()
        count = sum(1 for _ in gen)
        return count / (time.perf_counter() - t)

    mlx_lm_decode(4)  # warm-up, as ours
    out["mlx_lm_decode_tps"] = mlx_lm_decode(decode_n)
    return out


GPU_TESTS = ("test_bfloat16.py", "test_kernels.py", "test_model.py", "test_warm.py",
             "test_quantized.py", "test_threads.py", "test_memory.py", "test_step.py",
             "test_batch.py", "test_session.py", "test_stateless.py", "test_mtp.py")  # fmt: skip
CPU_ONLY_TESTS = "not fused and not on_the_cpu"  # the native CPU kernels' own tests


def tests_section(files=GPU_TESTS, workers: int = 8, timeout: int = 600) -> dict:
    """The model, kernel, cache and quantized tests on this device, in a pytest subprocess (the
    suite loads float32 by default, CHATML_DTYPE; test_bfloat16 covers half precision):
    counts, and each failure's test id with the first line of its message."""
    import subprocess
    import tempfile
    import xml.etree.ElementTree as ET
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1] / "tests"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
               "--dist", "loadfile", "-k", CPU_ONLY_TESTS, f"--junitxml={report}",
               *(str(tests / f) for f in files)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if not report.exists():
            return {"error": (run.stdout + run.stderr)[-500:]}
        failed, passed, skipped = [], 0, 0
        for case in ET.parse(report).iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                message = (bad.get("message") or "").strip().splitlines()
                module = (case.get("classname") or "").rsplit(".", 1)[-1]  # rootdir-relative
                failed.append(f"{module}::{case.get('name')}: "
                              f"{message[0][:160] if message else ''}")  # fmt: skip
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    return {"passed": passed, "failed": len(failed), "skipped": skipped, "failures": failed}


def _gpu() -> bool:
    from kernels.choice import device_kind

    return device_kind() != "cpu"


def run(quick: bool, out: str | None = None) -> dict:
    import engine  # noqa: F401  (the fast BLAS on Linux CPUs loads before mlx)

    start = time.perf_counter()
    result: dict = {"quick": quick, "errors": {}}
    sections = {
        "device": device_section,
        "kernels": lambda: kernels_section(
            ["tiny", "0.8b"] if quick else list(HEADS), [1, 7, 64] if quick else [1, 7, 64, 512]
        ),
        "bf16_vs_mlx_lm": lambda: bf16_section(quick),
        # MLX's CPU gather_mm is float32 only: the MoE layout in bfloat16 needs a GPU
        "moe_bf16_vs_mlx_lm": lambda: bf16_section(quick, moe=True) if _gpu() else "cpu: n/a",
        "quantized_vs_mlx_lm": lambda: quantized_section(quick),
        "threads": lambda: threads_section(30 if quick else 300),
        "memory": memory_section,
        "picks": lambda: picks_section(quick),
        "speed": lambda: speed_section("tiny", 64, 8) if quick else speed_section("qwen3.5-0.8b", 512, 64),
        # the CPU runs the whole suite anyway; the tests' own run would nest here
        "tests": lambda: tests_section() if _gpu() else "cpu: the suite itself",
    }  # fmt: skip
    for name, fn in sections.items():
        t = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON line only
                result[name] = fn()
        except Exception as e:
            result["errors"][name] = f"{type(e).__name__}: {e}"[:500]
        print(f"gpu_check: {name} {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        if out:  # a run stopped by a time limit still leaves the sections it finished
            with open(out, "w") as f:
                json.dump(result, f)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (any machine, ~1 min)")
    parser.add_argument("--out", help="also write the result here after every section")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.quick, args.out)), flush=True)


if __name__ == "__main__":
    main()
