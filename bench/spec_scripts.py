"""Speculative decoding inside the session cache, over randomized session scripts.

A script is a conversation of random turn shapes drawn from a seed: plain turns, turns that
trim the window (one or two exchanges kept), a forced tool call and the turn that answers
its result, regenerate, a stream the user walks away from, an answer refused after it was
generated (rolled back), an idle-time warm-up before a turn. Each script runs twice on one engine, with drafting off and on. The checks, against
references that do not draft:

- every answer with drafting equals the one without, token for token (greedy);
- every answer without drafting equals greedy decoding after one fresh full prefill of the
  same prompt ids (no session, no snapshots), except the forced tool calls (grammar-masked);
- at the end, the drafting session's caches equal a fresh prefill of its tokens: recurrent
  and KV states, and the logits of one more step within 1e-4.

`oracle` drafts the answer the plain run gave, each draft token wrong at `--reject` (so
acceptances and rollbacks happen at every position with random weights, where `lookup` and
`mtp` almost never draft right). The suite runs these scripts on `tiny`
(tests/test_speculative.py); this runs them on a bigger build:

    chatml bench spec_scripts --model qwen3.5-0.8b --drafters oracle,lookup,mtp --seeds 0,1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.common import fresh_greedy

QUESTIONS = [
    "Hello! My order number is 48213.", "你好，今天天气怎么样？", "Tell me a story about a fox.",
    "What is 17 times 23?", "Summarize the French revolution in one line. " * 3,
    "请用中文解释一下量子计算。", "Code word: PELICAN. Remember it.", "ok",
    "List three prime numbers\nand explain.", "Repeat after me: the quick brown fox.",
]  # fmt: skip
SYSTEMS = ["You are terse.", "简洁地回答。", None]
ACTIONS = ["send"] * 4 + ["regenerate", "tool", "interrupt", "warm", "fail"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "北京"]}},
                   "required": ["city"]}}}]  # fmt: skip
TOOL_RESULT = '{"temp": 21, "sky": "clear"}'


@dataclass
class Record:
    """One checked answer of a script."""

    action: str  # send | regenerate | warm | tool call | tool result
    prompt_ids: list[int]
    token_ids: list[int]
    drafted: int = 0
    accepted: int = 0


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    interrupts: int = 0  # streams walked away from, each leaving the history as it was
    failures: int = 0  # answers rejected by `validate`, each rolled back
    session: object = None


def plan(seed: int) -> tuple[str | None, int, list[tuple[str, str]]]:
    """Script `seed`: the system prompt, the exchanges kept, and (turn shape, message) pairs.
    A `regenerate` with nothing to regenerate yet is a `send`."""
    rng = random.Random(seed)
    system, keep = rng.choice(SYSTEMS), rng.choice([1, 2])
    steps = []
    for _ in range(rng.randint(5, 8)):
        action, q = rng.choice(ACTIONS), rng.choice(QUESTIONS)
        answered = any(a not in ("interrupt", "fail") for a, _ in steps)  # left a history
        steps.append(("send" if action == "regenerate" and not answered else action, q))
    return system, keep, steps


class Rejected(Exception):
    """What a `fail` turn's `validate` raises: the answer is refused and rolled back."""


def _reject(turn) -> None:
    raise Rejected(f"refused {len(turn.token_ids)} tokens")


def run_script(eng, seed: int, *, max_tokens: int = 8) -> Run:
    """Play script `seed` on `eng` as it is set up (drafting or not). Raises AssertionError
    if an interrupted stream or a failed turn changed the history, or a forced tool call made
    no call."""
    system, keep_exchanges, steps = plan(seed)
    s = eng.session(system, max_exchanges=keep_exchanges, enable_thinking=False)
    run = Run(session=s)

    def keep(action, turn):
        st = turn.stats
        run.records.append(Record(action, list(turn.prompt_ids), list(turn.token_ids),
                                  st.drafted_tokens, st.accepted_tokens))  # fmt: skip

    for action, q in steps:
        if action == "interrupt":
            before = [list(e) for e in s.history]
            stream = s.stream(q, max_tokens=max_tokens)
            next(stream, None)
            stream.close()
            assert s.history == before, "an interrupted stream changed the history"
            run.interrupts += 1
        elif action == "fail":  # a whole answer drafted and decoded, then refused
            before = [list(e) for e in s.history]
            try:
                s.send(q, max_tokens=max_tokens, validate=_reject)
                raise AssertionError("the failed turn did not raise")
            except Rejected:
                pass
            assert s.history == before, "a failed turn changed the history"
            run.failures += 1
        elif action == "tool":
            call = s.send(q, tools=TOOLS, tool_choice="required", max_tokens=48)
            keep("tool call", call)
            assert call.tool_calls, f"the forced tool call made none: {call.tool_call_error}"
            keep("tool result", s.send_tool_results([TOOL_RESULT], max_tokens=max_tokens))
        elif action == "regenerate":
            keep(action, s.regenerate(max_tokens=max_tokens))
        else:
            if action == "warm":
                s.warm()
            keep(action, s.send(q, max_tokens=max_tokens))
    return run


class Oracle:
    """A drafter for one answer: the plain run's answer to the same prompt (the longest known
    prompt the history starts with), each draft token wrong at `rate` (seeded)."""

    def __init__(self, answers: dict[tuple, list[int]], stop: int, rate: float):
        self.answers, self.stop, self.rate, self.inner = answers, stop, rate, None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        from engine.runtime.speculative import InjectedDrafter

        if self.inner is None:
            prompts = [p for p in self.answers if len(p) < len(history)
                       and tuple(history[: len(p)]) == p]  # fmt: skip
            if not prompts:
                return []
            p = max(prompts, key=len)
            truth = self.answers[p] + [self.stop]
            self.inner = InjectedDrafter(truth, len(p), self.rate, seed=len(p))
        return self.inner.propose(history, k)


def cache_error(model, caches, tokens, next_token: int = 198) -> tuple[float, float]:
    """How far the target's `caches` (an MTP head's left out) are from a fresh prefill of
    `tokens`: the largest state difference relative to max(1, that state's largest magnitude),
    and the largest difference of the logits one more step (`next_token`) gives. The caches
    are left as they were. Empty caches (no tokens) equal a fresh prefill of nothing."""
    import mlx.core as mx
    import numpy as np

    from engine.runtime import snapshot
    from engine.runtime.cache import KVCache, RecurrentCache
    from engine.runtime.generate import prefill
    from engine.runtime.step import Row, forward

    n = len(model.layers)
    ours = list(caches[:n])
    fresh = model.make_caches()[:n]
    prefill(model, fresh, list(tokens), 0)
    state = 0.0
    for a, b in zip(ours, fresh):
        assert isinstance(a, (KVCache, RecurrentCache)) and a.offset == b.offset
        pairs = zip(a.state or (None, None), b.state or (None, None)) \
            if isinstance(a, KVCache) else [(a.conv, b.conv), (a.state, b.state)]  # fmt: skip
        for x, y in pairs:
            if x is None or y is None:  # nothing fed yet (an empty sequence): equal if both
                state = max(state, 0.0 if x is None and y is None else float("inf"))
                continue
            x, y = np.array(x), np.array(y)
            scale = max(1.0, float(np.abs(y).max(initial=0.0)))
            state = max(state, float(np.abs(x - y).max(initial=0.0)) / scale)
    back = snapshot.take(ours, len(tokens))  # the step below is undone after it
    ((la, _),) = forward(model, [Row(ours, [next_token])])
    ((lb, _),) = forward(model, [Row(fresh, [next_token])])
    snapshot.restore(ours, back)
    return state, mx.abs(la - lb).max().item()


def check(eng, seed: int, speculation: Callable, *, max_tokens: int = 8) -> dict:
    """Script `seed` without drafting, then with `speculation(answers)` (a Speculation, given
    the plain run's answers by prompt: the oracle drafts them): what differs, and counts."""
    saved = eng.speculative
    try:
        eng.speculative = None
        plain = run_script(eng, seed, max_tokens=max_tokens)
        eng.speculative = speculation({tuple(r.prompt_ids): r.token_ids for r in plain.records})
        spec = run_script(eng, seed, max_tokens=max_tokens)
    finally:
        eng.speculative = saved
    problems = []
    if [(r.action, r.prompt_ids) for r in plain.records] != \
            [(r.action, r.prompt_ids) for r in spec.records]:  # fmt: skip
        problems.append("the prompts differ with drafting")
    for i, (p, s) in enumerate(zip(plain.records, spec.records)):
        if s.token_ids != p.token_ids:
            problems.append(f"answer {i} ({p.action}) differs with drafting")
        if (
            p.action != "tool call"
            and p.token_ids != fresh_greedy(eng, p.prompt_ids, max_tokens)[0]
        ):
            problems.append(f"answer {i} ({p.action}) differs from a fresh prefill")
    with eng.lock:
        seq = spec.session.seq
        state, logits = cache_error(eng.model, seq.caches, seq.tokens)
    if state > 1e-3 or logits > 1e-4:
        problems.append(f"caches off a fresh prefill: states {state:.2e}, logits {logits:.2e}")
    return {
        "seed": seed,
        "actions": [r.action for r in spec.records]
        + ["interrupt"] * spec.interrupts
        + ["fail"] * spec.failures,
        "answers": len(spec.records),
        "drafted": sum(r.drafted for r in spec.records),
        "accepted": sum(r.accepted for r in spec.records),
        "state_error": state,
        "logits_error": logits,
        "problems": problems,
    }


def speculations(eng, names: Sequence[str], k: int, reject: float = 0.3) -> dict[str, Callable]:
    """Drafter name -> `answers -> Speculation` (fixed k); only `oracle` uses the answers (the
    plain run's, by prompt), drafting them with `reject` of its tokens wrong."""
    from engine.runtime.mtp import MTPDrafter
    from engine.runtime.speculative import LookupDrafter, Speculation

    def fixed(drafter) -> Callable:
        return lambda answers: Speculation(drafter, k, adaptive=False)

    out = {}
    for name in names:
        if name == "oracle":
            out[name] = lambda answers: Speculation(
                lambda: Oracle(answers, eng.stop_ids[0], reject), k, adaptive=False
            )
        elif name == "lookup":
            out[name] = fixed(LookupDrafter)
        elif name == "mtp":
            out[name] = fixed(MTPDrafter)
        elif name.startswith("draft:"):
            from engine.runtime.draft import DraftModel

            draft = DraftModel(name[len("draft:") :])
            draft.load(eng)
            out[name] = fixed(draft)
        else:
            raise SystemExit(
                f"unknown drafter {name!r}: expected oracle, lookup, mtp or draft:NAME"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    ap.add_argument("--drafters", default="oracle,lookup,mtp")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--reject", type=float, default=0.3, help="the oracle's wrong-draft rate")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import engine
    from bench.common import conditions, model_path, write_json

    names = [d for d in a.drafters.split(",") if d]
    path = model_path(a.model, a.models_dir)
    eng = engine.load(str(path), speculative="mtp" if "mtp" in names else None)
    rows = []
    for name, spec in speculations(eng, names, a.num_draft, a.reject).items():
        for seed in (int(s) for s in a.seeds.split(",")):
            t = time.perf_counter()
            row = {"drafter": name, **check(eng, seed, spec, max_tokens=a.max_tokens)}
            row["seconds"] = round(time.perf_counter() - t, 1)
            rows.append(row)
            verdict = "ok" if not row["problems"] else "; ".join(row["problems"])
            print(f"{name:>8} seed {seed}: {row['answers']} answers "
                  f"({', '.join(row['actions'])}), drafted {row['drafted']}, accepted "
                  f"{row['accepted']}, states {row['state_error']:.1e}, logits "
                  f"{row['logits_error']:.1e}, {row['seconds']} s: {verdict}", flush=True)  # fmt: skip
    write_json(a.json, {"bench": "spec_scripts", "model": a.model, "num_draft": a.num_draft,
                        "reject": a.reject, "max_tokens": a.max_tokens, "rows": rows,
                        "conditions": conditions(dtype="float32")})  # fmt: skip
    failed = [r for r in rows if r["problems"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} scripts exact")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
