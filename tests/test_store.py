"""engine.storage.store: persistent sessions survive restarts, crashes and damage, and resume exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers import RESULT, TOOLS, fresh_greedy

from engine.storage.session_log import encode_record, read_log
from engine.storage.state_file import SNAPSHOTS_KEPT, read_header
from engine.storage.store import LOG, STATE, SessionBusy, SessionIdError, SessionStore, check_id

QUESTIONS = ["Hi! My order number is 48213.", "What is my order number?", "你好", "Thanks!"]
SYSTEM = "You are a helpful assistant."
MAX = 4  # answer tokens: enough to exercise the caches, cheap on 2 cores


class Warnings(list):
    def __call__(self, message: str) -> None:
        self.append(message)


@pytest.fixture
def store(tmp_path):
    return SessionStore(tmp_path, warn=Warnings())


def _turns(stored, questions):
    out = []
    for q in questions:
        turn = stored.session.send(q, max_tokens=MAX)
        stored.append_turn(turn)
        stored.save_state()
        out.append(turn)
    return out


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """A 3-turn session on disk, the state after its turn 2, and the uninterrupted turn 4."""
    home = tmp_path_factory.mktemp("saved")
    store = SessionStore(home, warn=Warnings())
    with store.open("base", tiny, system=SYSTEM) as s:
        _turns(s, QUESTIONS[:2])
        stale = (s.dir / STATE).read_bytes()
        _turns(s, QUESTIONS[2:3])
        shutil.copytree(s.dir, home / "copy")
        turn4 = s.session.send(QUESTIONS[3], max_tokens=MAX)  # the process goes on: reference
    return SimpleNamespace(dir=home / "copy", stale=stale, turn4=turn4)


def _clone(store, saved, sid: str):
    shutil.copytree(saved.dir, store.path(sid))
    return store.path(sid)


def test_resume_reuses_the_whole_history_and_answers_exactly(tiny, store, saved, first_logits):
    _clone(store, saved, "r1")
    with store.open("r1", tiny) as s:  # system, window, thinking come back from the log
        assert s.state_loaded and s.resumed_turns == 3 and s.session.system == SYSTEM
        turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
    ref = saved.turn4
    # The state read back from disk + the new exchange = a fresh full prefill of the prompt.
    expected, ref_logits = fresh_greedy(tiny, turn.prompt_ids, MAX)
    assert turn.token_ids == expected
    assert mx.abs(first_logits[0] - ref_logits).max().item() < 1e-4
    kept = json.loads(read_header((saved.dir / STATE).read_bytes())["snapshots"])
    assert len(kept) <= 1 + SNAPSHOTS_KEPT  # the file does not grow with every turn
    assert turn.token_ids == ref.token_ids and turn.text == ref.text
    assert turn.prompt_ids == ref.prompt_ids
    # Only the new exchange (and the re-rendered previous answer) is prefilled.
    assert turn.stats.prefilled_tokens == ref.stats.prefilled_tokens
    assert turn.stats.reused_tokens == ref.stats.reused_tokens > turn.stats.prefilled_tokens
    assert not store.warn


def test_background_save_is_on_disk_after_close_and_resumes_exactly(tiny, store, saved):
    with store.open("bg", tiny, system=SYSTEM) as s:
        for q in QUESTIONS[:3]:
            s.append_turn(s.session.send(q, max_tokens=MAX))
            s.save_state(background=True)  # the next turn starts while the file is written
    with store.open("bg", tiny) as s:
        assert s.state_loaded and s.resumed_turns == 3
        turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
    assert turn.token_ids == saved.turn4.token_ids
    assert turn.stats.prefilled_tokens == saved.turn4.stats.prefilled_tokens
    assert not store.warn


def test_a_failed_background_save_warns_and_loses_no_turn(tiny, store, saved, monkeypatch):
    import engine.storage.store

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    with store.open("full", tiny, system=SYSTEM) as s:
        _turns(s, QUESTIONS[:2])
        monkeypatch.setattr(engine.storage.store, "atomic_write", disk_full)
        s.append_turn(s.session.send(QUESTIONS[2], max_tokens=MAX))
        assert s.save_state(background=True)  # returns at once; the write fails later
    monkeypatch.undo()
    assert len(store.warn) == 1 and "No space left" in store.warn[0]
    # The state on disk is turn 2's: stale, so the history is rebuilt from the log.
    with store.open("full", tiny) as s:
        assert s.resumed_turns == 3 and not s.state_loaded
        turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
    assert turn.token_ids == saved.turn4.token_ids


def test_log_records_everything_a_turn_produced(tiny, store):
    with store.open("rec", tiny, system=SYSTEM) as s:
        (turn,) = _turns(s, QUESTIONS[:1])
    log = store.read("rec")
    rec = log.records[-1]
    assert rec["type"] == "turn" and rec["index"] == 0
    assert rec["messages"] == [{"role": "user", "content": QUESTIONS[0]}, turn.message()]
    assert rec["prompt_ids"] == turn.prompt_ids and rec["token_ids"] == turn.token_ids
    assert rec["stats"]["prefilled_tokens"] == turn.stats.prefilled_tokens
    assert isinstance(rec["time"], float) and rec["finish_reason"] == turn.finish_reason
    assert log.options["system"] == SYSTEM and log.options["model"] == "tiny"
    for line in (store.path("rec") / LOG).read_text(encoding="utf-8").splitlines():
        assert set(json.loads(line)) >= {"type", "time", "sum"}  # checksummed JSON lines


def test_missing_state_rebuilds_from_the_log_and_prefills_everything(tiny, store, saved):
    (_clone(store, saved, "nostate") / STATE).unlink()
    with store.open("nostate", tiny) as s:
        assert not s.state_loaded and s.resumed_turns == 3
        turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
    assert turn.stats.prefilled_tokens == turn.stats.prompt_tokens
    assert turn.token_ids == saved.turn4.token_ids  # same answer, just slower


def test_corrupt_and_truncated_log_lines_are_skipped(tiny, store, saved):
    log = _clone(store, saved, "dmg") / LOG
    lines = log.read_bytes().split(b"\n")
    assert len(lines) == 5 and lines[-1] == b""  # header, 3 turns, final newline
    lines[1] = lines[1][: len(lines[1]) // 2] + b"\xff garbage"  # turn 1: unreadable
    # turn 3: valid JSON with an edited answer, caught by the record checksum
    lines[3] = lines[3].replace(b'"role":"user"', b'"role":"user","x":1', 1)
    log.write_bytes(b"\n".join(lines[:-1]) + b"\n" + b'{"type":"turn","n":4,"ind')  # cut short
    with store.open("dmg", tiny) as s:
        assert [m["content"] for ex in s.session.history for m in ex if m["role"] == "user"] == [
            QUESTIONS[1]
        ]
        assert not s.state_loaded  # the state belongs to turn 3, which was rejected
        _turns(s, QUESTIONS[3:])  # appends after the cut line, on a line of its own
    skipped = [w for w in store.warn if "skipped" in w]
    assert len(skipped) == 3 and "cut short" in skipped[-1]
    assert any("stale" in w for w in store.warn)
    store.warn.clear()
    again = read_log(log, store.warn)
    assert [ex[0]["content"] for ex in again.history] == [QUESTIONS[1], QUESTIONS[3]]
    assert again.skipped == 3


@pytest.mark.parametrize("junk", [b"[" * 100_000, b'{"a":' * 100_000])
def test_a_deeply_nested_junk_line_is_skipped_not_fatal(tiny, store, saved, junk):
    """A line of nested brackets (binary junk, a bad edit) once raised RecursionError out of
    the JSON parser: the session could not be opened, listed or shown at all."""
    log = _clone(store, saved, "deep") / LOG
    lines = log.read_bytes().split(b"\n")
    log.write_bytes(b"\n".join(lines[:2] + [junk] + lines[2:]))
    with store.open("deep", tiny) as s:
        assert [ex[0]["content"] for ex in s.session.history] == QUESTIONS[:3]
        assert s.state_loaded
    assert store.ids() == ["deep"] and store.read("deep").skipped == 1
    assert any("skipped line 3: unreadable" in w for w in store.warn), store.warn


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_state_is_ignored_and_the_log_kept(tiny, store, saved, damage):
    sid = f"st-{damage}"
    _clone(store, saved, sid)
    state, log = store.path(sid) / STATE, store.path(sid) / LOG
    data = bytearray(state.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF  # inside the last tensor: only the checksum notices
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"\x00" * 64)
    state.write_bytes(bytes(data))
    log_before = log.read_bytes()
    with store.open(sid, tiny) as s:
        assert not s.state_loaded and s.resumed_turns == 3 and s.state_error
        assert state.read_bytes() == bytes(data)  # opening writes nothing over it
        assert log.read_bytes() == log_before
        turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
        assert turn.stats.prefilled_tokens == turn.stats.prompt_tokens
        s.append_turn(turn)
        s.save_state()
    assert log.read_bytes().startswith(log_before)
    with store.open(sid, tiny) as s:  # the next save replaced the damaged state with a good one
        assert s.state_loaded and s.resumed_turns == 4
    assert any("ignored" in w for w in store.warn)


def _edit_metadata(path, **changes) -> None:
    """Rewrite a safetensors file's metadata, keeping its tensors (and their checksum)."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].update(changes)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def test_the_checksum_covers_the_metadata_too(tiny, store, saved):
    """The checksum covered the tensors only, not the metadata that says how to read them:
    damaged `views` made float32 recurrent states load as bfloat16 pairs, twice as wide,
    the state counted as restored, and every question then failed on the state's shape."""
    from safetensors.numpy import load

    state = _clone(store, saved, "meta") / STATE
    names = [k for k in load(state.read_bytes()) if k.endswith(".state")]
    _edit_metadata(state, views=json.dumps(dict.fromkeys(names, "bfloat16")))
    with store.open("meta", tiny) as s:
        assert not s.state_loaded and s.state_error == "checksum mismatch"
        turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
    assert turn.token_ids == saved.turn4.token_ids


def test_a_version_2_state_still_resumes(tiny, store, saved):
    """Files written before the checksum covered the metadata keep their fast resume."""
    from safetensors.numpy import load

    from engine.storage.state_file import _digest

    state = _clone(store, saved, "v2") / STATE
    _edit_metadata(state, version="2", sha256=_digest(load(state.read_bytes()), None))
    with store.open("v2", tiny) as s:
        assert s.state_loaded
        turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
    assert turn.token_ids == saved.turn4.token_ids
    assert turn.stats.prefilled_tokens == saved.turn4.stats.prefilled_tokens


@pytest.mark.parametrize("header", [b"[" * 100_000, b'{"__metadata__": ["key"]}', b"[]"])
def test_a_header_without_metadata_is_a_state_error(header):
    """A header nested past the parser's depth raised RecursionError, and one whose metadata
    was not an object was returned as is: `chatml sessions show` died on either."""
    import struct

    from engine.storage.state_file import StateError

    with pytest.raises(StateError, match="unreadable header"):
        read_header(struct.pack("<Q", len(header)) + header)


def test_foreign_and_stale_states_are_never_used(tiny, store, saved):
    state = _clone(store, saved, "fs") / STATE
    good = state.read_bytes()
    other = dataclasses.replace(
        tiny, checkpoint=dataclasses.replace(tiny.checkpoint, fingerprint="0" * 16)
    )
    with store.open("fs", other) as s:
        assert not s.state_loaded and "other weights" in s.state_error
    assert state.read_bytes() == good
    state.write_bytes(saved.stale)  # the state of turn 2 beside a log that ends with turn 3
    with store.open("fs", tiny) as s:
        assert not s.state_loaded and "stale" in s.state_error and s.resumed_turns == 3


def test_a_state_made_before_quantizing_at_load_is_not_used(tiny, store, saved):
    """`quantize=` at load changes the weights but not the checkpoint's fingerprint, which
    alone named them: a session saved in float resumed under `--quantize 8` from the float
    model's caches ("cache restored"), not from what the 8-bit model computes; a server's
    disk tier likewise served one's entries to the other."""
    import engine
    from engine.storage.disk_cache import namespace

    _clone(store, saved, "q8")
    q8 = engine.load("tiny", quantize=8)
    try:
        with store.open("q8", q8) as s:
            assert not s.state_loaded and "other weights" in s.state_error
            turn = s.session.send(QUESTIONS[3], max_tokens=MAX)
        assert turn.stats.prefilled_tokens == turn.stats.prompt_tokens  # all its own caches
        assert namespace(q8) != namespace(tiny)  # nor does the server's disk tier mix them
    finally:
        q8.close()


def test_reset_and_regenerate_replay(tiny, store, saved):
    _clone(store, saved, "rr")
    with store.open("rr", tiny) as s:
        last = s.session.history.pop()  # what /regenerate does before asking again
        _turns(s, [last[0]["content"]])
        assert len(s.session.history) == 3
        history = [list(ex) for ex in s.session.history]
    with store.open("rr", tiny) as s:
        assert s.session.history == history and s.state_loaded
        s.session.reset()
        s.record_reset()
    with store.open("rr", tiny) as s:
        assert s.session.history == [] and not s.state_loaded and s.session.system == SYSTEM


def test_attach_saves_an_in_memory_conversation(tiny, store):
    session = tiny.session(SYSTEM)
    turns = [session.send(q, max_tokens=MAX) for q in QUESTIONS[:1]]
    store.attach("att", session, turns).close()
    with store.open("att", tiny) as s:
        assert s.state_loaded and s.session.history == session.history
    with pytest.raises(FileExistsError):
        store.attach("att", session, turns)


def test_a_window_of_zero_exchanges_is_kept_and_resumed_as_zero(tiny, store):
    with store.open("mx0", tiny, system=SYSTEM, max_exchanges=0) as s:
        assert s.session.max_exchanges == 0
        _, second = _turns(s, QUESTIONS[:2])
        assert QUESTIONS[0] not in tiny.tokenizer.decode(second.prompt_ids)  # asked on its own
    with store.open("mx0", tiny) as s:  # resumed without the option: the header's 0
        assert s.session.max_exchanges == 0 and len(s.session.history) == 2
    with store.open("mx0", tiny, max_exchanges=2) as s:  # a given window replaces it
        assert s.session.max_exchanges == 2
    with store.open("mx0", tiny) as s:
        assert s.session.max_exchanges == 2


@pytest.mark.parametrize("bad", ["../x", "/etc", "a/b", "..", ".", "", "a\\b", ".hidden", "x" * 65])
def test_unsafe_session_ids_are_rejected(tiny, store, bad):
    with pytest.raises(SessionIdError, match="invalid session id"):
        check_id(bad)
    with pytest.raises(SessionIdError):
        store.open(bad, tiny)
    with pytest.raises(SessionIdError):
        store.remove(bad)
    assert not (store.root.parent / "x").exists() and not store.root.exists()


def test_a_session_is_open_in_one_place_at_a_time(tiny, store):
    with store.open("busy", tiny):
        with pytest.raises(SessionBusy):
            store.open("busy", tiny)
        with pytest.raises(SessionBusy):
            store.remove("busy")
    store.remove("busy")
    assert store.ids() == []


@pytest.fixture
def created_meanwhile(tiny, store, monkeypatch):
    """Another process creates session "x" (one turn) just before this one takes its lock:
    what a check made before the lock cannot see. Returns the other's log bytes."""
    import engine.storage.store as st

    other, made = SessionStore(store.home, warn=Warnings()), {}
    real = st._locked

    def late(path, session_id):
        if not made:
            made["log"] = None  # once: the other's own open takes the lock plainly
            with other.open(session_id, tiny, system="theirs") as s:
                _turns(s, QUESTIONS[:1])
            made["log"] = (s.dir / LOG).read_bytes()
        return real(path, session_id)

    monkeypatch.setattr(st, "_locked", late)
    return made


def test_a_failed_open_never_deletes_a_session_made_meanwhile(tiny, store, created_meanwhile):
    """`open` decided that a session was new before taking its lock: when opening then
    failed, it deleted the session another process had created in between."""
    with pytest.raises(ValueError, match="lone surrogate"):
        store.open("x", tiny, system="caf\udce9")
    assert (store.path("x") / LOG).read_bytes() == created_meanwhile["log"]


def test_attach_never_writes_into_a_session_made_meanwhile(tiny, store, created_meanwhile):
    """`attach` checked that the id was free before taking the lock, then appended its
    header and turns to the log another process had created in between."""
    session = tiny.session(SYSTEM)
    turns = [session.send(QUESTIONS[1], max_tokens=MAX)]
    with pytest.raises(FileExistsError, match="'x' already exists"):
        store.attach("x", session, turns)
    assert (store.path("x") / LOG).read_bytes() == created_meanwhile["log"]
    with store.open("x", tiny) as s:  # not left locked
        assert s.session.system == "theirs"


def test_remove_never_deletes_a_session_made_as_it_lets_go(tiny, store, monkeypatch):
    """`remove` emptied the folder under the lock but deleted it after letting go: a session
    another process created in that moment was deleted with it."""
    import contextlib

    import engine.storage.store as st

    with store.open("x", tiny, system=SYSTEM) as s:
        _turns(s, QUESTIONS[:1])
    other, real = SessionStore(store.home, warn=Warnings()), st._locked

    @contextlib.contextmanager
    def then_created(path, session_id):
        with real(path, session_id) as f:
            yield f
        monkeypatch.setattr(st, "_locked", real)  # once: the other's open locks plainly
        with other.open(session_id, tiny, system="theirs") as o:
            _turns(o, QUESTIONS[1:2])

    monkeypatch.setattr(st, "_locked", then_created)
    store.remove("x")
    monkeypatch.undo()
    assert other.read("x").options["system"] == "theirs" and len(other.read("x").history) == 1


# A child process that writes two good turns, then is SIGKILLed in the middle of writing.
_CHILD = textwrap.dedent(
    """
    import os, sys, time
    import engine
    from engine.storage import store as st

    eng = engine.load("tiny")
    s = st.SessionStore(sys.argv[1]).open("kill", eng, system="sys")
    for q in ("one", "two"):
        s.append_turn(s.session.send(q, max_tokens=2)); s.save_state()

    def stuck(data):  # half the bytes reach the file, then the process is killed
        os.write(fd, data[: len(data) // 2]); os.fsync(fd)
        print("WRITING", flush=True); time.sleep(60)

    if sys.argv[2] == "log":
        fd = s._log.fileno()
        s._write = stuck
    else:
        path = s.dir / ".state.safetensors.crash.tmp"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        st.atomic_write = lambda _path, data: stuck(data)
    s.append_turn(s.session.send("three", max_tokens=2)); s.save_state()
    """
)


@pytest.mark.parametrize("where", ["log", "state"])
def test_sigkill_while_writing_loses_at_most_the_turn_in_flight(tiny, tmp_path, where):
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path), where],
        stdout=subprocess.PIPE,
        env=os.environ.copy(),
    )
    try:
        assert child.stdout.readline().strip() == b"WRITING"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    warns = Warnings()
    store = SessionStore(tmp_path, warn=warns)
    with store.open("kill", tiny) as s:
        users = [ex[0]["content"] for ex in s.session.history]
        if where == "log":  # the turn being logged is lost, the state of turn 2 still fits
            assert users == ["one", "two"] and s.state_loaded
            assert "cut short" in warns[0]
        else:  # turn 3 was logged; its state was not: rebuilt from the log
            assert users == ["one", "two", "three"] and not s.state_loaded
            assert "stale" in s.state_error
        assert not list(s.dir.glob("*.tmp"))  # the half-written temporary file is cleaned up
        s.append_turn(s.session.send("four", max_tokens=2))
        s.save_state()
    with store.open("kill", tiny) as s:
        assert s.state_loaded and s.session.history[-1][0]["content"] == "four"


def test_a_failed_state_save_leaves_the_previous_state(tiny, store, saved, monkeypatch):
    _clone(store, saved, "atom")
    with store.open("atom", tiny) as s:
        good = (store.path("atom") / STATE).read_bytes()
        s.session.send(QUESTIONS[3], max_tokens=MAX)

        def disk_full(fd):
            raise OSError("disk full")

        monkeypatch.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError, match=f"disk full: '{store.path('atom') / STATE}'"):
            s.save_state()
        monkeypatch.undo()
    assert (store.path("atom") / STATE).read_bytes() == good
    assert not list(store.path("atom").glob("*.tmp"))


def test_a_failed_log_write_names_the_log_and_leaves_it_as_it_was(tiny, store, monkeypatch):
    """A turn whose line could not be made durable (disk full at fsync) raised an OSError
    that named no file, yet left its line in the log: a resume replayed the exchange the
    caller had been told was not saved."""
    with store.open("nolog", tiny, system=SYSTEM) as s:
        _turns(s, QUESTIONS[:1])
        log = s.dir / LOG
        before = log.read_bytes()
        turn = s.session.send(QUESTIONS[1], max_tokens=MAX)

        def disk_full(fd):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError, match="No space left") as e:
            s.append_turn(turn)
        monkeypatch.undo()
        assert str(log) in str(e.value) and log.read_bytes() == before
        assert len(s.session.history) == 2  # the conversation in memory is unharmed
        _turns(s, QUESTIONS[2:3])  # the disk has room again: the next turn is logged
    again = read_log(log, store.warn)
    assert [ex[0]["content"] for ex in again.history] == [QUESTIONS[0], QUESTIONS[2]]
    assert again.skipped == 0 and not store.warn


def test_bfloat16_arrays_round_trip_bit_exactly():
    import mlx.core as mx

    from engine.storage.state_file import _to_mlx, _to_numpy

    a = mx.random.normal((2, 3, 5)).astype(mx.bfloat16)
    arr, view = _to_numpy(a)
    b = _to_mlx(arr, view)
    assert view == "bfloat16" and b.dtype == mx.bfloat16
    assert mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)).item()


# ----- records with a valid checksum but a bad content ------------------------------------

U, A = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "f", "arguments": {}}}]}  # fmt: skip
TOOL = {"role": "tool", "content": "21"}
BAD_TURNS = {
    "no answer": {"messages": [U]},
    "only an answer": {"messages": [A]},
    "two questions": {"messages": [U, U, A]},
    "answer first": {"messages": [A, U]},
    "system inside": {"messages": [{"role": "system", "content": "s"}, U, A]},
    "unknown role": {"messages": [U, {"role": "bot", "content": "a"}]},
    "content not text": {"messages": [U, {"role": "assistant", "content": 5}]},
    "empty question": {"messages": [{"role": "user", "content": " "}, A]},
    "message not a dict": {"messages": [U, "a"]},
    "calls without results": {"messages": [U, CALL, A]},
    "ends with calls": {"messages": [U, CALL]},
    "ends with a result": {"messages": [U, CALL, TOOL]},
    "pending without calls": {"messages": [U, A], "pending": True},
    "pending after a result": {"messages": [U, CALL, TOOL], "pending": True},
    "bad tool call": {"messages": [U, {**CALL, "tool_calls": ["f"]}, TOOL, A]},
}


@pytest.mark.parametrize("bad", list(BAD_TURNS), ids=list(BAD_TURNS))
def test_a_checksummed_but_invalid_exchange_is_skipped_like_a_corrupt_line(tiny, store, saved,
                                                                           bad):  # fmt: skip
    log = _clone(store, saved, "inv") / LOG
    with log.open("ab") as f:  # a good checksum: only the content can tell
        f.write(encode_record({"type": "turn", "n": 4, "index": 3, **BAD_TURNS[bad]}))
    with store.open("inv", tiny) as s:
        assert [ex[0]["content"] for ex in s.session.history] == QUESTIONS[:3]
        assert s.state_loaded  # the bad record names no state: the last good one's holds
        assert len(s.session.send(QUESTIONS[3], max_tokens=MAX).token_ids) > 0
    assert any("skipped line 5" in w and "exchange" in w for w in store.warn), store.warn


def test_good_tool_exchanges_replay(tmp_path):
    log = tmp_path / LOG
    records = [
        {"type": "turn", "n": 1, "index": 0, "messages": [U, CALL], "pending": True},
        {"type": "turn", "n": 2, "index": 0, "messages": [U, CALL, TOOL, CALL], "pending": True},
        {"type": "turn", "n": 3, "index": 0, "messages": [U, CALL, TOOL, CALL, TOOL, A]},
    ]
    log.write_bytes(b"".join(encode_record(r) for r in records))
    warned = Warnings()
    replayed = read_log(log, warned)
    assert replayed.history == [[U, CALL, TOOL, CALL, TOOL, A]] and not warned
    assert replayed.pending == []
    log.write_bytes(b"".join(encode_record(r) for r in records[:2]))
    replayed = read_log(log, warned)
    assert replayed.history == [] and replayed.pending == [U, CALL, TOOL, CALL] and not warned


@pytest.mark.parametrize("how", ["logged", "attached"])
def test_an_exchange_waiting_for_tool_results_resumes_pending_and_is_answered(tiny, store, how):
    """Tool calls logged while their results were awaited come back as `pending` (they were
    dropped: the resumed session had no calls to answer), and the results answer them as a
    fresh prefill of the same prompt does."""

    def turns(session, record=lambda turn: None):
        record(session.send(QUESTIONS[0], max_tokens=MAX))
        called = session.send(QUESTIONS[1], tools=TOOLS, tool_choice="required", max_tokens=60)
        assert called.tool_calls and session.pending
        record(called)
        return called, list(session.history), list(session.pending)

    if how == "logged":
        with store.open("tools", tiny, system=SYSTEM) as s:
            called, history, pending = turns(s.session, lambda t: (s.append_turn(t),
                                                                   s.save_state()))  # fmt: skip
    else:
        session = tiny.session(SYSTEM)
        called, history, pending = turns(session)
        store.attach("tools", session).close()
    with store.open("tools", tiny) as s:
        assert s.session.history == history and s.session.pending == pending
        assert s.state_loaded
        done = s.session.send_tool_results([RESULT], tools=TOOLS, max_tokens=MAX)
        assert done.stats.reused_tokens >= len(called.prompt_ids)
        assert done.token_ids == fresh_greedy(tiny, done.prompt_ids, MAX)[0]


@pytest.mark.parametrize(
    "option",
    [
        {"system": 5},
        {"max_exchanges": -1},
        {"max_exchanges": "6"},
        {"enable_thinking": "yes"},
        {"model": ["tiny"]},
    ],  # fmt: skip
)
def test_a_checksummed_option_of_the_wrong_type_is_skipped(tiny, store, saved, option):
    log = _clone(store, saved, "opt") / LOG
    with log.open("ab") as f:
        f.write(encode_record({"type": "options", **option}))
    with store.open("opt", tiny) as s:
        assert s.session.system == SYSTEM and s.session.max_exchanges == 6
        assert s.session.enable_thinking is None and len(s.session.history) == 3
    assert any("bad option" in w for w in store.warn)


# ----- symbolic links ---------------------------------------------------------------------


@pytest.mark.parametrize("link", ["folder", LOG, STATE, "lock"])
def test_symlinks_out_of_the_sessions_folder_are_refused(tiny, store, saved, tmp_path, link):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(saved.dir, elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    if link == "folder":
        store.root.mkdir(parents=True)
        (store.root / "x").symlink_to(elsewhere, target_is_directory=True)
    else:
        shutil.copytree(saved.dir, store.root / "x")
        (store.root / "x" / link).unlink(missing_ok=True)
        (store.root / "x" / link).symlink_to(elsewhere / link)
    for use in (lambda: store.open("x", tiny), lambda: store.remove("x"),
                lambda: store.read("x"), lambda: store.exists("x")):  # fmt: skip
        with pytest.raises(SessionIdError, match="symbolic link"):
            use()
    assert "x" not in store.ids() and any("symbolic link" in w for w in store.warn)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


def test_a_symlinked_sessions_folder_itself_is_the_users_choice(tiny, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "sessions").symlink_to(tmp_path / "real", target_is_directory=True)
    store = SessionStore(tmp_path / "home", warn=Warnings())
    with store.open("s", tiny, system=SYSTEM) as s:
        _turns(s, QUESTIONS[:1])
    assert store.ids() == ["s"] and (tmp_path / "real" / "s" / LOG).is_file()
    store.remove("s")
    assert not (tmp_path / "real" / "s").exists()


def test_a_session_that_cannot_be_created_leaves_nothing_on_disk(tiny, store):
    with pytest.raises(ValueError, match="lone surrogate"):
        store.open("new", tiny, system="caf\udce9")  # what `--system $'caf\xe9'` becomes
    assert not store.path("new").exists() and store.ids() == []
    with store.open("new", tiny, system="café") as s:  # the id is free for a good one
        assert s.session.system == "café"


def test_a_sessions_folder_and_files_are_the_users_alone(tiny, tmp_path):
    """A session holds a conversation: 0700 folders and 0600 files even under umask 0 (the
    log was 0644 and the folder 0755: readable by every user of a shared machine)."""
    old = os.umask(0)
    try:
        store = SessionStore(tmp_path / "home", warn=Warnings())
        with store.open("private", tiny, system=SYSTEM) as s:
            _turns(s, QUESTIONS[:1])
            folder = s.dir
    finally:
        os.umask(old)
    assert (folder.stat().st_mode & 0o777) == 0o700
    assert (store.root.stat().st_mode & 0o777) == 0o700
    for name in (LOG, STATE, "lock"):
        assert ((folder / name).stat().st_mode & 0o777) == 0o600, name
