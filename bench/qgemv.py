"""Benchmark the native quantized GEMV (kernels/native) and quantized decode on the CPU.

Run: ``python -m bench.qgemv [--n 8192 --k 16384] [--model 0.8B --decode 32]``. GB/s of
weights read per single-row product (best of --repeats): native 8/4-bit, numpy float32 sgemv,
MLX float32 ``x @ w.T`` (through the engine's BLAS shim) and ``mx.quantized_matmul``; then, with
--model, decode tokens/s of that checkpoint as float32 and quantized at load to 8 and 4 bits
(``engine.load(quantize=...)``), with the resident size of the weights. All in one process,
so the ratios share the machine's load; the table ends with one JSON line.

``--batch 1,2,4,8,16`` measures instead the float32 products of a batched decode step: MLX's
``x @ w.T`` (sgemv for one row, sgemm for more) against the native few-row GEMV
(``kernels/native/dense.cpp``) for B rows of x, on 0.8B-shaped matrices (``--shapes``, weight
[N, K] as NxK), the two interleaved call by call, best of --repeats. The weights are cold as
in a decode step (which streams ~3 GB of them): each call reads the next of enough copies to
overflow the last-level cache (``--cold-mib``; 0 reuses one matrix, cache-resident when small).
``--batch-model`` adds a whole decode step of B rows of that checkpoint with and without the
native layers. ``--forms`` adds the native kernel's two forms, forced (dot products: one pass
over the weights for a few rows; outer products: a register tile of rows x outputs, from 25
rows with AVX-512), with GFLOP/s beside GB/s for the many-row sizes of a prefill chunk.
``--clock cpu`` times process CPU time instead of wall time: on a shared,
loaded machine it leaves out the time other processes held the cores (run it with
OPENBLAS_NUM_THREADS=1 CHATML_GEMV_THREADS=1, where CPU time is the work of one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.common import best_seconds, cpu_model


def gemv(n: int, k: int, repeats: int) -> dict:
    import mlx.core as mx
    import numpy as np

    from kernels import native

    mod = native.module()
    w = mx.random.normal((n, k))
    x = mx.random.normal((1, k))
    mx.eval(w, x)
    wn, xn = np.array(w), np.array(x)[0]
    out = {"numpy_sgemv_f32": wn.nbytes / best_seconds(lambda: wn @ xn, repeats, warmup=True)}
    out["mlx_matmul_f32"] = wn.nbytes / best_seconds(lambda: mx.eval(x @ w.T), repeats, warmup=True)
    for bits in (8, 4):
        q, s, b = mx.quantize(w, group_size=64, bits=bits)
        s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)  # as mlx-community files store them
        mx.eval(q, s, b)
        size = q.nbytes + s.nbytes + b.nbytes
        args = (x, q, s, b)
        if mod is not None:
            t = best_seconds(
                lambda a=args, n=bits: mx.eval(mod.quantized_gemv(*a, 64, n)), repeats, warmup=True
            )
            out[f"native_q{bits}"] = size / t
        t = best_seconds(
            lambda a=args, n=bits: mx.eval(mx.quantized_matmul(*a, group_size=64, bits=n)),
            2,
            warmup=True,
        )
        out[f"mlx_quantized_matmul_q{bits}"] = size / t
    return {key: round(v / 1e9, 2) for key, v in out.items()}


def decode(model: str, tokens: int, prompt: int) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import engine
    from bench.common import model_path
    from engine.runtime.generate import decode as decode_loop
    from engine.runtime.generate import prefill
    from engine.runtime.sampling import Sampler, SamplingParams

    path = str(model_path(model, None))
    ids = list(range(1000, 1000 + prompt))
    out = {}
    for quantize in (None, 8, 4):
        eng = engine.load(path, quantize=quantize)
        size = sum(v.nbytes for _, v in tree_flatten(eng.model.parameters()))
        caches = eng.model.make_caches()
        t0 = time.perf_counter()
        logits, _ = prefill(eng.model, caches, ids, 0)
        mx.eval(logits)
        t_prefill = time.perf_counter() - t0
        first, count = None, 0
        for _ in decode_loop(eng.model, caches, logits, Sampler(SamplingParams()),
                             max_tokens=tokens, stop_ids=(), history=list(ids)):  # fmt: skip
            count += 1
            if first is None:
                first = time.perf_counter()
        tps = (count - 1) / (time.perf_counter() - first)
        out[f"q{quantize}" if quantize else "float32"] = {
            "decode_tok_s": round(tps, 2),
            "prefill_tok_s": round(prompt / t_prefill, 1),
            "weights_gib": round(size / 2**30, 3),
        }
        del eng, caches, logits
        mx.clear_cache()
    return out


SHAPES = "3584x1024,1024x3584,6144x1024,7168x1024,248320x1024"  # MLP up/down, qkv, brief, LM head


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock, _clock_name = CLOCKS["wall"], "wall"


def _best_interleaved(runs: dict, repeats: int) -> dict:
    """Best seconds of each of `runs` (name -> fn), calling them in turn, after one warm-up
    round (pages, thread pools): every configuration sees the same moments of the machine."""
    best = dict.fromkeys(runs, float("inf"))
    for i in range(repeats + 1):
        for name, fn in runs.items():
            t0 = _clock()
            fn()
            if i:
                best[name] = min(best[name], _clock() - t0)
    return best


def batch(
    shapes: list[tuple[int, int]], batches: list[int], repeats: int, cold: int, forms: bool = False
) -> list:
    """ms per product: MLX vs native, B rows of x against a cold [N, K] float32 weight; with
    `forms`, the native kernel's two forms too (dot products, outer products)."""
    import itertools

    import mlx.core as mx

    from kernels import native

    mod = native.module()
    rows = []
    for n, k in shapes:
        copies = max(1, -(-cold // (n * k * 4)))
        flat = mx.random.normal((copies * n * k,))
        mx.eval(flat)
        # views that own whole rows (a slice of a flat array would be copied by the kernel's
        # `contiguous`, which MLX does not treat as a no-op for 1-D slices)
        views = [flat.reshape(copies, n, k)[i] for i in range(copies)]
        mx.eval([mx.ones((1, k)) @ w.T for w in views])  # first touch of every page, untimed
        weights = itertools.cycle(views)
        for b in batches:
            x = mx.random.normal((b, k))
            mx.eval(x)
            runs = {"mlx": lambda x=x, ws=weights: mx.eval(x @ next(ws).T)}
            if mod is not None:
                runs["native"] = lambda x=x, ws=weights: mx.eval(mod.dense_gemv(x, next(ws)))
                for form in ("dot", "outer") if forms else ():
                    runs[form] = lambda x=x, ws=weights, f=form: mx.eval(
                        mod.dense_gemv(x, next(ws), form=f)
                    )
            best = _best_interleaved(runs, repeats)
            row = {"shape": f"{n}x{k}", "rows": b, "mib": round(n * k * 4 / 2**20, 1)}
            for name, t in best.items():
                row[f"{name}_ms"] = round(t * 1e3, 3)
                row[f"{name}_gb_s"] = round(n * k * 4 / t / 1e9, 1)
                row[f"{name}_gflops"] = round(2 * b * n * k / t / 1e9, 1)
            line = f"{row['shape']:>12} B={b:<3} mlx {row['mlx_ms']:8.2f} ms"
            if mod is not None:
                row["mlx_over_native"] = round(best["mlx"] / best["native"], 2)
                line += f"  native {row['native_ms']:8.2f} ms  mlx/native {row['mlx_over_native']}"
            for form in ("dot", "outer") if forms and mod is not None else ():
                line += f"  {form} {row[f'{form}_ms']:8.2f}"
            rows.append(row)
            print(line, file=sys.stderr, flush=True)
        del views, weights, flat
        mx.clear_cache()
    return rows


def batch_model(model: str, batches: list[int], repeats: int, prompt: int = 32) -> dict:
    """ms per decode step of B rows (after a B x `prompt` prefill), with the native layers and
    with MLX's matmuls, each in its own interpreter (one 0.8B engine in memory at a time)."""
    import subprocess

    from bench.common import ROOT

    out = {}
    for label, setting in (("native", "build"), ("mlx", "0")):
        cmd = [sys.executable, "-m", "bench.qgemv", "--step-child", model, "--batch",
               ",".join(map(str, batches)), "--repeats", str(repeats), "--clock", _clock_name,
               "--prompt", str(prompt)]  # fmt: skip
        env = dict(os.environ, CHATML_NATIVE=setting)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if run.returncode != 0:
            raise SystemExit(f"{label} decode steps failed:\n{run.stderr[-2000:]}")
        out[label] = json.loads(run.stdout.splitlines()[-1])
        for b, ms in out[label].items():
            print(f"  {label} decode step B={b}: {ms} ms", file=sys.stderr, flush=True)
    return out


def step_child(model: str, batches: list[int], repeats: int, prompt: int) -> dict:
    import mlx.core as mx

    import engine
    from bench.common import model_path

    eng = engine.load(str(model_path(model, None)))
    out = {}
    for b in batches:
        caches = eng.model.make_caches()
        ids = mx.array([[1000 + i + j for i in range(prompt)] for j in range(b)])
        logits = eng.model(ids, caches)
        mx.eval(logits)
        times = []
        for _ in range(repeats + 1):  # the first step traces the compiled layers
            t0 = _clock()
            logits = eng.model(mx.argmax(logits[:, -1:], axis=-1), caches)
            mx.eval(logits)
            times.append(_clock() - t0)
        out[b] = round(min(times[1:]) * 1e3, 1)
        del caches, logits
        mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="output rows")
    ap.add_argument("--k", type=int, default=16384, help="row length (float32: n*k*4 bytes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--model", default=None, help="also measure decode of this checkpoint")
    ap.add_argument("--decode", type=int, default=32, help="decode tokens")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding")
    ap.add_argument("--batch", default=None, help="rows of x, e.g. 1,2,4,8,16: the float32 table")
    ap.add_argument("--shapes", default=SHAPES, help="weights NxK for --batch")
    ap.add_argument("--forms", action="store_true",
                    help="--batch: also time the native kernel's dot- and outer-product forms")  # fmt: skip
    ap.add_argument("--cold-mib", type=int, default=512, help="weight copies cycled (--batch)")
    ap.add_argument("--batch-model", default=None, help="also time B-row decode steps of this")
    ap.add_argument("--step-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--clock", choices=CLOCKS, default="wall",
                    help="--batch timer: cpu (process CPU time) ignores time preempted on a "
                         "shared machine; meaningful with one thread each")  # fmt: skip
    args = ap.parse_args()
    global _clock, _clock_name
    _clock, _clock_name = CLOCKS[args.clock], args.clock
    import engine  # noqa: F401  (loads the fast BLAS before mlx)
    from kernels import native

    if args.step_child:
        batches = [int(b) for b in args.batch.split(",")]
        print(json.dumps(step_child(args.step_child, batches, args.repeats, args.prompt)))
        return
    if args.batch:
        batches = [int(b) for b in args.batch.split(",")]
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        result = {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
            "threads": {
                v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "CHATML_GEMV_THREADS")
            },
            "native": native.info().isa or native.info().reason,
            "cold_mib": args.cold_mib,
            "clock": args.clock,
            "float32_rows": batch(shapes, batches, args.repeats, args.cold_mib << 20, args.forms),
        }
        if args.batch_model:
            result["decode_step_ms"] = batch_model(args.batch_model, batches, args.repeats, 32)
        result["loadavg_after"] = os.getloadavg()
        print(json.dumps(result))
        return

    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    result = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "loadavg_before": load,
        "threads": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "CHATML_GEMV_THREADS")},
        "native": native.info().isa or native.info().reason,
        "gemv_gb_s": gemv(args.n, args.k, args.repeats),
        "matrix": [args.n, args.k],
    }
    if args.model:
        result["decode"] = decode(args.model, args.decode, args.prompt)
    with open("/proc/loadavg") as f:
        result["loadavg_after"] = f.read().split()[:3]
    for key, value in result["gemv_gb_s"].items():
        print(f"{key:>28}: {value:6.2f} GB/s")
    for key, value in result.get("decode", {}).items():
        print(f"{key:>28}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
