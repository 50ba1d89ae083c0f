"""Benchmark the native quantized GEMV (kernels/native) and quantized decode on the CPU.

Run: ``python -m bench.qgemv [--n 8192 --k 16384] [--model 0.8B --decode 32]``. GB/s of
weights read per single-row product (best of --repeats): native 8/4-bit, numpy float32 sgemv,
MLX float32 ``x @ w.T`` (through the engine's BLAS shim) and ``mx.quantized_matmul``; then, with
--model, decode tokens/s of that checkpoint as float32 and quantized at load to 8 and 4 bits
(``engine.load(quantize=...)``), with the resident size of the weights. All in one process,
so the ratios share the machine's load; the table ends with one JSON line.
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


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="output rows")
    ap.add_argument("--k", type=int, default=16384, help="row length (float32: n*k*4 bytes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--model", default=None, help="also measure decode of this checkpoint")
    ap.add_argument("--decode", type=int, default=32, help="decode tokens")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding")
    args = ap.parse_args()
    import engine  # noqa: F401  (loads the fast BLAS before mlx)
    from kernels import native

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
