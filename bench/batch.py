"""Decode step time against batch size: `python -m bench.batch [--model tiny --batch 1,2,4,8]`.

Each row is a sequence prefilled to `--context` tokens (different ids per row); a step feeds
every row one token through `step.forward` (one batched pass, as the scheduler runs it) and
samples greedily. Reports, per batch size, the best-of-`--repeats` time of `--steps` steps,
the time per step relative to batch 1, and aggregate tokens/s relative to batch 1 (issue 19's
targets: a step at batch 4 <= 1.3x batch 1, at batch 8 <= 1.8x). Prints a table, then JSON.

`--check` also decodes every row alone, untimed, and compares each batched row's logits and
greedy tokens with them, step by step (issue 19's exactness bound: logits within 1e-4 of
single-row decoding in float32): `check.max_logit_diff` per batch size, `check.tokens_equal`.

Every round times each batch size and each variant in turn, so the ratios share the moments of
a noisy machine's load. Variants: `--paths` (the Gated DeltaNet decode update) and
`--dense-rows LO-HI,...` (which row counts take the native few-row GEMV instead of MLX's
matmul, `kernels.native.DENSE_ROWS`; `none` for MLX's matmul at every size), e.g.
`--dense-rows 2-12,1-12,none` for an A/B of the crossover.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
PATHS = ("auto", "fused", "step")
_NATIVE = None  # kernels.delta_rule._native as loaded (run sets it; "step" swaps it out)


def _use_variant(net, variant: tuple[str, str], compiled: dict, table: dict) -> None:
    """Make the decode steps take `variant` (path, dense rows; "default": `table`, the row
    table as found): both choices are made when a layer's step is traced, so each variant
    keeps its own compiled steps (`compiled`: variant -> per layer), traced once."""
    import kernels.delta_rule as dr
    from kernels import native

    path, rows = variant
    dr._native = _NATIVE if path != "step" else (lambda: None)  # "step": as if not built
    if path == "fused" and _NATIVE() is None:
        raise SystemExit("--paths fused needs the native CPU kernels (kernels.native)")
    isa = native.info().isa
    native.DENSE_ROWS[isa] = table[isa] if rows == "default" else _rows(rows)
    for layer, steps in zip(net.layers, compiled.setdefault(variant, [None] * len(net.layers))):
        layer._steps = steps


def _keep_variant(net, variant: tuple[str, str], compiled: dict) -> None:
    compiled[variant] = [layer._steps for layer in net.layers]


def _rows(spec: str) -> tuple[int, int]:
    """`--dense-rows` item -> (lo, hi): "2-12" -> (2, 12); "none" -> no row count."""
    if spec == "none":
        return (1, 0)
    lo, hi = (int(n) for n in spec.split("-"))
    return (lo, hi)


def _label(variant: tuple[str, str]) -> str:
    path, rows = variant
    return path if rows == "default" else f"{path}/rows={rows}"


def _check(decode, rows: list, batches: list[int]) -> dict:
    """Each batch size's rows decoded together against each row decoded alone."""
    alone = []
    for row in rows:
        alone.append([])
        decode([(list(row[0]), row[1])], [alone[-1]])
    diff, equal = {}, True
    for B in batches:
        together = [[] for _ in range(B)]
        decode([(list(c), t) for c, t in rows[:B]], together)
        diff[str(B)] = max(
            float(np.abs(a - b).max()) for k in range(B) for a, b in zip(together[k], alone[k])
        )
        equal &= all(
            [int(a.argmax()) for a in together[k]] == [int(a.argmax()) for a in alone[k]]
            for k in range(B)
        )
    return {"max_logit_diff": diff, "tokens_equal": equal}


def _load() -> str:
    if not os.path.exists("/proc/loadavg"):
        return ""
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run(model: str, batches: list[int], context: int, steps: int, repeats: int,
        clock: str = "wall", paths: tuple[str, ...] = ("auto",),
        dense_rows: tuple[str, ...] = ("default",), check: bool = False) -> dict:  # fmt: skip
    import engine  # noqa: I001  (before mlx: the fast BLAS loads first)
    import mlx.core as mx

    import kernels.delta_rule as dr
    from engine.runtime.generate import eval_caches, prefill
    from engine.runtime.step import Row, forward

    from bench.common import model_path

    from kernels import native

    global _NATIVE
    _NATIVE = dr._native
    table = dict(native.DENSE_ROWS)
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

    def decode(live: list, keep: list | None = None) -> float:
        """`steps` greedy steps of `live` rows [(caches, first token)] in one batched pass
        each; then the rows' caches go back to their prefilled state. `keep`: one list per
        row, given each step's logits (as numpy: untimed runs only)."""
        first = None  # the first step's marks: only they are kept, as the scheduler keeps one
        start = now()
        tokens = [mx.array([t]) for _, t in live]
        for _ in range(steps):
            out = forward(net, [Row(c, tok) for (c, _), tok in zip(live, tokens)])
            tokens = [mx.argmax(lg[-1]).reshape(1) for lg, _ in out]
            first = first or [m for _, m in out]
            if keep is not None:
                for kept, (lg, _) in zip(keep, out):
                    kept.append(np.array(lg[-1].astype(mx.float32)))
            mx.async_eval(tokens)
        mx.eval(tokens)
        took = now() - start
        for (caches, _), mark in zip(live, first):
            for c, state in zip(caches, mark.before):  # back to the prefilled state
                c.restore(state)
            eval_caches(caches)
        return took

    def steps_of(B: int) -> float:
        return decode([(list(c), t) for c, t in rows[:B]])

    # The check runs the engine as loaded (its own row table and paths), before any variant.
    checked = _check(decode, rows, batches) if check else None
    compiled: dict = {}
    variants = [(p, r) for p in paths for r in dense_rows]
    best = {v: dict.fromkeys(batches, float("inf")) for v in variants}
    try:
        for i in range(repeats + 1):  # round 0 traces the compiled steps: untimed
            for B in batches:  # interleaved: every cell sees the same moments of the load
                for v in variants:
                    _use_variant(net, v, compiled, table)
                    took = steps_of(B)
                    _keep_variant(net, v, compiled)
                    if i:
                        best[v][B] = min(best[v][B], took)
    finally:
        dr._native = _NATIVE
        native.DENSE_ROWS.update(table)
    out = {"bench": "batch", "model": model, "context": context, "steps": steps,
           "clock": clock, "isa": native.info().isa, "load": [load_at_start, _load()]}  # fmt: skip
    if checked:
        out["check"] = checked
    for v in variants:
        times = {b: t / steps for b, t in best[v].items()}
        base = times[batches[0]]
        out[_label(v)] = {
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
    p.add_argument(
        "--dense-rows",
        default="default",
        help="comma-separated row ranges for the native dense GEMV, e.g. 2-12,1-12,none "
        "(default: kernels.native.DENSE_ROWS)",
    )
    p.add_argument("--check", action="store_true",
                   help="also compare each batched row's logits and tokens with the row alone")  # fmt: skip
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    paths = tuple(args.paths.split(","))
    if unknown := [x for x in paths if x not in PATHS]:
        p.error(f"unknown --paths {', '.join(unknown)} (choose from {', '.join(PATHS)})")
    dense_rows = tuple(args.dense_rows.split(","))
    for spec in set(dense_rows) - {"default"}:
        try:
            _rows(spec)
        except ValueError:
            p.error(f"bad --dense-rows item {spec!r}: want LO-HI (e.g. 2-12), none or default")
    result = run(args.model, batches, args.context, args.steps, args.repeats, args.clock, paths,
                 dense_rows, args.check)  # fmt: skip
    for label in (_label((p_, r)) for p_ in paths for r in dense_rows):
        r = result[label]
        print(f"{label}: {'batch':>6} {'ms/step':>9} {'x batch 1':>10} {'tok/s x':>8}")
        for b in batches:
            k = str(b)
            print(f"{' ' * len(label)}  {b:>6} {r['step_ms'][k]:>9} {r['step_ratio'][k]:>10} "
                  f"{r['aggregate_speedup'][k]:>8}")  # fmt: skip
    if check := result.get("check"):
        diffs = ", ".join(f"B={b} {d:.2g}" for b, d in check["max_logit_diff"].items())
        same = "equal" if check["tokens_equal"] else "DIFFERENT"
        print(f"check: max |logit difference| against each row alone: {diffs}; tokens {same}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
