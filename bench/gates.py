"""Prefill with the native gates and causal softmax against MLX's ops: same weights, one process.

Run: ``python -m bench.gates --model qwen3.5-0.8b [--ts 512,2048] [--repeats 2] [--json FILE]``.

The engine's float32 CPU model (``ModelOptions.native_activations``: silu, sigmoid gates,
the conv's silu and the prefill's causal softmax as vectorized native passes) and a copy
sharing its weights on MLX's ops (scalar exp on x86) prefill the same prompt, interleaved,
``--repeats`` times each. Both wall time and the process's CPU time are recorded: on a shared
machine the CPU time (with ``OPENBLAS_NUM_THREADS=1 CHATML_GEMV_THREADS=1``, the work of one
thread) is the steadier measure of the work saved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.common import conditions, model_path, write_json


def measure(model: str, ts: list[int], repeats: int) -> dict:
    import mlx.core as mx
    import numpy as np

    import engine
    from engine.runtime.dense import use_dense_kernels
    from engine.runtime.generate import prefill
    from engine.runtime.model import ModelOptions, Qwen35

    eng = engine.load(str(model_path(model)))
    native = eng.model
    if not native.layers[0].mlp.native:
        raise SystemExit("the native gates are not in use (CPU float32 with the native module)")
    ops = Qwen35(native.arch, ModelOptions(native_activations=False))
    ops.update(native.parameters())
    use_dense_kernels(ops)  # the same matmul paths: only the gates differ
    nets = {"native": native, "mlx_ops": ops}

    def run(net, ids) -> tuple[float, float]:
        caches = net.make_caches()
        wall, cpu = time.perf_counter(), time.process_time()
        logits, _ = prefill(net, caches, ids, 0)
        mx.eval(logits)
        return time.perf_counter() - wall, time.process_time() - cpu

    out: dict = {}
    for T in ts:
        ids = np.random.default_rng(T).integers(0, 248000, T).tolist()
        runs: dict[str, list] = {name: [] for name in nets}
        for net in nets.values():
            run(net, ids[:16])  # warm-up
        for _ in range(repeats):
            for name, net in nets.items():
                runs[name].append(run(net, ids))
        row = {}
        for name, r in runs.items():
            wall, cpu = min(w for w, _ in r), min(c for _, c in r)
            row[name] = {"wall_s": wall, "cpu_s": cpu, "tokens_per_s": T / wall,
                         "tokens_per_cpu_s": T / cpu}  # fmt: skip
        row["cpu_ratio"] = row["mlx_ops"]["cpu_s"] / row["native"]["cpu_s"]
        row["wall_ratio"] = row["mlx_ops"]["wall_s"] / row["native"]["wall_s"]
        out[str(T)] = row
        print(f"prefill {T}: native {row['native']['wall_s']:.2f} s wall / "
              f"{row['native']['cpu_s']:.2f} s CPU, MLX ops {row['mlx_ops']['wall_s']:.2f} / "
              f"{row['mlx_ops']['cpu_s']:.2f}; MLX ops / native: {row['wall_ratio']:.2f}x wall, "
              f"{row['cpu_ratio']:.2f}x CPU", file=sys.stderr, flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-0.8b", help="registry name or checkpoint folder")
    ap.add_argument("--ts", default="512,2048", help="prompt lengths (comma separated)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    import engine  # noqa: F401  (the fast BLAS before mlx; conditions() reports it)

    ts = [int(t) for t in a.ts.split(",") if t]
    before = conditions(model=a.model, repeats=a.repeats)["load_average"]
    result = {"results": measure(a.model, ts, a.repeats)}
    result["conditions"] = conditions(model=a.model, repeats=a.repeats, load_before=before)
    print(json.dumps({"bench": "gates", **result}))
    write_json(a.json, result)


if __name__ == "__main__":
    main()
