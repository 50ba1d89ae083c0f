"""Speculative decoding: decode tokens/s against the injected acceptance rate, k = 1..4.

Random weights make real acceptance rates meaningless, so this measures the mechanism: the
drafter proposes the model's own greedy continuation with each draft token wrong at a given
rate (0 accepts everything, 1 nothing), and each (k, rate) cell is timed against plain
(pipelined) decoding of the same prompt, run beside it (medians of `--repeats`). Output is
checked token-for-token against plain decoding on every run. Prints a table, writes JSON
with the conditions (`--json`).

`--mtp` loads the checkpoint's MTP head: the injected cells then carry its cache (which
follows every pass, lazily: the head itself never runs for them), and rows `mtp` draft with
the head (with random weights its drafts are almost never right: the rows show what drafting
costs when it fails, fixed k and adaptive; adaptive stops drafting, and the head then only
catches up at each probe). Plain decoding runs on the target's caches alone, as an engine
without the head.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _run(model, prompt, n, drafter=None, k=1, adaptive=False):
    import mlx.core as mx

    from engine.runtime.generate import decode, eval_caches, prefill
    from engine.runtime.sampling import Sampler, SamplingParams
    from engine.runtime.speculative import DraftLength, SpeculationStats, speculative_decode

    caches = model.make_caches()
    if drafter is None:  # the target alone: what an engine without the MTP head runs
        caches = caches[: len(model.layers)]
    logits, _ = prefill(model, caches, prompt, 0)
    mx.eval(logits)
    eval_caches(caches)
    stats = SpeculationStats()
    sampler, history = Sampler(SamplingParams()), list(prompt)
    if drafter is None:
        steps = decode(model, caches, logits, sampler, max_tokens=n, stop_ids=(), history=history)
    else:
        steps = speculative_decode(
            model, caches, logits, sampler, max_tokens=n, stop_ids=(), history=history,
            drafter=drafter, policy=DraftLength(k, adaptive=adaptive), stats=stats,
        )  # fmt: skip
    t = time.perf_counter()
    out = list(steps)
    return out, (n - 1) / (time.perf_counter() - t), stats


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--rates", default="0,0.25,0.5,0.75,1")
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="also run the adaptive k (up to the largest of --ks) at each rate",
    )
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per cell, each beside a plain run (medians: a busy machine)")  # fmt: skip
    ap.add_argument("--mtp", action="store_true",
                    help="load the MTP head: its cache rides along, and rows `mtp` draft with it")  # fmt: skip
    ap.add_argument("--models-dir")
    ap.add_argument("--json")
    args = ap.parse_args()

    import engine
    from bench.common import conditions, model_path, write_json
    from engine.runtime.mtp import MTPDrafter
    from engine.runtime.speculative import InjectedDrafter

    eng = engine.load(str(model_path(args.model, args.models_dir)),
                      speculative="mtp" if args.mtp else None)  # fmt: skip
    prompt = eng.tokenizer.encode("Tell me a long story about a fox and a crow. " * 8)
    n = args.tokens
    _run(eng.model, prompt, 8)  # warm-up: compile the decode path
    truth, plain_tps, _ = _run(eng.model, prompt, n)
    rows = []
    print(f"plain decoding: {plain_tps:.1f} tok/s ({n} tokens)")
    print(
        f"{'k':>4} {'reject':>6} {'accepted':>8} {'tok/verify':>10} {'tok/s':>7} {'plain':>7} "
        f"{'vs plain':>8}"
    )
    ks, rates = [int(x) for x in args.ks.split(",")], [float(x) for x in args.rates.split(",")]
    cells = [(k, rate, False) for k in ks for rate in rates]
    cells += [(max(ks), rate, True) for rate in rates] if args.adaptive else []
    if args.mtp:
        cells += [(k, "mtp", False) for k in ks] + [(max(ks), "mtp", True)]
    # warm-up: compile each verify shape once (the adaptive k's probes verify one draft; the
    # MTP head traces its own draft steps), so no timed run pays a first trace
    for k in sorted(set(ks) | ({1} if args.adaptive or args.mtp else set())):
        _run(eng.model, prompt, 8, InjectedDrafter(truth, len(prompt), 0.0), k)
        if args.mtp:
            _run(eng.model, prompt, 8, MTPDrafter(), k)
    for k, rate, adaptive in cells:
        spec, plain = [], []
        for _ in range(args.repeats):
            plain.append(_run(eng.model, prompt, n)[1])
            drafter = (MTPDrafter() if rate == "mtp" else
                       InjectedDrafter(truth, len(prompt), rate, seed=k))  # fmt: skip
            out, tps, st = _run(eng.model, prompt, n, drafter, k, adaptive)
            if out != truth:
                raise SystemExit(f"k={k} rate={rate}: output differs from plain decoding")
            spec.append(tps)
        tps, plain_tps = statistics.median(spec), statistics.median(plain)
        row = {"k": f"<={k}" if adaptive else k, "reject_rate": rate,
               "acceptance": round(st.acceptance_rate, 3),
               "tokens_per_verify": round(st.tokens_per_verify, 2),
               "tokens_per_s": round(tps, 2), "plain_tokens_per_s": round(plain_tps, 2),
               "speedup": round(tps / plain_tps, 3)}  # fmt: skip
        rows.append(row)
        shown = rate if rate == "mtp" else f"{rate:.2f}"
        print(f"{row['k']:>4} {shown:>6} {row['acceptance']:>8.2f} {row['tokens_per_verify']:>10.2f}"
              f" {tps:>7.1f} {plain_tps:>7.1f} {row['speedup']:>7.2f}x")  # fmt: skip
    write_json(args.json, {"bench": "speculative", "model": args.model, "tokens": n, "mtp": args.mtp,
                           "repeats": args.repeats, "rows": rows,
                           "conditions": conditions(dtype="float32")})  # fmt: skip


if __name__ == "__main__":
    main()
