"""The engine's one model-owner thread: every MLX computation runs there, whoever asks.

References: a session used alone on the main thread (for answers), and thread counts taken
before the work (for leaks).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
from helpers import QUESTIONS, fresh_greedy

import engine
from engine.runtime.worker import Job, ModelThread, WorkerStopped

MAX_TOKENS = 4


def os_threads() -> int:
    """Threads of this process as the OS sees them (MLX stream threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's count is the best there is
        return threading.active_count()


# ----- the thread itself (no model) ---------------------------------------------------------


def test_call_returns_values_and_reraises_errors_on_the_caller():
    worker = ModelThread(threading.RLock())
    try:
        assert worker.call(lambda: threading.current_thread().name) == "chatml-model"
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda: 1 / 0)
        assert worker.call(lambda: 2 + 2) == 4  # an error does not kill the thread
    finally:
        worker.stop()


class Rows:
    """A stand-in for `batch.Batch`: a task files its name as its row; `step` serves the
    rows filed and records them."""

    def __init__(self):
        self.filed, self.steps = [], []

    @property
    def pending(self) -> bool:
        return bool(self.filed)

    def step(self) -> None:
        self.steps.append(sorted(self.filed))
        self.filed.clear()

    def run(self, name: str, n: int, *, tokens: bool = True, slow_turn=lambda: None):
        """n steps, its row filed for each and WAIT until a step served it; a decoder yields
        a token after each, a prefill (`tokens=False`) only at its end."""
        from engine.runtime.batch import WAIT

        for i in range(n):
            self.filed.append(name)
            while name in self.filed:
                yield WAIT
            slow_turn()
            if tokens:
                yield i
        if not tokens:
            yield n


def test_a_consumer_that_asked_during_a_slow_turn_still_joins_the_next_step(monkeypatch):
    """Decoders A and B beside a prefill C, whose row is always waiting. A's consumer asks
    for its next token while B's turn runs long (a turn may wait for the last pass to finish
    computing), so A is ready, not waiting, when the next pass is gathered: its row must
    join that pass all the same, not wait a whole one (A's and B's rows then took turns,
    each in every other pass of C's prefill)."""
    # The gather waits GATHER_S (2 ms) for consumers to ask: on a loaded machine B's could miss
    # a pass. The test is about A, which has asked: wait as long as B's takes.
    monkeypatch.setattr("engine.runtime.worker.GATHER_S", 60.0)
    rows = Rows()
    worker = ModelThread(threading.RLock(), batch=rows)
    try:

        def after_a_asked():  # on the model thread, in B's turn: wait until A's consumer asked
            for a in [t for t in worker._tasks if t.make is make_a]:
                assert a.ready.__self__.asked.wait(30), "A's consumer never asked"

        def make_a():
            return rows.run("a", 6)

        go, holding = threading.Event(), threading.Event()
        worker.submit(Job(lambda job: (holding.set(), go.wait(60))))
        assert holding.wait(60)
        makes = [make_a, lambda: rows.run("b", 6, slow_turn=after_a_asked),
                 lambda: rows.run("c", 8, tokens=False)]  # fmt: skip
        results = [[] for _ in makes]
        threads = [threading.Thread(target=lambda m=m, r=r: r.extend(worker.iterate(m)))
                   for m, r in zip(makes, results)]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while worker.queued() < len(makes):  # all three start in one round
            assert time.monotonic() < deadline, "the streams never reached the model thread"
            time.sleep(0.01)
        go.set()
        for t in threads:
            t.join(60)
        assert results == [list(range(6)), list(range(6)), [8]]
        assert rows.steps == [["a", "b", "c"]] * 6 + [["c"]] * 2
    finally:
        worker.stop()


def test_closing_a_stream_runs_its_cleanup_there_before_returning():
    worker = ModelThread(threading.RLock())
    log = []

    def gen():
        try:
            for i in range(100):
                log.append(("step", i, threading.current_thread().name))
                yield i
            return "end"
        finally:
            log.append(("cleanup", threading.current_thread().name))

    try:
        stream = worker.iterate(gen)
        assert [next(stream), next(stream)] == [0, 1]
        stream.close()
        # The generator ran only as far as the consumer asked, and its cleanup is done.
        assert log[-1] == ("cleanup", "chatml-model") and len(log) == 3
        assert all(entry[-1] == "chatml-model" for entry in log)
        whole = worker.iterate(lambda: (x for x in [1, 2]))
        assert list(whole) == [1, 2]
    finally:
        worker.stop()


def test_other_work_from_a_thread_with_an_open_stream_is_refused_not_deadlocked():
    worker = ModelThread(threading.RLock())
    try:
        stream = worker.iterate(lambda: iter(range(3)))
        next(stream)
        with pytest.raises(RuntimeError, match="unfinished stream"):
            worker.call(lambda: 1)
        assert list(stream) == [1, 2]
        assert worker.call(lambda: 1) == 1  # free again once the stream is done
    finally:
        worker.stop()


def test_background_job_yields_to_queued_work_and_stopped_jobs_fail_clearly():
    worker = ModelThread(threading.RLock())
    started, checks = threading.Event(), []

    def background(job):
        started.set()
        while not worker.should_yield():  # idle-time work: stops when anything else queues
            checks.append(1)
            started.wait(0.001)
        return "yielded"

    bg = worker.submit(Job(background, background=True))
    assert started.wait(30)
    assert worker.call(lambda: "foreground") == "foreground"
    assert bg.wait(30) and bg.outcome() == "yielded"
    worker.stop()
    with pytest.raises(WorkerStopped):
        worker.call(lambda: 1)


def test_a_spawned_task_whose_end_callback_fails_ends_alone():
    """`spawn`'s on_end runs on the model thread: one that raises ends its own task only (it
    used to end the model thread, and every job and stream after it waited forever)."""
    worker = ModelThread(threading.RLock())
    ended = threading.Event()

    def on_end(kind, value):
        ended.set()
        raise RuntimeError("the callback failed")

    try:
        job = worker.spawn(lambda: iter(range(2)), lambda item: None, on_end)
        assert job.wait(30) and ended.is_set()
        assert job.outcome() is None  # the generator itself returned
        probe = worker.submit(Job(lambda job: 2 + 2))
        assert probe.wait(30), "the model thread died with the callback"
        assert probe.outcome() == 4
        stream = worker.iterate(lambda: iter(range(3)))
        assert list(stream) == [0, 1, 2]
        # Queued behind a stop, its failing callback keeps no other job from hearing so.
        go, holding = threading.Event(), threading.Event()
        worker.submit(Job(lambda job: (holding.set(), go.wait(30))))
        assert holding.wait(30)
        ended.clear()
        worker.spawn(lambda: iter(range(2)), lambda item: None, on_end)
        behind = worker.submit(Job(lambda job: 1))
        worker.stop(timeout=0)
        go.set()
        assert behind.wait(30) and ended.is_set()
        with pytest.raises(WorkerStopped):
            behind.outcome()
    finally:
        worker.stop()


def test_a_job_submitted_as_the_thread_stops_is_told_not_lost():
    """A submit that passed its check as another thread stopped the worker put its job in
    the queue after the stopped thread's last look: nobody ever ran or dropped it, and its
    caller (an `Engine.chat` beside `Engine.close`) waited forever."""
    worker = ModelThread(threading.RLock())
    real_put = worker.jobs.put

    def put(job):  # the stop lands between submit's check and its put
        if job is not None:
            worker.stop(timeout=0)
            worker._thread.join(2)
        real_put(job)

    worker.jobs.put = put
    try:
        job = worker.submit(Job(lambda job: 1))
    except WorkerStopped:
        return  # refused at once: as good
    finally:
        worker.stop()
    assert job.wait(30), "the job was lost in the stopped thread's queue"
    with pytest.raises(WorkerStopped):
        job.outcome()


def test_a_job_cancelled_before_it_started_never_runs():
    """`Job.cancel` on a job still queued (what `run` does when Ctrl+C reaches its caller):
    the job is skipped, as its docstring says; it used to run anyway, after its caller had
    given up on it."""
    worker = ModelThread(threading.RLock())
    go, holding, ran = threading.Event(), threading.Event(), []
    try:
        worker.submit(Job(lambda job: (holding.set(), go.wait(30))))
        assert holding.wait(30)
        job = worker.submit(Job(lambda job: ran.append("ran")))
        job.cancel()
        go.set()
        assert job.wait(30) and not job.started
        assert worker.call(lambda: "next") == "next"
        assert ran == []
    finally:
        worker.stop()


# ----- sessions on one engine ---------------------------------------------------------------


def test_fifty_warm_ups_leave_no_thread_behind(tiny):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    s.warm_in_background().wait(60)  # the first one may start MLX's own threads
    s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    python_before, os_before = threading.active_count(), os_threads()
    for i in range(50):
        job = s.warm_in_background()
        if i % 2:
            s.stop_warm()  # cancelled at once or at its next chunk
        else:
            assert job.wait(60)
        s.warm()
    assert threading.active_count() == python_before
    assert os_threads() <= os_before
    turn = s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]


def test_an_engine_its_user_drops_is_collected_and_its_model_thread_ends():
    """Nothing but the user's references keeps an engine: dropped, it is collected and its
    finalizer stops the model thread. The thread's loop had held its last task, whose closure
    held the engine: every `engine.load` in a process kept the one before (3 GB each on the
    0.8B)."""
    eng = engine.load("tiny")
    eng.chat([{"role": "user", "content": QUESTIONS[0]}], max_tokens=MAX_TOKENS)  # warms too
    stream = eng.chat_stream([{"role": "user", "content": QUESTIONS[1]}], max_tokens=MAX_TOKENS)
    next(stream)
    stream.close()  # a stream left early
    s = eng.session("sys")
    s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)
    s.warm_in_background().wait(60)
    thread, gone = eng.worker._thread, weakref.ref(eng)
    del eng, stream, s
    gc.collect()
    assert gone() is None
    thread.join(60)
    assert not thread.is_alive()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_turns_warm_ups_and_saves_from_different_threads(tmp_path, dtype):
    from engine.storage.store import SessionStore

    eng = tiny_engine(dtype)
    store = SessionStore(tmp_path)
    stored = store.open("threads", eng, system="sys")
    s = stored.session
    alone = eng.session("sys")

    def on_thread(fn):
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("v", fn()))
        t.start()
        t.join(120)
        assert not t.is_alive()
        return out["v"]

    for q in QUESTIONS[:3]:
        turn = on_thread(lambda q=q: s.send(q, max_tokens=MAX_TOKENS))  # generate on one
        stored.append_turn(turn)
        assert on_thread(stored.save_state)  # capture for the disk on another
        on_thread(s.warm)  # extend on a third
        assert turn.token_ids == alone.send(q, max_tokens=MAX_TOKENS).token_ids
    stored.close()
    with store.open("threads", eng) as again:
        assert again.state_loaded
        nxt = again.session.send(QUESTIONS[3], max_tokens=MAX_TOKENS)
    assert nxt.token_ids == alone.send(QUESTIONS[3], max_tokens=MAX_TOKENS).token_ids
    assert nxt.stats.reused_tokens > 0


_ENGINES: dict[str, engine.Engine] = {}


def tiny_engine(dtype: str) -> engine.Engine:
    if dtype not in _ENGINES:
        _ENGINES[dtype] = engine.load("tiny", dtype=dtype)
    return _ENGINES[dtype]


def test_sessions_used_from_many_threads_at_once_answer_as_alone(tiny):
    systems = ["A", "B", "C", "D"]
    alone = {}
    for system in systems:
        s = tiny.session(system)
        alone[system] = [s.send(q, max_tokens=MAX_TOKENS).token_ids for q in QUESTIONS[:3]]
    results, errors = {}, []
    barrier = threading.Barrier(len(systems))

    def run(system):
        try:
            s = tiny.session(system)
            barrier.wait(60)
            out = []
            for q in QUESTIONS[:3]:
                *pieces, turn = s.stream(q, max_tokens=MAX_TOKENS)
                assert "".join(pieces).strip() == turn.text
                out.append(turn.token_ids)
                s.warm_in_background()
            s.stop_warm()
            results[system] = out
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(system,)) for system in systems]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results == alone


def test_ctrl_c_while_waiting_for_the_next_piece_leaves_no_trace(tiny, monkeypatch):
    import signal

    from engine.runtime.sampling import Sampler

    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    history, tokens = [list(e) for e in s.history], list(s.tokens)
    main = threading.main_thread().ident

    class Interrupting(Sampler):
        """Sends SIGINT to the main thread from the model thread, mid-answer."""

        calls = 0

        def begin(self, logits, recent):  # every pick, alone or with other rows
            Interrupting.calls += 1
            if Interrupting.calls == 3:
                signal.pthread_kill(main, signal.SIGINT)
            return super().begin(logits, recent)

    monkeypatch.setattr("engine.session.Sampler", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        for _ in s.stream(QUESTIONS[1], max_tokens=40, ignore_eos=True):
            pass
    monkeypatch.undo()
    assert Interrupting.calls >= 3
    # The turn was rolled back on the model thread before the interrupt reached us.
    assert s.history == history
    assert tokens[: len(s.tokens)] == s.tokens
    turn = s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]
