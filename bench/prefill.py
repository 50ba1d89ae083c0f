"""Full-model prefill speed: this engine vs mlx-lm as users get it, and where the gain comes from.

Run: ``chatml bench prefill --model qwen3.5-0.8b [--ts 512,2048] [--stock-ts 512]``.

Four configurations of bench/throughput.py, each in its own interpreter, on the same
checkpoint, float32: ``mlx_lm_stock`` (``CHATML_BLAS=0``, engine never imported: what users
would otherwise get), ``mlx_lm`` (mlx-lm with the fast BLAS), ``chatml_sequential`` (this
engine, fast BLAS, ``mx.fast.gated_delta_update``) and ``chatml`` (fast BLAS + chunked
kernel). The ratios split the speedup into the BLAS part and the engine/kernel part. The stock
configuration is slow (reference BLAS), so it only runs at ``--stock-ts``; ratios are taken at
lengths both sides measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.common import write_json
from bench.throughput import CONFIGS, _ints, measure, print_table

TARGET = 10.0  # issue 5: chatml prefill >= 10x mlx-lm stock


def ratios(result: dict) -> dict:
    """tokens/s ratios between configurations, per prompt length both measured."""
    res = result["results"]

    def tps(config: str, t: str) -> float | None:
        r = res.get(config, {}).get("prefill", {}).get(t)
        return r["tokens_per_s"] if r else None

    pairs = {
        "chatml_vs_mlx_lm_stock": ("chatml", "mlx_lm_stock"),
        "mlx_lm_fast_blas_vs_mlx_lm_stock": ("mlx_lm", "mlx_lm_stock"),
        "chatml_vs_mlx_lm_fast_blas": ("chatml", "mlx_lm"),
        "chunked_vs_sequential_kernel": ("chatml", "chatml_sequential"),
    }
    ts = sorted({t for r in res.values() for t in r["prefill"]}, key=int)
    out = {}
    for name, (a, b) in pairs.items():
        vals = {t: tps(a, t) / tps(b, t) for t in ts if tps(a, t) and tps(b, t)}
        if vals:
            out[name] = vals
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    ap.add_argument("--ts", default="512,2048", help="prefill lengths (comma separated)")
    ap.add_argument("--stock-ts", default="512", help="lengths for mlx_lm_stock (slow)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--models-dir")
    ap.add_argument("--json")
    a = ap.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    # Stock first: the slowest and the most sensitive to other load on a shared machine.
    configs.sort(key=lambda c: c != "mlx_lm_stock")
    result = measure(
        a.model, configs, _ints(a.ts), 0, stock_ts=_ints(a.stock_ts), stock_decode=0,
        repeats=a.repeats, models_dir=a.models_dir,
    )  # fmt: skip
    result["ratios"] = ratios(result)
    result["target"] = f"chatml prefill >= {TARGET:.0f}x mlx_lm_stock"
    print_table(result)
    for name, vals in result["ratios"].items():
        print(f"{name:<34} " + "  ".join(f"{t}: {v:.1f}x" for t, v in vals.items()))
    print(json.dumps({"bench": "prefill", **result}))
    write_json(a.json, result)


if __name__ == "__main__":
    main()
