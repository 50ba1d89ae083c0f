"""Decode step time against batch size: `python -m bench.batch [--model tiny --batch 1,2,4,8]`.

Each row is a sequence prefilled to `--context` tokens (different ids per row); a step feeds
every row one token through `step.forward` (one batched pass, as the scheduler runs it) and
samples greedily. Reports, per batch size, the best-of-`--repeats` time of `--steps` steps,
the time per step relative to batch 1, and aggregate tokens/s relative to batch 1 (issue 19's
targets: a step at batch 4 <= 1.3x batch 1, at batch 8 <= 1.8x). Prints a table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
PATHS = ("auto", "fused", "step")
_NATIVE = None  # kernels.delta_rule._native as loaded (run sets it; "step" swaps it out)


def _use_path(net, path: str, compiled: dict) -> None:
    """Make the decode steps take `path`: the choice is made when a layer's step is traced,
    so each path keeps its own compiled steps (`compiled`: path -> per layer), traced once."""
    import kernels.delta_rule as dr

    dr._native = _NATIVE if path != "step" else (lambda: None)  # "step": as if not built
    if path == "fused" and _NATIVE() is None:
        raise SystemExit("--paths fused needs the native CPU kernels (kernels.native)")
    for layer, steps in zip(net.layers, compiled.setdefault(path, [None] * len(net.layers))):
        layer._steps = steps


def _keep_path(net, path: str, compiled: dict) -> None:
    compiled[path] = [layer._steps for layer in net.layers]


def _load() -> str:
    if not os.path.exists("/proc/loadavg"):
        return ""
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run(model: str, batches: list[int], context: int, steps: int, repeats: int,
        clock: str = "wall", paths: tuple[str, ...] = ("auto",)) -> dict:  # fmt: skip
    import engine  # noqa: I001  (before mlx: the fast BLAS loads first)
    import mlx.core as mx

    import kernels.delta_rule as dr
    from engine.runtime.generate import eval_caches, prefill
    from engine.runtime.step import Row, forward

    from bench.common import model_path

    global _NATIVE
    _NATIVE = dr._native
    now = CLOCKS[clock]
    load_at_start = _load()
    eng = engine.load(str(model_path(model)))
    net = eng.model
    rows = []
    for b in range(max(batches)):
        ids = [1000 + (b * 7919 + j * 104729) % 50000 for j in range(context)]
        caches = net.make_caches()
        logits, _ = prefill(net, caches, ids, 0)
        rows.append((caches, mx.argmax(logits).item()))

    def steps_of(B: int) -> float:
        live = [(list(c), t) for c, t in rows[:B]]
        marks = []
        start = now()
        tokens = [mx.array([t]) for _, t in live]
        for _ in range(steps):
            out = forward(net, [Row(c, tok) for (c, _), tok in zip(live, tokens)])
            tokens = [mx.argmax(lg[-1]).reshape(1) for lg, _ in out]
            marks.append([m for _, m in out])
            mx.async_eval(tokens)
        mx.eval(tokens)
        took = now() - start
        for (caches, _), first in zip(live, (m[0] for m in zip(*marks))):
            for c, state in zip(caches, first.before):  # back to the prefilled state
                c.restore(state)
            eval_caches(caches)
        return took

    compiled: dict = {}
    results = {p: {} for p in paths}
    for B in batches:
        best = dict.fromkeys(paths, float("inf"))
        for i in range(repeats + 1):  # round 0 traces the compiled steps: untimed
            for path in paths:  # interleaved: every path sees the same moments of the load
                _use_path(net, path, compiled)
                took = steps_of(B)
                _keep_path(net, path, compiled)
                if i:
                    best[path] = min(best[path], took)
        for path in paths:
            results[path][B] = best[path] / steps
    dr._native = _NATIVE
    out = {"bench": "batch", "model": model, "context": context, "steps": steps,
           "clock": clock, "load": [load_at_start, _load()]}  # fmt: skip
    for path in paths:
        times = results[path]
        base = times[batches[0]]
        out[path] = {
            "step_ms": {str(b): round(t * 1000, 2) for b, t in times.items()},
            "step_ratio": {str(b): round(t / base, 2) for b, t in times.items()},
            "aggregate_speedup": {str(b): round(b * base / t, 2) for b, t in times.items()},
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--paths", default="auto", help=f"comma-separated, of {', '.join(PATHS)}")
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    paths = tuple(args.paths.split(","))
    if unknown := [x for x in paths if x not in PATHS]:
        p.error(f"unknown --paths {', '.join(unknown)} (choose from {', '.join(PATHS)})")
    result = run(args.model, batches, args.context, args.steps, args.repeats, args.clock, paths)
    for path in paths:
        r = result[path]
        print(f"{path}: {'batch':>6} {'ms/step':>9} {'x batch 1':>10} {'tok/s x':>8}")
        for b in batches:
            k = str(b)
            print(f"{' ' * len(path)}  {b:>6} {r['step_ms'][k]:>9} {r['step_ratio'][k]:>10} "
                  f"{r['aggregate_speedup'][k]:>8}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
