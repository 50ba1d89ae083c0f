"""Attention over each row's own KV cache: `python -m bench.attention_rows [--batch 1,8]`.

Times one attention layer of a decode step (0.8B heads: 8 query heads, 2 key heads, 256 wide)
for B rows of `--lengths` positions each (buffers with room to spare, as a cache's are) and
`--queries` queries a row (1: decode; more: a verify pass), two ways, interleaved call by
call, best of `--repeats` after a warm-up round: "rows" (`attention_rows`, the native pass over
every row) and "per_row" (the path it replaced: `attention` once per row, MLX's
scaled_dot_product_attention for one query, scores by BLAS and the native softmax for more).
Also reports the largest difference between the two outputs. The caches are reused call after
call, so short ones stay in cache. Prints a line per case, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

from bench.batch import CLOCKS, _load

HQ, HKV, D = 8, 2, 256  # Qwen3.5-0.8B and 2B


def case(B: int, n: int, T: int, repeats: int, now) -> dict:
    """One (batch, length, queries) case: both ways' best times and their largest difference."""
    import mlx.core as mx

    from kernels.attention import attention, attention_rows

    q = mx.random.normal((B, HQ, T, D), key=mx.random.key(T))
    keys = [mx.random.normal((1, HKV, n + 64, D), key=mx.random.key(b)) for b in range(B)]
    values = [mx.random.normal((1, HKV, n + 64, D), key=mx.random.key(B + b)) for b in range(B)]
    mx.eval(q, keys, values)

    def rows():
        return attention_rows(q, keys, values, [n] * B, D**-0.5, native=True)

    def per_row():
        return mx.concatenate([
            attention(q[b : b + 1], k[:, :, :n], v[:, :, :n], D**-0.5, native=True)
            for b, (k, v) in enumerate(zip(keys, values))
        ])  # fmt: skip

    ways = {"rows": rows, "per_row": per_row}
    best = dict.fromkeys(ways, float("inf"))
    for i in range(repeats + 1):
        for name, way in ways.items():
            t0 = now()
            mx.eval(way())
            if i:
                best[name] = min(best[name], now() - t0)
    return {"batch": B, "length": n, "queries": T,
            "max_diff": mx.abs(rows() - per_row()).max().item(),
            "ms": {k: round(t * 1e3, 3) for k, t in best.items()},
            "speedup": round(best["per_row"] / best["rows"], 2)}  # fmt: skip


def run(batches: list[int], lengths: list[int], queries: list[int], repeats: int,
        clock: str = "wall") -> dict:  # fmt: skip
    import engine  # noqa: F401  (before mlx: the fast BLAS loads first)

    out = {"bench": "attention_rows", "clock": clock, "load": [_load()], "cases": []}
    for B in batches:
        for n in lengths:
            for T in queries:
                c = case(B, n, T, repeats, CLOCKS[clock])
                out["cases"].append(c)
                print(f"B={B} length={n} T={T}: rows {c['ms']['rows']} ms, per row "
                      f"{c['ms']['per_row']} ms ({c['speedup']}x), max diff {c['max_diff']:.1e}",
                      flush=True)  # fmt: skip
    out["load"].append(_load())
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.attention_rows", description=__doc__)
    p.add_argument("--batch", default="1,4,8")
    p.add_argument("--lengths", default="128,1024,4096")
    p.add_argument("--queries", default="1,4")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = p.parse_args()

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    result = run(ints(args.batch), ints(args.lengths), ints(args.queries), args.repeats, args.clock)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
