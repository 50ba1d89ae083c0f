"""Benchmark kernels/: chunked gated delta vs mx.fast (and the native fused pass, where the
native module is built), and MLX matmul with/without fast BLAS.

Run: ``python -m bench.kernels [--ts 128,240,512,2048] [--repeats 3]``. Prints a table with the
conditions and ends with one JSON line. Each BLAS setting runs in its own interpreter,
because the BLAS library must be chosen before mlx is first imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from bench.common import ROOT, best_seconds, child_env, cpu_model

# Qwen3.5-0.8B Gated DeltaNet layer shapes.
B, HK, HV, DK, DV = 1, 16, 16, 128, 128


def child(ts: list[int], repeats: int) -> dict:
    """Measurements in this interpreter under its CHATML_BLAS setting."""
    from kernels import blas

    blas.enable()  # before mlx is imported
    import mlx.core as mx
    import numpy as np

    from kernels import gated_delta, native

    info = blas.info()
    out: dict = {
        "blas": info.library,
        "blas_provider": info.provider,
        "mlx": mx.__version__,
        "gemm_gflops": {str(n): blas.measure_gflops(n) for n in (256, 1024, 2048)},
        "gated_delta": {},
    }
    mx.random.seed(0)
    for T in ts:
        # q, k: [B, T, Hk, Dk] L2-normalized (q scaled as the model does); v: [B, T, Hv, Dv]
        q = mx.random.normal((B, T, HK, DK))
        k = mx.random.normal((B, T, HK, DK))
        q = q / (mx.linalg.norm(q, axis=-1, keepdims=True) * DK**0.5)
        k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
        v = mx.random.normal((B, T, HV, DV))
        g = mx.random.uniform(0.9, 1.0, (B, T, HV))
        beta = mx.random.uniform(shape=(B, T, HV))
        mx.eval(q, k, v, g, beta)
        args = (q, k, v, g, beta)
        mx.eval(gated_delta(*(x[:, :64] for x in args), method="chunked"))  # warm-up
        mx.eval(gated_delta(*(x[:, :64] for x in args), method="sequential"))
        # mx.fast first: OpenBLAS worker threads may still spin briefly after chunked runs.
        seq_reps = 1 if T > 4096 else max(1, repeats - 1)
        t_seq = best_seconds(lambda a=args: mx.eval(gated_delta(*a, method="sequential")), seq_reps)
        time.sleep(0.5)
        t_chunk = best_seconds(lambda a=args: mx.eval(gated_delta(*a, method="chunked")), repeats)
        y_c, s_c = gated_delta(*args, method="chunked")
        y_s, s_s = gated_delta(*args, method="sequential")
        y_s_np = np.array(y_s)
        diff = float(np.abs(np.array(y_c) - y_s_np).max() / np.abs(y_s_np).max())
        out["gated_delta"][str(T)] = {
            "chunked_s": t_chunk,
            "sequential_s": t_seq,
            "speedup": t_seq / t_chunk,
            "rel_diff_y": diff,
        }
        if native.module() is not None:  # what the engine runs on a CPU
            t_fused = best_seconds(lambda a=args: mx.eval(gated_delta(*a, method="fused")), repeats)
            y_f = np.array(gated_delta(*args, method="fused")[0])
            out["gated_delta"][str(T)] |= {
                "fused_s": t_fused,
                "fused_rel_diff_y": float(np.abs(y_f - y_s_np).max() / np.abs(y_s_np).max()),
            }
    return out


def run_child(blas_setting: str, ts: list[int], repeats: int) -> dict:
    env = child_env(blas_setting)
    cmd = [sys.executable, "-m", "bench.kernels", "--child", "--repeats", str(repeats)]
    cmd += ["--ts", ",".join(map(str, ts))] if ts else ["--ts", ""]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ts", default="128,240,512,2048", help="sequence lengths (comma separated)")
    ap.add_argument("--ref-ts", default="512", help="lengths also timed with the stock BLAS")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    ts = [int(t) for t in a.ts.split(",") if t]
    if a.child:
        print(json.dumps(child(ts, a.repeats)))
        return

    fast = run_child("1", ts, a.repeats)
    ref = run_child("0", [int(t) for t in a.ref_ts.split(",") if t], a.repeats)
    cond = {
        "mlx": fast["mlx"],
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "blas": fast["blas"],
        "blas_provider": fast["blas_provider"],
        "shape": f"B={B} Hk={HK} Hv={HV} Dk={DK} Dv={DV}",
    }
    print("conditions:")
    for key, val in cond.items():
        print(f"  {key:14s} {val}")
    print("\nfloat32 matmul (n x n x n), GFLOP/s")
    print(f"  {'n':>6s} {'fast BLAS':>10s} {'reference':>10s} {'ratio':>7s}")
    for n, gf in fast["gemm_gflops"].items():
        rf = ref["gemm_gflops"][n]
        print(f"  {n:>6s} {gf:10.1f} {rf:10.1f} {gf / rf:6.1f}x")
    print("\ngated delta, seconds (best of repeats); speedup: mx.fast / chunked")
    print(f"  {'BLAS':>9s} {'T':>6s} {'chunked':>9s} {'mx.fast':>9s} {'speedup':>8s} "
          f"{'rel diff':>9s} {'fused':>9s}")  # fmt: skip
    for name, res in (("fast", fast), ("reference", ref)):
        for T, r in res["gated_delta"].items():
            fused = f"{r['fused_s']:9.4f}" if "fused_s" in r else f"{'-':>9s}"
            print(
                f"  {name:>9s} {T:>6s} {r['chunked_s']:9.3f} {r['sequential_s']:9.3f} "
                f"{r['speedup']:7.1f}x {r['rel_diff_y']:9.1e} {fused}"
            )
    summary = {
        "bench": "kernels",
        "conditions": cond,
        "gemm_gflops_fast": fast["gemm_gflops"],
        "gemm_gflops_reference": ref["gemm_gflops"],
        "gemm_ratio_1024": fast["gemm_gflops"]["1024"] / ref["gemm_gflops"]["1024"],
        "gated_delta_fast_blas": fast["gated_delta"],
        "gated_delta_reference_blas": ref["gated_delta"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
