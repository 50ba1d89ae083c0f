"""Prompts that share a pasted document: `python -m bench.fork [--model tiny --clauses 40]`.

A client sends `--questions` requests in turn, each the same system prompt and one user message:
the same document of `--clauses` sentences, then a different question. The prompts fork inside
that message, where the renderer marks no boundary, so nothing past the system block is
shared unless the pool snapshots there: at the fork, once a second prompt has found it
(`engine.runtime.pool.BRANCH_MIN`), and on a grid inside a long message (`pool.GRID`), which
the second prompt already finds. Each round runs the requests in each of `--modes`: `off`
(neither: the engine before them), `fork` (fork snapshots only), `grid` (both, the engine's
default), each on a fresh engine with a system prompt of the round's own, alternating over
`--repeats` rounds so all share the moments of a noisy machine. Reports each request's time to
first token and reused tokens, and whether the greedy answers of each round are equal in every
mode. Prints a line per run, then JSON (`--json` writes it).
"""

from __future__ import annotations

import argparse
import json
import os

from bench.common import conditions, model_path, write_json

QUESTIONS = [
    "What does clause 3 say?",
    "Who keeps the gardens?",
    "When is garden 9 watered?",
    "How fast is damage reported?",
    "Which clause names garden 12?",
    "Is watering ever skipped?",
]


def document(clauses: int) -> str:
    return " ".join(
        f"Clause {k}: the tenant keeps garden {k} tidy, waters it on day {k % 7}, and reports "
        f"damage within {k + 2} days."
        for k in range(clauses)
    )


MODES = ("off", "fork", "grid")


def run_round(folder: str, args, salt: int, mode: str) -> dict:
    import engine
    from engine.runtime import pool

    eng = engine.load(folder)
    saved = pool.BRANCH_MIN, pool.GRID_POINTS
    if mode == "off":
        pool.BRANCH_MIN = 1 << 62
    if mode != "grid":
        pool.GRID_POINTS = 0
    system = {"role": "system", "content": f"Round {salt}. Answer from the document."}
    text = document(args.clauses)
    ttft, reused, answers = [], [], []
    try:
        for question in QUESTIONS[: args.questions]:
            messages = [system, {"role": "user", "content": f"{text}\n\n{question}"}]
            turn = eng.chat(messages, max_tokens=args.max_tokens, warm=False)
            ttft.append(round(turn.stats.ttft_s, 4))
            reused.append(turn.stats.reused_tokens)
            answers.append(turn.token_ids)
    finally:
        pool.BRANCH_MIN, pool.GRID_POINTS = saved
        eng.close()  # its model thread holds the weights until stopped
    return {"mode": mode, "prompt_tokens": len(turn.prompt_ids),
            "ttft_s": ttft, "reused_tokens": reused, "answers": answers,
            "load_average": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.fork", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    p.add_argument(
        "--clauses", type=int, default=40, help="the document's sentences (~30 tokens each)"
    )
    p.add_argument("--questions", type=int, default=4, choices=range(2, len(QUESTIONS) + 1))
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES)
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    folder = str(model_path(args.model))
    rounds = []
    for r in range(args.repeats):
        for mode in modes:
            x = run_round(folder, args, salt=r, mode=mode)
            rounds.append({"round": r, **x})
            pairs = " ".join(f"{t:.2f}s/{n}" for t, n in zip(x["ttft_s"], x["reused_tokens"]))
            print(f"round {r} {mode:>4}: {x['prompt_tokens']} tokens, TTFT/reused {pairs} "
                  f"| load {x['load_average']}", flush=True)  # fmt: skip
    answers = [[x["answers"] for x in rounds if x["mode"] == mode] for mode in modes]
    result = {"model": args.model, "clauses": args.clauses, "rounds": rounds,
              "answers_equal": all(a == answers[0] for a in answers), **conditions()}  # fmt: skip
    print(json.dumps(result))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
