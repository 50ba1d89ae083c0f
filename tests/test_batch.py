"""Continuous batching: concurrent generations decode together, each exactly as alone.

References: a fresh full prefill and greedy decode of each request's prompt ids
(`fresh_greedy`), the same requests run one after another on another engine (answers, logprobs,
reuse counts), and the batch's own counters to show the rows really shared steps.

To make rows overlap without timing, the model thread is held by a job that waits on an event
while the requests queue behind it; released, they all start in one round.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from helpers import QUESTIONS, fresh_greedy

import engine
from engine.runtime.generate import prefill
from engine.runtime.step import Row, forward
from engine.runtime.worker import Job
from engine.serving.completion import parse_request

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def eng():
    return engine.load("tiny", max_batch=4)


class Held:
    """The model thread, held until `release()`: jobs submitted meanwhile start together."""

    def __init__(self, eng):
        self.eng, self.go, self.holding = eng, threading.Event(), threading.Event()
        eng.worker.submit(Job(lambda job: (self.holding.set(), self.go.wait(60))))
        assert self.holding.wait(60)

    def release(self):
        self.go.set()


class Request:
    """One chat request through `StatelessChat.submit` (what the server runs), recorded."""

    def __init__(self, eng, messages, *, on_token=None, **options):
        chat = eng.stateless
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **options}
        self.prepared = chat.prepare(parse_request(body))
        self.events, self.done = [], threading.Event()
        self.on_token = on_token
        self.job = chat.submit(self.prepared, self._emit, warm=False)

    def _emit(self, event):
        self.events.append(event)
        if event[0] == "delta" and self.on_token is not None:
            self.on_token(self)
        if event[0] in ("done", "error"):
            self.done.set()

    def turn(self):
        assert self.done.wait(120), "the request never ended"
        kind, value = self.events[-1]
        assert kind == "done", value
        return value


def messages(i: int, turns: int = 1) -> list[dict]:
    """A conversation of `turns` user messages (answered "ok" but the last)."""
    out = [{"role": "system", "content": f"You are assistant number {i}."}]
    for t in range(turns):
        if t:
            out.append({"role": "assistant", "content": "ok"})
        out.append({"role": "user", "content": QUESTIONS[(i + t) % len(QUESTIONS)]})
    return out


def check_alone(eng, turn, max_tokens=MAX_TOKENS):
    expected, _ = fresh_greedy(eng, turn.prompt_ids, max_tokens)
    assert turn.token_ids == expected


# ----- the step ------------------------------------------------------------------------------


def test_a_batched_step_equals_each_row_alone_at_different_lengths(eng):
    model, rows, alone = eng.model, [], []
    for n in (3, 40, 17, 300):  # KV caches of different lengths, one past a KV block
        ids = [(7 * n + 13 * j) % 5000 + 1000 for j in range(n)]
        for caches_list in (rows, alone):
            caches = model.make_caches()
            logits, _ = prefill(model, caches, ids, 0)
            caches_list.append((caches, mx.argmax(logits).item()))
    for _ in range(3):  # three steps: the stacked states are split back and restacked
        batched = forward(model, [Row(c, [t]) for c, t in rows])
        singles = [forward(model, [Row(c, [t])])[0] for c, t in alone]
        nxt = []
        for (lb, mark), (ls, _), (c, _) in zip(batched, singles, rows):
            assert lb.shape == ls.shape == (1, model.arch.vocab_size)
            assert mx.abs(lb - ls).max().item() < 1e-4
            assert mark.end == mark.start + 1 == c[0].offset
            nxt.append(mx.argmax(ls[0]).item())
        rows = [(c, t) for (c, _), t in zip(rows, nxt)]
        alone = [(c, t) for (c, _), t in zip(alone, nxt)]


# ----- concurrent requests -----------------------------------------------------------------


def test_concurrent_requests_batch_and_answer_as_alone(eng):
    before = eng.batch_stats
    held = Held(eng)
    requests = [
        Request(eng, messages(0)),
        Request(eng, messages(1), max_tokens=2),  # leaves early
        Request(eng, messages(2, turns=3)[:-1] + [{"role": "user", "content": QUESTIONS[4] * 30}]),
        Request(eng, messages(3), logprobs=True, top_logprobs=3),
    ]
    held.release()
    turns = [r.turn() for r in requests]
    check_alone(eng, turns[0])
    check_alone(eng, turns[1], max_tokens=2)
    check_alone(eng, turns[2])
    check_alone(eng, turns[3])
    after = eng.batch_stats
    assert after["widest"] >= 3  # rows really shared steps
    assert after["rows"] - before["rows"] > after["steps"] - before["steps"]

    other = engine.load("tiny", max_batch=1)  # the same requests one after another
    for request, turn in zip(requests, turns):
        alone = Request(other, request.prepared.request.messages,
                        **_options(request)).turn()  # fmt: skip
        assert alone.token_ids == turn.token_ids
        if turn.logprobs:
            for a, b in zip(alone.logprobs, turn.logprobs, strict=True):
                assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
    assert other.batch_stats["widest"] <= 1


def _options(request: Request) -> dict:
    r = request.prepared.request
    out = {"max_tokens": request.prepared.max_tokens}
    if r.logprobs:
        out.update(logprobs=True, top_logprobs=r.top_logprobs)
    return out


def test_rows_join_a_running_batch_and_a_cancelled_row_disturbs_no_other(eng):
    joined = []

    def join_at_third(request):
        # On the model thread, while this row decodes: the new rows start at the next round.
        if sum(e[0] == "delta" for e in request.events) == 3 and not joined:
            joined.append(Request(eng, messages(5), max_tokens=8))
            joined.append(Request(eng, messages(6), on_token=cancel_at_second, max_tokens=8))

    def cancel_at_second(request):
        if sum(e[0] == "delta" for e in request.events) == 2:
            request.job.cancel()

    held = Held(eng)
    first = Request(eng, messages(4), on_token=join_at_third, max_tokens=12)
    held.release()
    check_alone(eng, first.turn(), max_tokens=12)
    check_alone(eng, joined[0].turn(), max_tokens=8)
    assert joined[1].done.wait(120) and joined[1].events[-1][0] == "error"
    assert joined[1].events[-1][1].status == 499
    # The cancelled conversation's sequence is valid: the same request again answers as alone.
    check_alone(eng, Request(eng, messages(6), max_tokens=8).turn(), max_tokens=8)


def test_concurrent_conversations_reuse_their_caches_as_one_client_does(eng):
    """Three conversations of three turns each, all turns of a round at once, against the
    same conversations run one after another: the same answers and the same reuse."""
    other = engine.load("tiny", max_batch=1)
    histories = {e: [messages(i + 10)[:1] for i in range(3)] for e in ("batched", "alone")}
    for t in range(3):
        for e in histories:
            for i, h in enumerate(histories[e]):
                h.append({"role": "user", "content": QUESTIONS[(3 * i + t) % len(QUESTIONS)]})
        held = Held(eng)
        batched = [Request(eng, list(h)) for h in histories["batched"]]
        held.release()
        turns = [r.turn() for r in batched]
        alone = [Request(other, list(h)).turn() for h in histories["alone"]]
        for i, (b, a) in enumerate(zip(turns, alone)):
            assert b.token_ids == a.token_ids
            assert b.stats.reused_tokens == a.stats.reused_tokens
            if t:
                assert b.stats.reused_tokens > 0  # each conversation kept its own cache
            for e, turn in (("batched", b), ("alone", a)):
                histories[e][i].append({"role": "assistant", "content": turn.text})
