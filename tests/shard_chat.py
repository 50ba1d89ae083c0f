"""A scripted chat for the sharding tests (tests/test_shard.py), run in one process or by every
rank of a launched group: `python tests/shard_chat.py MODEL OUT [--shard pipeline] [--pause]
[--drop] [--draft DIR] [--sequential] [--short] [--budget BYTES] [--cache-dir DIR]
[--save HOME | --resume HOME | --forks]`. Rank 0 writes
OUT.json (per turn: tokens, counts, logprobs) and OUT.npz (the logits of fresh prefills); the
other ranks serve it and exit.

`--pause` streams one long answer instead, printing ANSWERING after its first piece and
waiting for a line on stdin (the tests kill or stop a rank there), then reading 32 pieces more
(each a step through every rank) before it stops the answer; `--drop`
answers once, lets the engine be collected, prints DROPPED and waits for a line.
`--save HOME` chats in a persisted session under HOME, with a disk tier in HOME/disk;
`--resume HOME` resumes it there (see `persist`); `--forks` runs `forks`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import engine  # first: the fast BLAS loads before mlx (imported where used below)

QUESTIONS = [
    "Hello! My order number is 48213.", "你好，今天天气怎么样？", "Tell me a story about a fox.",
    "What is 17 times 23?", "ok",
]  # fmt: skip
TOOL_CALL = (
    "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n"
    "</parameter>\n</function>\n</tool_call>"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
MAX_TOKENS = 8


class ToolCaller:
    """A sampler that calls the tool, then stops (the random model never would)."""

    reads_history = False

    def __init__(self, eng):
        self.ids = eng.tokenizer.encode(TOOL_CALL) + [eng.stop_ids[0]]
        self.i = 0

    def __call__(self, logits, recent):
        import mlx.core as mx

        self.i += 1
        return mx.array(self.ids[min(self.i - 1, len(self.ids) - 1)])


def run(eng, short: bool = False) -> tuple[list[dict], list]:
    """Plain turns, window trimming, regenerate, edit, a tool round and a stateless chat
    (`short`: the first four); per turn what it produced, and the logits of a fresh prefill
    of the first and the last turn's prompts."""
    import mlx.core as mx
    import numpy as np

    import engine.session as session_module

    turns = []
    s = eng.session("You are a helpful assistant.", max_exchanges=1)
    ask = {"max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 2}
    for q in QUESTIONS[:3]:  # the third drops the first exchange from the window
        turns.append(s.send(q, **ask))
    turns.append(s.regenerate(**ask))
    if not short:
        turns += _more(eng, s, ask, session_module)

    def fresh(ids):
        logits = eng.model(mx.array([ids]), eng.model.make_caches())[0, -1]
        return np.array(logits.astype(mx.float32))

    rows = []
    for t in turns:
        rows.append({
            "tokens": t.token_ids, "reused": t.stats.reused_tokens,
            "prefilled": t.stats.prefilled_tokens, "cache_bytes": t.stats.cache_bytes,
            "logprobs": [lp.logprob for lp in t.logprobs or []], "tool_calls": len(t.tool_calls),
        })  # fmt: skip
    if not short:
        rows.append(eng.worker.call(_speculative, eng, turns[-1].prompt_ids))
    return rows, [eng.worker.call(fresh, t.prompt_ids) for t in (turns[0], turns[-1])]


def _speculative(eng, prompt: list[int]) -> dict:
    """Verify steps with drafts half of them wrong (kept states, rollbacks on every rank)."""
    from engine.runtime.generate import decode, eval_caches, prefill
    from engine.runtime.sampling import Sampler, SamplingParams
    from engine.runtime.speculative import (
        DraftLength,
        InjectedDrafter,
        SpeculationStats,
        speculative_decode,
    )

    def start():
        caches = eng.model.make_caches()
        logits, _ = prefill(eng.model, caches, prompt, 0)
        return caches, logits

    caches, logits = start()
    plain = list(decode(eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=24,
                        stop_ids=(), history=list(prompt)))  # fmt: skip
    caches, logits = start()
    stats = SpeculationStats()
    drafter = InjectedDrafter(plain, len(prompt), reject_rate=0.5, seed=1)
    out = list(speculative_decode(
        eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=24, stop_ids=(),
        history=list(prompt), drafter=drafter, policy=DraftLength(3, adaptive=False), stats=stats,
    ))  # fmt: skip
    eval_caches(caches)
    return {"tokens": out, "plain": plain, "accepted": stats.accepted, "drafted": stats.drafted,
            "offset": caches[0].offset, "cache_bytes": sum(c.nbytes for c in caches)}  # fmt: skip


class Failing:
    """A sampler that fails at its third pick: the turn rolls back on every rank."""

    reads_history = False

    def __init__(self, real):
        self.real, self.n = real, 0

    def __call__(self, logits, recent):
        self.n += 1
        if self.n == 3:
            raise RuntimeError("injected failure")
        return self.real(logits, recent)


def _more(eng, s, ask, session_module) -> list:
    turns = []
    turns.append(s.edit_last(QUESTIONS[4], **ask))
    original = session_module.Sampler
    session_module.Sampler = lambda params: Failing(original(params))
    try:
        s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)
        raise AssertionError("the injected failure did not happen")
    except RuntimeError as e:
        assert "injected failure" in str(e)
    finally:
        session_module.Sampler = original
    stream = s.stream(QUESTIONS[3], max_tokens=MAX_TOKENS)  # interrupted after two pieces
    next(stream), next(stream)
    stream.close()
    s.warm()  # idle-time prefill of the next prompt's known part
    turns.append(s.send(QUESTIONS[0], **ask))
    session_module.Sampler = lambda params: ToolCaller(eng)
    try:
        turns.append(s.send(QUESTIONS[1], max_tokens=200, tools=TOOLS))
    finally:
        session_module.Sampler = original
    turns.append(s.send_tool_results(["sunny, 21 C"], max_tokens=MAX_TOKENS))
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    first = eng.chat(messages, max_tokens=MAX_TOKENS)
    # Its idle-time warm-up prefills the next request's known part; how much of it the next
    # request finds done is a race, so wait for it: every run reuses the same.
    assert eng.worker.idle.wait(60)
    messages += [first.message(), {"role": "user", "content": QUESTIONS[3]}]
    return turns + [first, eng.chat(messages, max_tokens=MAX_TOKENS)]


SESSION, SYSTEM = "saved", "You are a helpful assistant."


def persist(eng, home: Path, resume: bool) -> tuple[list[dict], list]:
    """Save: two turns of a persisted session (its state saved after each; the disk tier
    keeps each turn's resume points). Resume, in a new process: first a stateless chat of the
    saved conversation, which only the disk tier can serve (the pool starts empty); then the
    session resumed from its state file, two turns (the first trims the window: it restarts
    from a snapshot read from the file) and a regenerate. Per turn: tokens, counts, whether
    the state came from disk, and the tokens a fresh prefill of the same prompt decodes."""
    import math

    import mlx.core as mx
    import numpy as np

    from engine.runtime.generate import decode, prefill
    from engine.runtime.sampling import Sampler, SamplingParams
    from engine.storage.store import SessionStore

    disk = eng.attach_disk(home / "disk", 1 << 30, min_tokens=8)
    disk.read_bps = math.inf  # a read always beats a prefill: the choice must not be timed
    store = SessionStore(home, warn=print)
    turns, extra = [], {}
    if resume:
        saved = store.read(SESSION).history
        messages = [{"role": "system", "content": SYSTEM}, *saved[0],
                    {"role": "user", "content": QUESTIONS[1]}]  # fmt: skip
        turns.append(eng.chat(messages, max_tokens=MAX_TOKENS))
        extra["disk_reads"] = disk.reads
    stored = store.open(SESSION, eng, system=SYSTEM, max_exchanges=1)
    extra["state_loaded"], extra["resumed"] = stored.state_loaded, stored.resumed_turns
    s = stored.session
    asks = QUESTIONS[2:4] if resume else QUESTIONS[:2]
    for q in asks:
        turns.append(s.send(q, max_tokens=MAX_TOKENS))
        stored.append_turn(turns[-1])
        stored.save_state()
    if resume:
        turns.append(s.regenerate(max_tokens=MAX_TOKENS))
    stored.close()
    eng.detach_disk()  # its writes finish; the folder is free for the next process

    def fresh(ids, n):
        caches = eng.model.make_caches()
        logits, _ = prefill(eng.model, caches, ids, 0)
        out = list(decode(eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=n,
                          stop_ids=(), history=list(ids)))  # fmt: skip
        return out, np.array(logits.astype(mx.float32))

    rows, logits = [], []
    for t in turns:
        tokens, last = eng.worker.call(fresh, t.prompt_ids, len(t.token_ids))
        rows.append({"tokens": t.token_ids, "fresh": tokens, "reused": t.stats.reused_tokens,
                     "prefilled": t.stats.prefilled_tokens, "cache_bytes": t.stats.cache_bytes,
                     **extra})  # fmt: skip
        logits.append(last)
    return rows, logits


def forks(eng) -> tuple[list[dict], list]:
    """Stateless requests from two conversations on one system prompt: the second branches
    off the first one's pooled sequence, so the pool forks the shared prefix into another
    slot (its KV rows copied); then the first conversation goes on in its own slot. Per
    answer what it produced, the pool's forks, and the logits of a fresh prefill of each
    prompt."""
    import mlx.core as mx
    import numpy as np

    system = {"role": "system", "content": SYSTEM}
    first = [system, {"role": "user", "content": QUESTIONS[0]}]
    chats = [first, [system, {"role": "user", "content": QUESTIONS[2]}]]
    answers = []
    for messages in chats + [None]:
        if messages is None:  # the first conversation's next turn
            messages = [*first, answers[0].message(), {"role": "user", "content": QUESTIONS[3]}]
        answers.append(eng.chat(messages, max_tokens=MAX_TOKENS))
        assert eng.worker.idle.wait(60)  # its idle-time warm-up is done: no race

    def fresh(ids):
        logits = eng.model(mx.array([ids]), eng.model.make_caches())[0, -1]
        return np.array(logits.astype(mx.float32))

    rows = [{"tokens": t.token_ids, "reused": t.stats.reused_tokens,
             "prefilled": t.stats.prefilled_tokens, "cache_bytes": t.stats.cache_bytes,
             "forks": eng.stateless.pool.forks} for t in answers]  # fmt: skip
    return rows, [eng.worker.call(fresh, t.prompt_ids) for t in answers]


def pause(eng) -> None:
    s = eng.session("You are a helpful assistant.")
    for i, _ in enumerate(s.stream(QUESTIONS[2], max_tokens=4000)):
        if i == 0:
            print("ANSWERING", flush=True)
            sys.stdin.readline()
        elif i == 32:
            break  # the rest of the answer would only take time
    print("FINISHED", flush=True)


def drop(held: list) -> None:
    """Answer once, let the engine go (the process lives on), print DROPPED, wait for a line.
    `held` holds the only reference to the engine (the caller's frame keeps none)."""
    import gc
    import weakref

    held[0].chat([{"role": "user", "content": QUESTIONS[0]}], max_tokens=4)
    assert held[0].worker.idle.wait(60)  # the answer's task has ended on the model thread
    ref = weakref.ref(held.pop())
    gc.collect()
    gc.collect()
    print("DROPPED" if ref() is None else "STILL HELD", flush=True)
    sys.stdin.readline()
    print("FINISHED", flush=True)


def main(argv: list[str]) -> None:
    model, out = argv[0], Path(argv[1])
    shard = "pipeline" if "--shard" in argv else None
    budget = int(argv[argv.index("--budget") + 1]) if "--budget" in argv else None
    disk = argv[argv.index("--cache-dir") + 1] if "--cache-dir" in argv else None
    draft = argv[argv.index("--draft") + 1] if "--draft" in argv else None
    eng = engine.load(model, shard=shard, chunked_delta="--sequential" not in argv,
                      cache_bytes=budget, cache_dir=disk,
                      speculative=f"draft:{draft}" if draft else None)  # fmt: skip
    if "--pause" in argv:
        return pause(eng)
    if "--drop" in argv:
        held = [eng]
        del eng
        return drop(held)
    import numpy as np

    if "--forks" in argv:
        rows, logits = forks(eng)
    elif "--save" in argv or "--resume" in argv:
        home = Path(argv[argv.index("--save" if "--save" in argv else "--resume") + 1])
        rows, logits = persist(eng, home, resume="--resume" in argv)
    else:
        rows, logits = run(eng, short="--short" in argv)
    out.with_suffix(".json").write_text(json.dumps(rows))
    np.savez(out.with_suffix(".npz"), *logits)


if __name__ == "__main__":
    main(sys.argv[1:])
