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


def run(model: str, batches: list[int], context: int, steps: int, repeats: int) -> dict:
    import engine  # noqa: I001  (before mlx: the fast BLAS loads first)
    import mlx.core as mx

    from engine.runtime.generate import eval_caches, prefill
    from engine.runtime.step import Row, forward

    from bench.common import model_path

    eng = engine.load(str(model_path(model)))
    net = eng.model
    rows = []
    for b in range(max(batches)):
        ids = [1000 + (b * 7919 + j * 104729) % 50000 for j in range(context)]
        caches = net.make_caches()
        logits, _ = prefill(net, caches, ids, 0)
        rows.append((caches, mx.argmax(logits).item()))
    results = {}
    for B in batches:
        best = float("inf")
        for _ in range(repeats):
            live = [(list(c), t) for c, t in rows[:B]]
            marks = []
            start = time.perf_counter()
            tokens = [mx.array([t]) for _, t in live]
            for _ in range(steps):
                out = forward(net, [Row(c, tok) for (c, _), tok in zip(live, tokens)])
                tokens = [mx.argmax(lg[-1]).reshape(1) for lg, _ in out]
                marks.append([m for _, m in out])
                mx.async_eval(tokens)
            mx.eval(tokens)
            best = min(best, time.perf_counter() - start)
            for (caches, _), first in zip(live, (m[0] for m in zip(*marks))):
                for c, state in zip(caches, first.before):  # back to the prefilled state
                    c.restore(state)
                eval_caches(caches)
        results[B] = best / steps
    base = results[batches[0]]
    return {
        "bench": "batch",
        "model": model,
        "context": context,
        "steps": steps,
        "step_ms": {str(b): round(t * 1000, 2) for b, t in results.items()},
        "step_ratio": {str(b): round(t / base, 2) for b, t in results.items()},
        "aggregate_speedup": {str(b): round(b * base / t, 2) for b, t in results.items()},
        "load": " ".join(open("/proc/loadavg").read().split()[:3])
        if os.path.exists("/proc/loadavg")
        else "",
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    result = run(args.model, batches, args.context, args.steps, args.repeats)
    print(f"{'batch':>6} {'ms/step':>9} {'x batch 1':>10} {'tok/s x':>8}")
    for b in batches:
        k = str(b)
        print(f"{b:>6} {result['step_ms'][k]:>9} {result['step_ratio'][k]:>10} "
              f"{result['aggregate_speedup'][k]:>8}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
