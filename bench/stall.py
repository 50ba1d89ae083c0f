"""The stall of decoding rows while prompts arrive: `python -m bench.stall [--model tiny
--pass-tokens 128,256,512]`.

`--decoders` conversations stream long answers (greedy, `--max-tokens`); once each has streamed
three pieces, `--arrivals` requests with distinct prompts of about `--prompt-tokens` tokens
come together. For each `--pass-tokens` budget (`engine.load(pass_tokens=...)`, a fresh engine
per run, so nothing is reused across runs), it reports the decoders' gaps between streamed
pieces while the arrivals are served (the longest, and the median: the stall the budget
bounds; a piece can take two steps, when a token completes no text: `decoder_tokens` against
`decoder_pieces` counts them), each arrival's time to
first token and their mean, the time until the last first token, and the batch's passes (how
many, the most tokens in one). `--late-tokens N` sends one more request, with a prompt of
about N tokens, once the arrivals' prefill has run two passes: with `--arrivals 1
--prompt-tokens 2000 --late-tokens 60`, how long a short prompt waits behind a long one. `--repeats` runs the budgets round by round, in turn, so the
ratios share the moments of a noisy machine. Prints a table, then JSON (`--json` writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from bench.common import conditions, model_path, write_json


def _words(salt: int, k: int, tokens: int) -> str:
    """A system prompt of about `tokens` tokens, its own for each (run, arrival)."""
    return " ".join(f"r{salt}a{k}w{j}" for j in range(tokens // 6))


def run(folder: str, pass_tokens: int, args, salt: int) -> dict:
    """One run: the decoders, then the arrivals, on a fresh engine with this budget."""
    import engine

    budget = {} if pass_tokens is None else {"pass_tokens": pass_tokens}  # None: the default
    tasks = args.decoders + args.arrivals + bool(args.late_tokens)
    eng = engine.load(folder, max_batch=tasks, **budget)
    eng.chat([{"role": "user", "content": "warm up"}], max_tokens=2)
    streaming = [threading.Event() for _ in range(args.decoders)]
    stamps: list[list[float]] = [[] for _ in range(args.decoders)]
    ttft: list[float | None] = [None] * (tasks - args.decoders)
    firsts: list[float] = []  # when each of the arrivals (not the late one) saw its first token

    tokens = [0] * args.decoders  # each decoder's answer, in tokens (its pieces: stamps)

    def decoder(k: int) -> None:
        chat = [{"role": "user", "content": f"Run {salt}, decoder {k}: tell a long story."}]
        for piece in eng.chat_stream(chat, max_tokens=args.max_tokens):
            if isinstance(piece, str):
                stamps[k].append(time.perf_counter())
                if len(stamps[k]) == 3:
                    streaming[k].set()
            else:
                tokens[k] = len(piece.token_ids)
        streaming[k].set()  # (an answer shorter than three pieces: go on all the same)

    def arrival(k: int, tokens: int) -> None:
        chat = [{"role": "system", "content": _words(salt, k, tokens)},
                {"role": "user", "content": "Hello."}]  # fmt: skip
        start = time.perf_counter()
        for piece in eng.chat_stream(chat, max_tokens=4):
            if isinstance(piece, str) and ttft[k] is None:
                ttft[k] = time.perf_counter() - start
                if k < args.arrivals:
                    firsts.append(time.perf_counter())

    decoders = [threading.Thread(target=decoder, args=(k,)) for k in range(args.decoders)]
    for t in decoders:
        t.start()
    for e in streaming:
        e.wait()
    before, came = eng.batch_stats, time.perf_counter()
    arrivals = [threading.Thread(target=arrival, args=(k, args.prompt_tokens))
                for k in range(args.arrivals)]  # fmt: skip
    for t in arrivals:
        t.start()
    if args.late_tokens:  # once the arrivals' prefill has run two passes
        while eng.batch_stats["steps"] < before["steps"] + 2 and any(
            a.is_alive() for a in arrivals
        ):
            time.sleep(0.01)
        arrivals.append(threading.Thread(target=arrival, args=(args.arrivals, args.late_tokens)))
        arrivals[-1].start()
    for t in arrivals:
        t.join()
    served = time.perf_counter()
    after = eng.batch_stats
    for t in decoders:
        t.join()
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if came <= b and a <= served]
    prompt = len(eng.tokenizer.encode(_words(salt, 0, args.prompt_tokens)))
    return {
        "pass_tokens": pass_tokens,
        "prompt_tokens": prompt,
        "gap_max_s": max(gaps, default=float("nan")),
        "gap_p50_s": statistics.median(gaps) if gaps else float("nan"),
        "gaps": len(gaps),
        "ttft_s": ttft[: args.arrivals],
        "ttft_mean_s": statistics.mean(t for t in ttft[: args.arrivals] if t is not None),
        "late_ttft_s": ttft[args.arrivals] if args.late_tokens else None,
        "last_first_token_s": max(firsts) - came,
        # fewer pieces than tokens: some pieces took two steps (a token completing no text)
        "decoder_tokens": tokens,
        "decoder_pieces": [len(st) for st in stamps],
        "passes": after["steps"] - before["steps"],
        "longest_pass": after.get("longest"),  # (older builds did not count it)
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    p.add_argument(
        "--pass-tokens",
        default="128,256,512",
        help="comma-separated budgets (default: load's own, as older builds take)",
    )
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--arrivals", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=600, help="each arrival's prompt, about")
    p.add_argument("--max-tokens", type=int, default=160, help="each decoder's answer")
    p.add_argument(
        "--late-tokens",
        type=int,
        default=0,
        help="one more request, of about this many tokens, once the arrivals' "
        "prefill has run two passes: its time to first token (late_ttft_s)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    budgets = [None if b == "default" else int(b) for b in args.pass_tokens.split(",")]
    folder = str(model_path(args.model))
    runs = []
    for r in range(args.repeats):
        for b in budgets:
            runs.append({"round": r, **run(folder, b, args, salt=len(runs)),
                         "load_average": [round(x, 2) for x in os.getloadavg()]})  # fmt: skip
            x = runs[-1]
            print(
                f"pass_tokens {b or 'default':>7}: decoders' gap max {x['gap_max_s']:6.2f} s, p50 "
                f"{x['gap_p50_s']:5.2f} s | arrivals' TTFT mean {x['ttft_mean_s']:6.2f} s, "
                f"last {x['last_first_token_s']:6.2f} s | {x['passes']} passes, longest "
                f"{x['longest_pass']} tokens | late TTFT {x['late_ttft_s'] or 0:.2f} s | "
                f"load {x.get('load_average')}",
                flush=True,
            )
    result = {"model": args.model, "decoders": args.decoders, "arrivals": args.arrivals,
              "max_tokens": args.max_tokens, "runs": runs, **conditions()}  # fmt: skip
    print(json.dumps(result))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
