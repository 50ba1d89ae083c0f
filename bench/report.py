"""Markdown tables from a benchmark's JSON, ready to paste into BENCHMARKS.md.

Run: ``chatml bench report FILE.json [FILE.json ...]`` (replay or throughput results).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.replay import BASELINES, ENGINES, LABELS, summary

MIB = 2**20


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(head: list[str], rows: list[list]) -> list[str]:
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)]


def replay(result: dict) -> str:
    e, turns = result["engines"], result["turns"]
    names = [n for n in ENGINES if n in e]
    warm = e.get("chatml_warm")
    head = ["turn", "prompt", "min", "trims", *(f"{LABELS[n]} prefilled / TTFT" for n in names)]
    if warm:
        head.append("warm() after")
    rows = []
    for k, info in enumerate(turns):
        row = [info["turn"], info["prompt_tokens"], info["min_prefill_tokens"],
               "yes" if info["trims_window"] else ""]  # fmt: skip
        row += [f"{e[n][k]['prefilled_tokens']} / {e[n][k]['ttft_s']:.2f} s" for n in names]
        if warm:
            w = warm[k]
            after = w.get("warm_s_after")
            row.append(f"{w['warm_prefilled_after']} tok, {after:.1f} s" if after else "-")
        rows.append(row)
    out = _table(head, rows)

    s = summary(result)  # recomputed: older files lack some keys
    out += ["", *_table(
        ["engine", "decode tok/s (median)", "TTFT sum, turns 3+", "cache bytes (last turn)"],
        [[LABELS[n], f"{s[f'{n}_decode_tps_median']:.2f}", f"{s[f'{n}_ttft_s_sum_from_turn3']:.1f} s",
          f"{e[n][-1]['cache_bytes'] / MIB:.1f} MiB"] for n in names],
    )]  # fmt: skip

    rows = []
    for name in ("chatml", "chatml_warm"):
        for base in BASELINES:
            key = f"{name}_vs_{base}_ttft_ratio_min"
            if key in s:
                under = s[f"{name}_under_5x_vs_{base}_turns"]
                slower = s[f"{name}_slower_than_{base}_turns"]
                decode = s.get(f"{name}_decode_slower_than_{base}_turns")
                rows.append([LABELS[name], LABELS[base], f"{s[key]:.1f}x",
                             f"{s[f'{name}_vs_{base}_ttft_ratio_median']:.1f}x",
                             ", ".join(map(str, under)) or "none",
                             ", ".join(map(str, slower)) or "none",
                             "-" if decode is None else ", ".join(map(str, decode)) or "none",
                             ])  # fmt: skip
    out += ["", *_table(["engine", "vs", "TTFT ratio, min (turns 3+)", "median",
                         "turns under 5x", "turns slower", "decode slower on turns"],
                        rows)]  # fmt: skip
    return "\n".join(out)


def throughput(result: dict) -> str:
    res = result["results"]
    ts = sorted({int(t) for r in res.values() for t in r["prefill"]})
    rows = []
    for name, r in res.items():
        cells = [f"{r['prefill'][str(t)]['tokens_per_s']:.1f}" if str(t) in r["prefill"] else "-"
                 for t in ts]  # fmt: skip
        dec = f"{r['decode']['tokens_per_s']:.2f}" if r.get("decode") else "-"
        rows.append([name, *cells, dec, f"{r['peak_memory_bytes'] / 2**30:.2f} GiB",
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB"])  # fmt: skip
    head = ["config", *(f"prefill {t} tok/s" for t in ts), "decode tok/s", "peak MLX memory",
            "peak RSS"]  # fmt: skip
    return "\n".join(_table(head, rows))


def report(result: dict) -> str:
    if "engines" in result:
        return replay(result)
    if "results" in result:
        return throughput(result)
    raise ValueError("not a replay or throughput result (no 'engines' or 'results')")


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSON written by --json")
    a = ap.parse_args()
    for i, file in enumerate(a.files):
        try:
            text = report(json.loads(Path(file).read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError) as err:
            sys.exit(f"chatml bench report: {file}: {err}")
        print(("\n" if i else "") + f"<!-- {file} -->\n{text}")


if __name__ == "__main__":
    main()
