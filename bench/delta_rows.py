"""The Gated DeltaNet one-token update of B rows: `python -m bench.delta_rows [--batch 1,2,4,8]`.

Each row's state is its own array (as in a batched decode step). Times, per B, one layer's
update with 0.8B heads (16 x 128 x 128) three ways, interleaved call by call, best of
`--repeats` after a warm-up round: "fused" (the native one-pass kernel), "step" (MLX's ops,
the states stacked and split back) and "step_compiled" (the same under `mx.compile`, as the
model runs it). The states are reused call after call, so they are warm in the last-level
cache; in a decode step the weights stream between layers and the states come from memory.
`--clock cpu` times process CPU time (run with CHATML_GEMV_THREADS=1 on a shared machine).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

from bench.batch import CLOCKS, _load

HK, HV, D = 16, 16, 128  # Qwen3.5-0.8B


def run(batches: list[int], repeats: int, clock: str) -> dict:
    import engine  # noqa: F401, I001  (before mlx: the fast BLAS loads first)
    import mlx.core as mx

    from kernels import gated_delta_rows

    now = CLOCKS[clock]
    compiled = mx.compile(lambda *a: gated_delta_rows(*a[:5], list(a[5:]), method="step"))
    ways = {
        "fused": lambda a: gated_delta_rows(*a[:5], list(a[5:]), method="fused"),
        "step": lambda a: gated_delta_rows(*a[:5], list(a[5:]), method="step"),
        "step_compiled": lambda a: compiled(*a),
    }
    out = {"bench": "delta_rows", "clock": clock, "load": [_load()], "ms": {}}
    for B in batches:
        key = mx.random.key(B)
        q, k, v = (mx.random.normal((B, 1, h, D), key=key) for h in (HK, HK, HV))
        q, k = q * D**-1.0, k * D**-0.5
        g = mx.random.uniform(0.9, 1.0, (B, 1, HV), key=key)
        beta = mx.random.uniform(shape=(B, 1, HV), key=key)
        states = [mx.random.normal((1, HV, D, D), key=mx.random.key(i)) for i in range(B)]
        args = (q, k, v, g, beta, *states)
        mx.eval(args)
        best = dict.fromkeys(ways, float("inf"))
        for i in range(repeats + 1):
            for name, way in ways.items():
                t0 = now()
                mx.eval(way(args))
                if i:
                    best[name] = min(best[name], now() - t0)
        out["ms"][str(B)] = {name: round(t * 1e3, 3) for name, t in best.items()}
        print(B, out["ms"][str(B)], flush=True)
    out["load"].append(_load())
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.delta_rows", description=__doc__)
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = p.parse_args()
    print(json.dumps(run([int(b) for b in args.batch.split(",")], args.repeats, args.clock)))


if __name__ == "__main__":
    main()
