"""Continuous batching: concurrent generations decode together, each exactly as alone.

References: a fresh full prefill and greedy decode of each request's prompt ids
(`fresh_greedy`), the same requests run one after another on another engine (answers, logprobs,
reuse counts), and the batch's own counters to show the rows really shared steps.

To make rows overlap without timing, the model thread is held by a job that waits on an event
while the requests queue behind it; released, they all start in one round.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers import CALL, QUESTIONS, RESULT, TOOLS, fresh_greedy

import engine
from engine.runtime.batch import DEFAULT_PASS_TOKENS, PATIENCE, Batch, _Arrival, _Ticket
from engine.runtime.cache import KVCache
from engine.runtime.generate import prefill
from engine.runtime.model import Attention, GatedDeltaNet
from engine.runtime.step import Row, cut, forward
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


def run_together(eng, ask, n: int) -> None:
    """`ask(i)` for i < n, each on its own thread; their requests queue behind the held model
    thread and start in one round. Returns when every call has."""
    held = Held(eng)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while eng.worker.queued() < n:  # all wait behind the held thread
        assert time.monotonic() < deadline, "the requests never reached the model thread"
        time.sleep(0.01)
    held.release()
    for t in threads:
        t.join(180)


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


def test_a_batched_step_hands_the_fused_kernel_each_rows_own_state(monkeypatch):
    """On this CPU (the native module is built) every Gated DeltaNet layer of a batched step
    runs the fused update once, over the rows' states as they are: nothing stacked."""
    import kernels.delta_rule as dr

    calls, fused = [], dr._fused
    monkeypatch.setattr(dr, "_fused", lambda *a: calls.append(len(a[5])) or fused(*a))
    eng = engine.load("tiny")  # its own engine: the layers' steps are traced afresh here
    model, rows = eng.model, []
    for n in (5, 9, 2):
        caches = model.make_caches()
        logits, _ = prefill(model, caches, [1000 + 3 * j + n for j in range(n)], 0)
        rows.append((caches, mx.argmax(logits).item()))
    calls.clear()
    forward(model, [Row(c, [t]) for c, t in rows])
    linear = sum(layer.is_linear for layer in model.layers)
    assert calls == [3] * linear  # one call per layer, three states in each


def _ids(n: int, seed: int) -> list[int]:
    return [(31 * seed + 7 * j) % 3000 + 100 for j in range(n)]


def test_a_packed_step_of_prefill_chunks_and_decode_rows_equals_each_row_alone(eng, monkeypatch):
    """Rows of any length in one pass (`model.packed`): a fresh prefill with snapshots inside
    it, a short one, a decode step, a chunk without logits. Reference: each row alone."""
    model = eng.model
    packed, alone = [model.make_caches() for _ in range(5)], [model.make_caches() for _ in range(5)]
    for caches in (packed, alone):
        prefill(model, caches[2], _ids(50, 3), 0)
        prefill(model, caches[3], _ids(20, 4), 0)
        prefill(model, caches[4], _ids(9, 6), 0)

    def rows(c):  # (the two one-token rows go through the decode step's math together)
        return [Row(c[0], _ids(30, 1), logits=2, keep=[5, 17]), Row(c[1], _ids(7, 2)),
                Row(c[2], [11]), Row(c[3], _ids(64, 5), logits=0, keep=[1]),
                Row(c[4], [12])]  # fmt: skip

    grouped, real = [], GatedDeltaNet._rows_compiled
    monkeypatch.setattr(GatedDeltaNet, "_rows_compiled", lambda m: grouped.append(m) or real(m))
    attended, attend_rows = [], Attention.attend_rows
    monkeypatch.setattr(Attention, "attend_rows", lambda m, q, k, v, caches: attended.append(
        len(caches)) or attend_rows(m, q, k, v, caches))  # fmt: skip
    together = forward(model, rows(packed))
    assert len(grouped) == sum(layer.is_linear for layer in model.layers)
    assert attended.count(2) == sum(not layer.is_linear for layer in model.layers)
    singles = [forward(model, [row])[0] for row in rows(alone)]
    for (lp, mp), (ls, ms), want in zip(together, singles, (2, 1, 1, 0, 1)):
        if want:
            assert lp.shape == ls.shape == (want, model.arch.vocab_size)
            assert mx.abs(lp - ls).max().item() < 1e-4
        else:
            assert lp is None and ls is None
        assert (mp.start, mp.end) == (ms.start, ms.end) and sorted(mp.kept) == sorted(ms.kept)
        for pos in mp.kept:
            for a, b in zip(mp.kept[pos], ms.kept[pos]):
                if a is not None:  # Gated DeltaNet layers: conv tail and state
                    assert all(mx.abs(x - y).max().item() < 1e-4 for x, y in zip(a[:2], b[:2]))
    for cp, ca in zip(packed, alone):  # and the rows go on from the same place
        assert [c.offset for c in cp] == [c.offset for c in ca]
        ((lp, _),) = forward(model, [Row(cp, [42])])
        ((la, _),) = forward(model, [Row(ca, [42])])
        assert mx.abs(lp - la).max().item() < 1e-4


def _live(caches) -> list[np.ndarray]:
    """What a row's caches hold up to their offset (a KV buffer's tail past it is garbage)."""
    return [np.array(a) for c in caches
            for a in (c.state if isinstance(c, KVCache) else (c.conv, c.state))]  # fmt: skip


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "row-by-row"])
def test_a_failed_pass_leaves_every_row_where_it_was(eng, monkeypatch, packed):
    """The pass fails in its last layer: packed, or row by row (a model without packed passes,
    as a pipeline's) where the first row has already run whole when the second fails. Every
    row's caches are back at the step's start, with nothing left to capture."""
    model = eng.model
    rows = [model.make_caches(), model.make_caches()]
    prefill(model, rows[1], _ids(9, 6), 0)
    before = _live(rows[1])
    last, calls = model.layers[-1], []

    def broken(*args):
        calls.append(args)
        if packed or len(calls) == 2:
            raise RuntimeError("broken layer")
        return type(last).packed(last, *args)

    if not packed:
        monkeypatch.delattr(type(model), "packed")
    monkeypatch.setattr(last, "packed", broken)
    with pytest.raises(RuntimeError, match="broken layer"):
        forward(model, [Row(rows[0], _ids(12, 7), keep=[4]), Row(rows[1], _ids(3, 8))])
    monkeypatch.undo()
    assert len(calls) == (1 if packed else 2)
    assert [c.offset for c in rows[0]] == [0] * len(rows[0])
    assert [c.offset for c in rows[1]] == [9] * len(rows[1])
    assert all((a == b).all() for a, b in zip(_live(rows[1]), before, strict=True))
    assert all(not c.capture for row in rows for c in row if hasattr(c, "capture"))


def test_concurrent_prefills_run_packed_in_shared_passes(eng, monkeypatch):
    """Requests that arrive together prefill in the same passes (their chunks packed), not
    one after another; each still answers as alone."""
    spans, packed = [], type(eng.model).packed
    monkeypatch.setattr(type(eng.model), "packed",
                        lambda self, ids, s, c: spans.append(list(s)) or packed(self, ids, s, c))  # fmt: skip
    held = Held(eng)
    requests = [Request(eng, messages(60 + i)) for i in range(3)]
    held.release()
    turns = [r.turn() for r in requests]
    monkeypatch.undo()
    assert any(sum(e - s > 1 for s, e in step) >= 2 for step in spans)  # prefills shared a pass
    for turn in turns:
        check_alone(eng, turn)


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


def test_seeded_sampled_rows_pick_together_and_draw_as_alone(eng, monkeypatch):
    """Sampled requests (seeded, Qwen's cuts, one with a penalty, one with a logit bias, one
    greedy beside them):
    their rows' picks are made in one draw per step, and each answer is the one the same
    request gets alone: a row's uniforms come from its own seed, whatever rows share the
    draw."""
    import engine.runtime.sampling as sampling

    widest = []
    real = sampling._picks
    monkeypatch.setattr(sampling, "_picks", lambda x, s: widest.append(len(s)) or real(x, s))
    cuts = {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "max_tokens": 12}
    options = [{**cuts, "seed": 1}, {**cuts, "seed": 2, "presence_penalty": 1.5},
               {**cuts, "seed": 3, "logit_bias": {"7": 6.0, "11": -100}}, {"max_tokens": 12}]  # fmt: skip
    held = Held(eng)
    requests = [Request(eng, messages(50 + i), **o) for i, o in enumerate(options)]
    held.release()
    turns = [r.turn() for r in requests]
    assert max(widest) == 3  # the three sampled rows in one draw
    check_alone(eng, turns[3], max_tokens=12)
    other = engine.load("tiny", max_batch=1)
    for i, o in enumerate(options):
        assert Request(other, messages(50 + i), **o).turn().token_ids == turns[i].token_ids
    assert len({tuple(t.token_ids) for t in turns}) == 4


def test_rows_that_hand_over_different_items_per_token_still_share_every_step(eng):
    # One request with logprobs (two items for most tokens: logprobs, text) and one without
    # (one item, or none for a token that completes no text): their rows must still meet in
    # every step. Each task's turn used to end at its first item, which left one a turn
    # behind the other for good: the two rows then stepped alone, in turns.
    before = eng.batch_stats
    held = Held(eng)
    requests = [Request(eng, messages(42), max_tokens=24, logprobs=True, top_logprobs=2),
                Request(eng, messages(43), max_tokens=24)]  # fmt: skip
    held.release()
    turns = [r.turn() for r in requests]
    assert [len(t.token_ids) for t in turns] == [24, 24]  # both run to max_tokens
    steps = eng.batch_stats["steps"] - before["steps"]
    rows = eng.batch_stats["rows"] - before["rows"]
    assert steps > 0 and rows == 2 * steps  # every step carried both rows


def test_concurrent_engine_chats_from_threads_share_steps(eng, monkeypatch):
    # `Engine.chat` consumes its generation one item at a time from its own thread; a step
    # waits (up to worker.GATHER_S) for those consumers to ask for their next item, so their
    # rows join it. The wait is made long here so the test does not depend on timing.
    monkeypatch.setattr("engine.runtime.worker.GATHER_S", 60.0)
    results: dict[int, object] = {}

    def ask(i):
        results[i] = eng.chat(messages(40 + i), max_tokens=24, temperature=0)

    before = eng.batch_stats
    run_together(eng, ask, 2)
    assert [len(results[i].token_ids) for i in range(2)] == [24, 24]
    steps = eng.batch_stats["steps"] - before["steps"]
    rows = eng.batch_stats["rows"] - before["rows"]
    assert steps > 0 and rows == 2 * steps
    for i in range(2):
        check_alone(eng, results[i], max_tokens=24)


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


class _Offset:
    offset = 5


def _waiting(batch: Batch, rows: list[tuple]) -> dict[int, str]:
    """File rows by (name, tokens, arrival[, prompt tokens left]): arrival None is a decode
    row, else a prefill chunk of the request that came at that arrival (its whole prompt,
    unless `left` says more is to come). Returns the names by ticket id."""
    names = {}
    for name, n, since, *left in rows:
        row = Row([_Offset()], list(range(n)), partial=since is not None, left=(left or [n])[0])
        ticket = _Ticket(row, _Arrival(since or 0))
        batch._waiting.append(ticket)
        names[id(ticket)] = name
    return names


def test_a_pass_takes_the_decode_rows_then_the_shortest_prompts_cut_to_the_budget():
    batch = Batch(model=None, max_rows=8, pass_tokens=100)
    names = _waiting(batch, [("p1", 80, 2, 500), ("d1", 1, None), ("p0", 60, 1, 500),
                             ("d2", 1, None), ("p2", 50, 3, 900)])  # fmt: skip
    taken = batch._take()  # as long a prompt left: the older first
    assert [(names[id(t)], t.row.size) for t in taken] == [("d1", 1), ("d2", 1), ("p0", 60),
                                                           ("p1", 38)]  # fmt: skip
    assert taken[3].row.logits == 0 and taken[3].row.tokens == list(range(38))
    assert [names[id(t)] for t in batch._waiting] == ["p2"]  # 0 tokens left: waits

    batch = Batch(model=None, max_rows=8, pass_tokens=64)  # a short prompt after a long one
    names = _waiting(batch, [("long", 64, 1, 5000), ("short", 40, 2)])
    assert [names[id(t)] for t in batch._take()] == ["short"]  # 24 left: under MIN_CUT
    for i in range(PATIENCE - 1):  # short ones keep coming: the long one waits...
        names |= _waiting(batch, [(f"short{i}", 40, 3 + i)])
        assert [names[id(t)] for t in batch._take()] == [f"short{i}"]
    names |= _waiting(batch, [("short9", 40, 99)])  # ...PATIENCE passes, then goes first
    assert [(names[id(t)], t.row.size) for t in batch._take()] == [("long", 64)]
    assert [names[id(t)] for t in batch._take()] == ["short9"]

    batch = Batch(model=None, max_rows=8, pass_tokens=60)  # 30 left: under MIN_CUT, p1 waits
    names = _waiting(batch, [("d1", 1, None), ("p0", 29, 1), ("p1", 40, 2)])
    assert [names[id(t)] for t in batch._take()] == ["d1", "p0"]
    batch = Batch(model=None, max_rows=8, pass_tokens=60)  # but a chunk under it fits
    names = _waiting(batch, [("d1", 1, None), ("p0", 29, 1), ("p1", 20, 2, 100)])
    assert [names[id(t)] for t in batch._take()] == ["d1", "p0", "p1"]

    batch = Batch(model=None, max_rows=8, pass_tokens=4)  # decoders over budget: prefill
    names = _waiting(batch, [("p0", 50, 1)] + [(f"d{i}", 1, None) for i in range(6)])
    assert [t.row.size for t in batch._take()] == [1] * 6 + [4]  # still progresses
    batch = Batch(model=None, max_rows=2, pass_tokens=100)  # and max_rows bounds the rows
    names = _waiting(batch, [("p0", 50, 1)] + [(f"d{i}", 1, None) for i in range(3)])
    assert [names[id(t)] for t in batch._take()] == ["d0", "d1"]
    with pytest.raises(ValueError, match="whole row"):
        cut(Row([_Offset()], [1, 2, 3]), 2)


@pytest.mark.parametrize("bad", [0, -5, True, 2.5, "8", None])
def test_bad_batch_settings_are_refused_by_name_and_change_nothing(eng, bad):
    before = (eng.max_batch, eng.pass_tokens)
    with pytest.raises(ValueError, match="max_batch"):
        eng.set_max_batch(bad)
    with pytest.raises(ValueError, match="pass_tokens"):
        eng.set_pass_tokens(bad)
    assert (eng.max_batch, eng.pass_tokens) == before
    assert (eng.worker.batch.max_rows, eng.worker.batch.pass_tokens) == before


def test_a_prompt_beside_decoding_rows_is_cut_to_the_pass_budget(eng, monkeypatch):
    """Two long prompts arrive while two rows decode. Every pass holds at most `pass_tokens`
    tokens, so the prompts go in cut chunks (the stall of the decoding rows is one short pass),
    the decoding rows are in the passes that prefill, and the prompt with less left to
    prefill goes first (the older of two as long). All
    answer as alone, and the next turn reuses the snapshots taken inside cut chunks as a
    conversation played alone does."""
    budget, passes, take = 40, [], Batch._take
    monkeypatch.setattr(Batch, "_take", lambda self: passes.append(take(self)) or passes[-1])
    firsts, long = [], []

    def note_first(request):
        if sum(e[0] == "delta" for e in request.events) == 1:
            firsts.append(long.index(request))

    def arrive_at_third(request):
        if sum(e[0] == "delta" for e in request.events) == 3 and not long:
            long.extend(Request(eng, _long_chat(i), on_token=note_first) for i in range(2))

    eng.set_pass_tokens(budget)
    try:
        held = Held(eng)
        decoding = [Request(eng, messages(20), on_token=arrive_at_third, max_tokens=24),
                    Request(eng, messages(21), max_tokens=24)]  # fmt: skip
        held.release()
        turns = [r.turn() for r in decoding]
        turns += [r.turn() for r in long]  # (arrived at the third token)
        monkeypatch.undo()
        follow = _long_chat(0) + [{"role": "assistant", "content": turns[2].text},
                                  {"role": "user", "content": "And then?"}]  # fmt: skip
        after = Request(eng, follow).turn()
    finally:
        eng.set_pass_tokens(DEFAULT_PASS_TOKENS)
    for turn, n in zip(turns, (24, 24, MAX_TOKENS, MAX_TOKENS)):
        check_alone(eng, turn, max_tokens=n)
    assert min(len(t.prompt_ids) for t in turns[2:]) > 2 * budget  # so the chunks were cut
    assert all(sum(t.row.size for t in p) <= budget for p in passes)
    mixed = [
        p for p in passes if any(t.row.partial for t in p) and any(not t.row.partial for t in p)
    ]
    assert max(sum(not t.row.partial for t in p) for p in mixed) >= 2
    assert firsts == sorted(range(2), key=lambda i: (len(turns[2 + i].prompt_ids), i))

    other = engine.load("tiny", max_batch=1)  # the same two turns alone
    alone = [Request(other, _long_chat(0)).turn()]
    follow[-2]["content"] = alone[0].text
    again = Request(other, follow).turn()
    assert alone[0].token_ids == turns[2].token_ids and again.token_ids == after.token_ids
    assert after.stats.reused_tokens == again.stats.reused_tokens > 2 * budget


def _long_chat(i: int) -> list[dict]:
    return [{"role": "system", "content": f"You are assistant number {i}. " + "Keep to the facts "
             "and remember every colour the user names. " * 8},
            {"role": "user", "content": QUESTIONS[i]}]  # fmt: skip


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


VARIANTS = {  # Engine.chat options per conversation; "window" trims from its second turn on
    "window": {"max_exchanges": 1},  # the last exchange and the new one: trims at turn 3
    "tools": {"tools": TOOLS},
    "thinking": {"enable_thinking": True},
    "stop": {"stop": ["e", "a", "o"]},
}


def test_trimming_tool_thinking_and_stop_turns_batch_and_answer_as_alone(eng, monkeypatch):
    """Four conversations of three turns, each turn of a round at once through `Engine.chat`
    from threads: one whose window keeps one earlier exchange (its third turn drops the
    first, so its prefix changes and its cache restarts from a snapshot), one with tools and
    a tool call in its history, one
    thinking, one with stop strings. Reference: the same turns on an engine that runs one
    request at a time; equal answers and equal reuse."""
    monkeypatch.setattr("engine.runtime.worker.GATHER_S", 60.0)  # (see the test above)
    other = engine.load("tiny", max_batch=1)
    names = list(VARIANTS)
    chats = {e: {v: [{"role": "system", "content": f"Assistant {v}."}] for v in names}
             for e in ("batched", "alone")}  # fmt: skip
    before = eng.batch_stats
    for t in range(3):
        for e in chats:
            for i, v in enumerate(names):
                user = {"role": "user", "content": QUESTIONS[(2 * i + t) % len(QUESTIONS)]}
                chats[e][v].append(user)
                if v == "tools" and t == 1:  # the client's history says the model called
                    chats[e][v] += [CALL, {"role": "tool", "content": RESULT}]
        turns: dict[str, object] = {}

        def ask(i, turns=turns):
            v = names[i]
            turns[v] = eng.chat(chats["batched"][v], max_tokens=8, warm=False, **VARIANTS[v])

        run_together(eng, ask, len(names))
        for v in names:
            alone = other.chat(chats["alone"][v], max_tokens=8, warm=False, **VARIANTS[v])
            assert turns[v].prompt_ids == alone.prompt_ids, v
            assert turns[v].token_ids == alone.token_ids, v
            assert turns[v].text == alone.text and turns[v].finish_reason == alone.finish_reason
            assert turns[v].stats.reused_tokens == alone.stats.reused_tokens, v
            for e, turn in (("batched", turns[v]), ("alone", alone)):
                chats[e][v].append(turn.message())
        assert turns["window"].stats.dropped_exchanges == max(0, t - 1)  # (1 + the new one)
        assert not any(c in turns["stop"].text for c in "eao")
    steps = eng.batch_stats["steps"] - before["steps"]
    assert eng.batch_stats["rows"] - before["rows"] > steps  # the rows shared passes


def test_concurrent_clients_of_the_server_batch_and_answer_as_alone(eng):
    """The official openai client, four streams at once against the real server."""

    openai = pytest.importorskip("openai", reason="the openai client: pip install -e '.[dev]'")

    from engine.serving.server import BackgroundServer, ServerConfig

    with BackgroundServer(eng, ServerConfig(port=0, warm=False)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)  # fmt: skip
        results: dict[int, tuple] = {}

        def ask(i):
            stream = client.chat.completions.create(
                model="tiny", messages=messages(20 + i), max_tokens=MAX_TOKENS, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            text, usage = [], None
            for chunk in stream:
                usage = chunk.usage or usage
                text += [c.delta.content for c in chunk.choices if c.delta.content]
            results[i] = ("".join(text), usage)

        before = eng.batch_stats
        run_together(eng, ask, 4)
        assert eng.batch_stats["widest"] >= 2 and eng.batch_stats["steps"] > before["steps"]
        together = dict(results)
        for i in range(4):  # the same requests again, one at a time
            ask(i)
            assert results[i][0] == together[i][0]
            prompt = eng.stateless.prepare(parse_request({"messages": messages(20 + i)})).prompt
            expected, _ = fresh_greedy(eng, prompt.ids, MAX_TOKENS)
            assert together[i][1].completion_tokens == len(expected)


def test_a_failed_batched_step_is_retried_row_by_row_and_fails_only_its_row(eng, monkeypatch):
    model_type = type(eng.model)
    real_rows, real_hidden = model_type.decode_rows, model_type.hidden
    calls = {"rows": 0}

    def failing_rows(self, ids, caches):  # the batched pass dies half-way, once
        calls["rows"] += 1
        if calls["rows"] == 2:
            self.layers[0].decode_rows(self.embed_tokens(ids)[:, None], [c[0] for c in caches])
            raise RuntimeError("injected batch failure")
        return real_rows(self, ids, caches)

    doomed = {}

    def hidden(self, ids, caches):  # and one row fails on its own in the retry
        if caches is doomed.get("caches"):
            raise RuntimeError("injected row failure")
        return real_hidden(self, ids, caches)

    def doom(request):
        if sum(e[0] == "delta" for e in request.events) == 1 and not doomed:
            seq = eng.stateless.pool.sequences
            doomed["caches"] = next(s.caches for s in seq if s.busy and s.tokens[-1:] and
                                    s.filling == request.prepared.prompt.ids)  # fmt: skip

    monkeypatch.setattr(model_type, "decode_rows", failing_rows)
    monkeypatch.setattr(model_type, "hidden", hidden)
    held = Held(eng)
    survivors = [Request(eng, messages(30 + i)) for i in range(2)]
    victim = Request(eng, messages(32), on_token=doom)
    held.release()
    for request in survivors:
        check_alone(eng, request.turn())
    assert victim.done.wait(120) and victim.events[-1][0] == "error"
    assert "injected row failure" in str(victim.events[-1][1].message)
    monkeypatch.undo()
    # The failed row's sequence rolled back: the same request now answers as alone.
    check_alone(eng, Request(eng, messages(32)).turn())


def test_raising_max_batch_starts_a_waiting_generation_at_once():
    """max_batch 1: a second chat waits for the first, whose consumer holds its stream open
    without asking for more. Raising max_batch must start the second now, not when the
    first's consumer next asks (the model thread slept with nothing to wake it)."""
    eng = engine.load("tiny", max_batch=1)
    try:
        first = eng.chat_stream(messages(40), max_tokens=MAX_TOKENS, warm=False)
        next(first)  # open, its consumer away
        got = []
        second = threading.Thread(
            target=lambda: got.append(eng.chat(messages(41), max_tokens=MAX_TOKENS, warm=False))
        )
        second.start()
        deadline = time.monotonic() + 60
        while len(eng.worker._waiting) < 1:  # taken in, it waits behind the first
            assert time.monotonic() < deadline, "the second chat never reached the model thread"
            time.sleep(0.01)
        eng.set_max_batch(2)
        second.join(30)
        assert not second.is_alive(), "the second chat did not start when max_batch rose"
        check_alone(eng, got[0])
        first.close()
        check_alone(eng, eng.chat(messages(40), max_tokens=MAX_TOKENS, warm=False))
    finally:
        eng.close()


def test_batch_settings_change_on_a_closed_engine_and_hold_for_its_next_thread():
    """close() drops the model thread but keeps the batch: setting pass_tokens then raised
    AttributeError (it woke a thread that was gone), half-way through the change."""
    eng = engine.load("tiny", max_batch=4)
    try:
        assert eng.worker.alive
        eng.close()
        eng.set_max_batch(2)
        eng.set_pass_tokens(64)
        worker = eng.worker  # a new thread
        assert (worker.max_tasks, worker.batch.max_rows, worker.batch.pass_tokens) == (2, 2, 64)
        check_alone(eng, eng.chat(messages(42), max_tokens=MAX_TOKENS, warm=False))
    finally:
        eng.close()
