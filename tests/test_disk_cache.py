"""The disk tier of the pool's prefix cache (engine/storage/disk_cache.py), on `tiny`.

Exactness reference: `helpers.fresh_greedy`, a full prefill on fresh caches of the same ids
(on the session's `tiny` engine, which has no disk tier), and `test_server.fresh_answer`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import mlx.core as mx
import openai
import pytest
from helpers import QUESTIONS, fresh_greedy
from test_server import fresh_answer, prompt_of

import engine
from engine.checkpoints.loader import CheckpointError
from engine.paths import atomic_write
from engine.runtime.generate import prefill
from engine.runtime.pool import PooledSequence
from engine.serving.server import BackgroundServer, ServerConfig
from engine.storage.disk_cache import DiskCache, DiskCacheBusy, FolderLock, worth_reading
from engine.storage.state_file import capture_state, state_key

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 6}
# A user message long enough that every turn's resume point passes the per-turn write bound.
TAIL = " Please answer briefly, precisely and politely, in plain words, and say why." * 4


@pytest.fixture(scope="module")
def eng():
    """A tiny engine of its own: the tests attach disk tiers and change its budget."""
    e = engine.load("tiny")
    yield e
    e.close()


@pytest.fixture
def disk(eng, tmp_path):
    eng.stateless.pool.sequences.clear()
    d = eng.attach_disk(tmp_path / "cache", 1 << 30, min_tokens=8)
    yield d
    eng.detach_disk()
    eng.stateless.pool.sequences.clear()


def conversation(n: int) -> list:
    return [SYSTEM, {"role": "user", "content": QUESTIONS[n]}]


def prefix_seq(eng, ids, stops=()):
    seq = PooledSequence(eng)
    seq.extend(list(ids), stops=stops)
    return seq


def test_restored_prefix_equals_a_fresh_prefill(tiny, eng, disk):
    ids = prompt_of(eng, conversation(0)).ids
    n = len(ids) - 9
    with eng.lock:
        seq = prefix_seq(eng, ids[: n + 4], stops=[n])  # one entry at a snapshot, one at the end
        assert disk.store(seq, n) and disk.store(seq, n + 4)
        disk.flush()
        ref_tokens, ref_logits = fresh_greedy(tiny, ids)
        for pos in (n, n + 4):
            entry = disk.lookup(ids[: pos + 1])  # the longest entry within pos
            assert entry is not None and entry.tokens == pos
            tokens, caches = disk.restore(entry)
            assert tokens == ids[:pos]
            logits, _ = prefill(eng.model, caches, ids, pos)
            assert mx.abs(logits - ref_logits).max().item() < 1e-4
            out, token = [], mx.argmax(logits).item()
            while len(out) < len(ref_tokens):
                out.append(token)
                token = mx.argmax(eng.model(mx.array([[token]]), caches)[0, -1]).item()
            assert out == ref_tokens


@pytest.fixture
def held_writer(monkeypatch):
    """The disk tier's writer, stopped inside its first write until `release` is set: what
    it was given stays queued (`writing` is set once it holds the first entry)."""
    import engine.storage.disk_cache as disk_cache

    writing, release = threading.Event(), threading.Event()

    def write(path, data):
        writing.set()
        assert release.wait(120), "the held write was never released"
        atomic_write(path, data)

    monkeypatch.setattr(disk_cache, "atomic_write", write)
    yield writing, release
    release.set()  # a failed test does not leave the writer (and the fixture's close) waiting


def test_an_entry_queued_for_writing_is_restored_from_ram(tiny, eng, disk, held_writer):
    """While the writer holds it, the entry is found and restored from its numpy copy (no
    file yet), equal to a fresh prefill; once written, the same entry is read from its file."""
    writing, release = held_writer
    ids = prompt_of(eng, conversation(2)).ids
    n = len(ids) - 6
    ref_tokens, ref_logits = fresh_greedy(tiny, ids)
    with eng.lock:
        seq = prefix_seq(eng, ids[:n])
        assert disk.store(seq, n) and writing.wait(60)
        seq.extend(ids[n:], stops=())  # the live caches move on: the queued copy must not
        entry = disk.lookup(ids)
        assert entry is not None and entry.tokens == n and not entry.path.exists()
        for source in ("ram", "file"):
            tokens, caches = disk.restore(entry)
            assert tokens == ids[:n]
            assert (disk.memory_reads, disk.reads) == ((1, 0) if source == "ram" else (1, 1))
            logits, _ = prefill(eng.model, caches, ids, n)
            assert mx.abs(logits - ref_logits).max().item() < 1e-4
            release.set()
            disk.flush()
            assert entry.path.exists() and entry.captured is None and disk.lookup(ids) is entry


@pytest.mark.parametrize("writes", ["written", "queued"])
def test_chat_evicted_to_disk_and_back_gives_the_same_answer(tiny, eng, disk, writes, request):
    """The next turn after its state left RAM: from the written file, or (the writer held)
    from the entry still queued for writing."""
    if writes == "queued":
        writing, _ = request.getfixturevalue("held_writer")
    restores = eng.stateless.pool.restores
    eng.budget.max_bytes = 1  # everything leaves RAM after each answer
    try:
        messages = conversation(1)
        first = eng.chat(messages, max_tokens=4, warm=False)
        assert not any(s.cache_bytes for s in eng.stateless.pool.sequences)
        if writes == "written":
            disk.flush()
        else:
            assert writing.wait(60) and disk.writes == 0
        messages += [first.message(), {"role": "user", "content": QUESTIONS[2]}]
        second = eng.chat(messages, max_tokens=4, warm=False)
    finally:
        eng.budget.max_bytes = 1 << 40
    assert eng.stateless.pool.restores == restores + 1
    assert (disk.reads, disk.memory_reads) == ((1, 0) if writes == "written" else (0, 1))
    assert second.stats.reused_tokens >= len(first.prompt_ids) - 1 - 8  # up to its answer
    assert second.token_ids == fresh_greedy(tiny, second.prompt_ids, 4)[0]


def test_restarted_server_resumes_from_disk(tiny, tmp_path):
    cache = tmp_path / "cache"
    messages = [SYSTEM]
    for stop in range(2):  # two servers in sequence, each a fresh engine on the same folder
        e = engine.load("tiny", cache_dir=cache)
        config = ServerConfig(port=0, context_window=4096, warm=False)
        with BackgroundServer(e, config) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            for turn in range(3 if stop == 0 else 1):
                messages.append({"role": "user", "content": QUESTIONS[3 + turn + 3 * stop]})
                r = c.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=4, temperature=0,
                    presence_penalty=0,
                )  # fmt: skip
                answer = r.choices[0].message.content
                assert answer == fresh_answer(tiny, messages, max_tokens=4)
                if stop == 1:  # the first request after the restart
                    before = prompt_of(tiny, messages[:-2]).boundaries.generation_start
                    assert r.usage.prompt_tokens_details.cached_tokens >= before
                    assert e.stateless.pool.restores == 1
                messages.append({"role": "assistant", "content": answer})
        e.close()
    assert not list(cache.glob("*/*.tmp"))


def test_damaged_truncated_and_foreign_entries_are_deleted_not_loaded(eng, disk, caplog):
    ids = prompt_of(eng, conversation(4)).ids
    with eng.lock:
        seq = prefix_seq(eng, ids[:-1], stops=[len(ids) - k for k in (30, 20, 10)])
        for pos in (len(ids) - 20, len(ids) - 10, len(ids) - 1):
            disk.store(seq, pos)
        disk.flush()
        # A foreign entry: another model's fingerprint, under a name that matches these ids.
        captured = capture_state(seq, eng, len(ids) - 30)
        captured.meta["fingerprint"] = "another-model"
        foreign = disk._path(len(ids) - 30, captured.meta["key"])
        atomic_write(foreign, captured.encode())
    by_len = {int(p.name.split("-")[0]): p for p in disk.ns.glob("*.safetensors")}
    truncated, flipped = by_len[len(ids) - 1], by_len[len(ids) - 10]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the tensor bytes: only the checksum can tell
    flipped.write_bytes(bytes(data))
    reopened = eng.attach_disk(disk.dir, 1 << 30, min_tokens=8)  # a restart indexes all four
    assert reopened.entries == 4
    with eng.lock:
        for gone in (truncated, flipped):
            entry = reopened.lookup(ids)
            assert entry.path == gone and reopened.restore(entry) is None
            assert not gone.exists()
        good = reopened.lookup(ids)
        assert good.tokens == len(ids) - 20 and reopened.restore(good) is not None
        # The foreign one is shorter than the good one: read it directly.
        foreign_entry = next(e for e in reopened._index.values() if e.path == foreign)
        assert reopened.restore(foreign_entry) is None and not foreign.exists()
    assert reopened.rejected == 3
    assert "skipped and deleted" in caplog.text


def test_an_entry_the_decoder_chokes_on_is_deleted_not_raised(eng, disk, caplog):
    """Only OSError and StateError were caught around a read: a file whose metadata made
    the decoder raise anything else (here a dtype it does not know) failed the request
    instead of being deleted and prefilled."""
    ids = prompt_of(eng, conversation(9)).ids
    with eng.lock:
        seq = prefix_seq(eng, ids[:-1])
        captured = capture_state(seq, eng, len(ids) - 1)
        captured.meta["views"] = json.dumps({"kv.3.keys": "float4"})
        atomic_write(disk._path(len(ids) - 1, captured.meta["key"]), captured.encode())
        reopened = eng.attach_disk(disk.dir, 1 << 30, min_tokens=8)
        entry = reopened.lookup(ids)
        assert reopened.restore(entry) is None and not entry.path.exists()
    assert reopened.rejected == 1 and "float4" in caplog.text


def test_disk_budget_deletes_least_recently_used(eng, disk):
    ids = [prompt_of(eng, conversation(n)).ids for n in (5, 6, 7)]
    with eng.lock:
        seqs = [prefix_seq(eng, x[:-1]) for x in ids]
        disk.store(seqs[0], len(ids[0]) - 1)
        disk.flush()
        size = disk.nbytes
        disk.max_bytes = int(size * 2.5)  # room for two entries of about this size
        disk.store(seqs[1], len(ids[1]) - 1)
        disk.flush()
        assert disk.restore(disk.lookup(ids[0])) is not None  # used: now the most recent
        disk.store(seqs[2], len(ids[2]) - 1)
        disk.flush()
    assert disk.nbytes <= disk.max_bytes
    held = {e.tokens for e in disk._index.values()}
    assert held == {len(ids[0]) - 1, len(ids[2]) - 1}  # the second one, least recent, went


def test_an_entry_larger_than_the_budget_evicts_nothing(eng, disk):
    """One entry bigger than the whole budget once deleted every other entry (oldest
    first, to make room) and then itself: the cache ended empty."""
    short, long = (prompt_of(eng, conversation(n)).ids for n in (5, 6))
    long = long + long  # more KV rows: more bytes
    with eng.lock:
        disk.store(prefix_seq(eng, short[:-1]), len(short) - 1)
        disk.flush()
        kept = set(disk._index)
        disk.max_bytes = disk.nbytes  # room for this entry only
        assert disk.store(prefix_seq(eng, long[:-1]), len(long) - 1)
        disk.flush()
    assert set(disk._index) == kept and disk.nbytes <= disk.max_bytes
    assert not disk._pending and len(list(disk.ns.iterdir())) == 1


def test_the_budget_holds_from_the_start(eng, disk):
    """A cache reopened with a smaller budget (or less free space) stayed over it until
    its next write: a read-mostly server kept more on disk than it was given."""
    ids = [prompt_of(eng, conversation(n)).ids for n in (5, 6, 7)]
    with eng.lock:
        for x in ids:
            disk.store(prefix_seq(eng, x[:-1]), len(x) - 1)
            disk.flush()
    for used, path in enumerate(sorted(disk._index, key=lambda p: int(p.name.split("-")[0]))):
        os.utime(path, (used, used))  # the LRU order a restart reads: the longest is newest
    newest = path
    budget = disk.nbytes // 2
    reopened = eng.attach_disk(disk.dir, budget, min_tokens=8)
    assert reopened.nbytes <= budget and list(reopened._index) == [newest]
    assert sorted(reopened.ns.iterdir()) == [newest]


def test_a_failed_encode_does_not_stop_the_writer(eng, disk, monkeypatch, caplog):
    """An error other than OSError while encoding (MemoryError on a long state) once killed
    the writer thread: that entry stayed queued (its arrays held in RAM) for ever, and the
    next one was never written, so `flush` (the server's shutdown) never returned."""
    from engine.storage.state_file import CapturedState

    def out_of_memory(self):
        raise MemoryError

    ids = [prompt_of(eng, conversation(n)).ids for n in (5, 6)]
    with eng.lock:
        monkeypatch.setattr(CapturedState, "encode", out_of_memory)
        disk.store(prefix_seq(eng, ids[0][:-1]), len(ids[0]) - 1)
        disk.flush()
        monkeypatch.undo()
        assert not disk._pending and disk.lookup(ids[0]) is None
        disk.store(prefix_seq(eng, ids[1][:-1]), len(ids[1]) - 1)
        flushed = threading.Thread(target=disk.flush, daemon=True)
        flushed.start()
        flushed.join(60)  # a guard only: with a live writer the flush returns at once
        assert not flushed.is_alive() and disk.lookup(ids[1]) is not None and disk.writes == 1
    assert "not written (MemoryError" in caplog.text


def test_an_entry_that_cannot_be_evicted_does_not_stop_the_writer(eng, disk, monkeypatch,
                                                                    caplog):  # fmt: skip
    """An eviction whose delete failed (a file another user owns in a shared folder, a
    read-only one) raised out of the writer thread and ended it: nothing queued afterwards
    was written, and `flush` never returned."""
    from pathlib import Path

    ids = [prompt_of(eng, conversation(n)).ids for n in (5, 6, 7)]
    with eng.lock:
        disk.store(prefix_seq(eng, ids[0][:-1]), len(ids[0]) - 1)
        disk.flush()
        (stuck,) = disk._index
        disk.max_bytes = int(disk.nbytes * 1.5)  # room for one entry: the second evicts it
        real = Path.unlink
        monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (
            (_ for _ in ()).throw(PermissionError(1, "Operation not permitted", str(self)))
            if self == stuck else real(self, missing_ok)))  # fmt: skip
        for x in ids[1:]:
            disk.store(prefix_seq(eng, x[:-1]), len(x) - 1)
        flushed = threading.Thread(target=disk.flush, daemon=True)
        flushed.start()
        flushed.join(60)  # a guard only: with a live writer the flush returns at once
        assert not flushed.is_alive() and disk.writes == 3
        assert disk.lookup(ids[2]) is not None and stuck.exists()
    assert "not evicted" in caplog.text and "Operation not permitted" in caplog.text


def test_a_damaged_entry_that_cannot_be_deleted_is_still_skipped(eng, disk, monkeypatch):
    """A damaged entry is deleted as it is skipped; when that delete failed too (read-only,
    another user's file) the error went up into the request instead of a prefill."""
    from pathlib import Path

    ids = prompt_of(eng, conversation(3)).ids
    with eng.lock:
        disk.store(prefix_seq(eng, ids[:-1]), len(ids) - 1)
        disk.flush()
        entry = disk.lookup(ids)
        entry.path.write_bytes(entry.path.read_bytes()[:-100])  # truncated
        real = Path.unlink
        monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (
            (_ for _ in ()).throw(PermissionError(1, "Operation not permitted", str(self)))
            if self == entry.path else real(self, missing_ok)))  # fmt: skip
        assert disk.restore(entry) is None and disk.lookup(ids) is None  # not offered again
    assert entry.path.exists() and disk.rejected == 1


@pytest.mark.parametrize(
    "failure", [MemoryError(), OSError(5, "Input/output error"), OSError(24, "Too many open files")]
)
def test_an_entry_that_fails_to_read_for_want_of_memory_or_io_is_kept(eng, disk, monkeypatch,
                                                                     caplog, failure):  # fmt: skip
    """Any failure of a read deleted the entry, as if the file were damaged: a moment without
    memory or file handles (or a disk error) threw away a good entry for every later turn and
    restart. Now only damage deletes; the turn prefills and a later one restores the entry."""
    import engine.storage.disk_cache as disk_cache

    ids = prompt_of(eng, conversation(6)).ids
    with eng.lock:
        disk.store(prefix_seq(eng, ids[:-1]), len(ids) - 1)
        disk.flush()
        entry = disk.lookup(ids)
        real = disk_cache.decode_state

        def failing(*args, **kwargs):
            raise failure

        monkeypatch.setattr(disk_cache, "decode_state", failing)
        assert disk.restore(entry) is None
        monkeypatch.setattr(disk_cache, "decode_state", real)
        assert entry.path.exists() and disk.rejected == 0 and "kept" in caplog.text
        again = disk.lookup(ids)
        assert again is not None and again.path == entry.path
        tokens, _ = disk.restore(again)
        assert tokens == ids[:-1] and disk.reads == 1


def test_an_entry_deleted_or_made_unreadable_by_someone_else_is_forgotten(eng, disk):
    ids = prompt_of(eng, conversation(7)).ids
    with eng.lock:
        for pos in (len(ids) - 1, len(ids) - 5):
            disk.store(prefix_seq(eng, ids[:pos]), pos)
        disk.flush()
        deleted = disk.lookup(ids)
        deleted.path.unlink()
        assert disk.restore(deleted) is None and disk.lookup(ids).tokens == len(ids) - 5
        unreadable = disk.lookup(ids)
        real = type(unreadable.path).read_bytes
        with pytest.MonkeyPatch.context() as m:
            m.setattr(type(unreadable.path), "read_bytes", lambda self: (
                (_ for _ in ()).throw(PermissionError(13, "Permission denied", str(self)))
                if self == unreadable.path else real(self)))  # fmt: skip
            assert disk.restore(unreadable) is None and disk.lookup(ids) is None
        assert unreadable.path.exists() and disk.rejected == 0  # another user's file: left


def test_crash_mid_write_leaves_nothing_that_loads(eng, disk, tmp_path):
    ids = prompt_of(eng, conversation(8)).ids
    with eng.lock:
        seq = prefix_seq(eng, ids[:-1])
        data = capture_state(seq, eng, len(ids) - 1).encode()
    # What atomic_write leaves when the process dies before its rename.
    name = f"{len(ids) - 1}-{'0' * 32}.safetensors"
    tmp = disk.ns / f".{name}.abc123.tmp"
    tmp.write_bytes(data[: len(data) // 2])
    reopened = eng.attach_disk(disk.dir, 1 << 30, min_tokens=8)
    assert reopened.entries == 0 and reopened.lookup(ids) is None
    assert not tmp.exists()


def test_second_process_on_the_folder_is_refused(eng, disk):
    # the way out in both faces: engine.load(cache_dir=) raised naming the CLI's flags only
    with pytest.raises(DiskCacheBusy, match=r"in use.*--cache-dir; cache_dir= in Python"):
        DiskCache(eng, disk.dir)
    disk.close()
    DiskCache(eng, disk.dir).close()  # free again once the first lets go


def test_read_or_prefill_decision():
    assert not worth_reading(1 << 20, 4, 1e9, 10.0)  # too short to bother
    assert worth_reading(100 << 20, 1000, 1e9, 50.0)  # 0.1 s read vs 20 s prefill
    assert not worth_reading(1 << 30, 100, 1e8, 1000.0)  # 10 s read vs 0.1 s prefill
    assert worth_reading(1 << 30, 100, 1e8, None)  # no prefill measured yet: read


def test_warm_prompts_are_prefilled_at_start(tiny):
    warm = [conversation(9)]
    config = ServerConfig(port=0, context_window=4096, warm=False, warm_prompts=warm)
    tiny.stateless.pool.sequences.clear()
    with BackgroundServer(tiny, config) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        messages = [SYSTEM, {"role": "user", "content": "Another question entirely."}]
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                      temperature=0, presence_penalty=0)  # fmt: skip
    system_end = prompt_of(tiny, messages).boundaries.system_end
    assert r.usage.prompt_tokens_details.cached_tokens >= system_end > 0


def test_warm_prompts_carry_a_tool_set(tiny, tmp_path):
    """--warm-prompts said it warms "system prompts, tool sets" but took message arrays only,
    and a tool set renders into the system block: requests with tools reused nothing of it. An
    entry may be an object with `messages` and `tools`, checked and prefilled as that request."""
    from engine.serving.server import load_warm_prompts

    tools = [{"type": "function", "function": {
        "name": "lookup", "description": "Look a word up in the dictionary.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]  # fmt: skip
    path = tmp_path / "warm.json"
    path.write_text(json.dumps([{"messages": conversation(9), "tools": tools}]))
    warm = load_warm_prompts(str(path), tiny)
    config = ServerConfig(port=0, context_window=4096, warm=False, warm_prompts=warm)
    tiny.stateless.pool.sequences.clear()
    messages = [SYSTEM, {"role": "user", "content": "Another question entirely."}]
    with BackgroundServer(tiny, config) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=2,
                                      temperature=0, presence_penalty=0)  # fmt: skip
    system_end = prompt_of(tiny, messages, tools=tools).boundaries.system_end
    assert system_end > prompt_of(tiny, messages).boundaries.system_end  # the tools are in it
    assert r.usage.prompt_tokens_details.cached_tokens >= system_end
    path.write_text(json.dumps([{"messages": conversation(9), "tools": "lookup"}]))
    with pytest.raises(ValueError, match=r"\[0\]: .*\(tools"):
        load_warm_prompts(str(path), tiny)


def test_warm_prompts_file_is_checked_and_flags_parse(tiny, tmp_path):
    from engine.cli import build_parser
    from engine.serving.server import load_warm_prompts

    good = tmp_path / "warm.json"
    warm = [[{"role": "system", "content": "Tools here."}, {"role": "user", "content": "hi"}]]
    good.write_text(json.dumps(warm))
    assert load_warm_prompts(str(good), tiny) == warm
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([*warm, [{"role": "wizard", "content": "x"}]]))
    with pytest.raises(ValueError, match=r"\[1\]: .*\(messages"):
        load_warm_prompts(str(bad), tiny)
    bad.write_text('{"messages": []}')
    with pytest.raises(ValueError, match="list of message arrays"):
        load_warm_prompts(str(bad), tiny)
    args = build_parser().parse_args(
        ["serve", "--cache-dir", "D", "--disk-cache-bytes", "1000", "--warm-prompts", "F"]
    )
    assert (args.cache_dir, args.disk_cache_bytes, args.warm_prompts) == ("D", 1000, "F")
    assert (
        not args.no_disk_cache
        and build_parser().parse_args(["serve", "--no-disk-cache"]).no_disk_cache
    )


def long_question(n: int) -> dict:
    return {"role": "user", "content": QUESTIONS[n % len(QUESTIONS)] + TAIL}


def test_turn_writes_are_bounded(eng, disk):
    """keep_turn writes a prefix only if it adds gap(n) >= n / write_factor tokens over every
    entry below it: the entries of one conversation hold at most write_factor times its last."""
    bounded = eng.attach_disk(disk.dir, 1 << 30, min_tokens=8, write_factor=4)
    ids = prompt_of(eng, [SYSTEM, long_question(0), {"role": "assistant", "content": "ok"},
                          long_question(1)]).ids  # fmt: skip
    positions = list(range(4, len(ids), 4))
    with eng.lock:
        seq = prefix_seq(eng, ids, stops=positions)
        for pos in positions:  # one turn's end after another, in a growing conversation
            bounded.keep_turn(seq, [pos])
        bounded.flush()
        written = sorted(e.tokens for e in bounded._index.values())
        # The rule, restated: the first position of min_tokens or more, then each one at least
        # max(8, ceil(n / 4)) beyond the last written.
        want = []
        for n in positions:
            if n >= 8 and (not want or n - want[-1] >= max(8, -(-n // 4))):
                want.append(n)
        assert written == want and len(want) >= 4
        assert sum(written) <= 4 * written[-1]
        # An entry queued for a branch off the conversation does not count for this one.
        other = prefix_seq(eng, ids[:20] + [ids[20] + 1] + ids[21:44])
        assert bounded.keep_turn(other, [44]) == 1
        # Positions the sequence holds no state for are skipped, not guessed.
        assert bounded.keep_turn(seq, [len(ids) + 5, len(ids) - 3]) == 0
        bounded.flush()


class Served:
    """`chatml serve --model tiny` in a child process, on a disk cache folder."""

    def __init__(self, cache, log):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--model", "tiny", "--port", "0",
             "--cache-dir", str(cache)],
            stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True,  # noqa: SIM115
        )  # fmt: skip
        self.watchdog = threading.Timer(300, self.proc.kill)  # a hang fails, not stalls the run
        self.watchdog.start()
        banner = self.proc.stdout.readline()
        assert banner.startswith("chatml serve: tiny on "), banner
        self.url = banner.split(" on ", 1)[1].strip()
        self.lines = [self.proc.stdout.readline(), self.proc.stdout.readline()]
        self.client = openai.OpenAI(base_url=self.url, api_key="x", max_retries=0, timeout=120)

    def ask(self, messages: list):
        return self.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, temperature=0, presence_penalty=0
        )

    def stop(self, sig) -> tuple[int, str]:
        """Send `sig`; its exit status and what it printed after the banner lines."""
        self.proc.send_signal(sig)
        rest = self.proc.stdout.read()  # until it exits (its end of the pipe closes)
        rc = self.proc.wait(120)
        self.watchdog.cancel()
        self.proc.stdout.close()
        return rc, rest


def wait_for_entry(cache, ids, n: int, timeout: float = 120) -> None:
    """Until the entry for ids[:n] is on disk (renamed into place: whole), or fail."""
    name = f"{n}-{state_key(ids[:n])}.safetensors"
    deadline = time.monotonic() + timeout
    while not list(cache.glob(f"*/{name}")):
        assert time.monotonic() < deadline, f"{name} was never written"
        time.sleep(0.05)


def test_killed_or_terminated_server_resumes_from_disk(tiny, tmp_path):
    """6 turns, SIGKILL, restart: the resent conversation reuses up to the last answer's
    start, from the per-turn writes alone; then a SIGTERM right after a reply: the clean
    shutdown finishes the queued writes. Answers equal a fresh full prefill's."""
    cache, log = tmp_path / "cache", tmp_path / "server.log"
    messages, before = [SYSTEM], 0
    srv = Served(cache, log)
    try:
        for turn in range(6):
            messages.append(long_question(turn))
            answer = srv.ask(messages).choices[0].message.content
            assert answer == fresh_answer(tiny, messages, max_tokens=4)
            prompt = prompt_of(tiny, messages)
            start = prompt.boundaries.generation_start
            assert start - before >= max(32, -(-start // 8))  # the write bound allows it
            wait_for_entry(cache, prompt.ids, start)
            before = start
            messages.append({"role": "assistant", "content": answer})
    finally:
        assert srv.stop(signal.SIGKILL)[0] == -signal.SIGKILL
    for _ in range(2):
        srv = Served(cache, log)
        try:
            assert "disk cache:" in srv.lines[1] and "(0 prefixes" not in srv.lines[1]
            messages.append(long_question(len(messages)))
            r = srv.ask(messages)
            answer = r.choices[0].message.content
            assert answer == fresh_answer(tiny, messages, max_tokens=4)
            assert r.usage.prompt_tokens_details.cached_tokens >= before
            before = prompt_of(tiny, messages).boundaries.generation_start
            messages.append({"role": "assistant", "content": answer})
        finally:  # SIGTERM at once: what is still queued is written before the exit
            pid = srv.proc.pid
            rc, rest = srv.stop(signal.SIGTERM)
            # A graceful shutdown (uvicorn's), then the engine closed: exit status 0.
            assert rc == 0 and f"Finished server process [{pid}]" in log.read_text()
            assert re.search(r"stopped by SIGTERM; disk cache closed, [1-9]\d* prefixes", rest)
    assert not list(cache.glob("*/*.tmp"))


_SESSION_CHILD = """
import json, os, sys
import engine
e = engine.load("tiny", cache_dir=sys.argv[1])
s = e.session(sys.argv[2])
turns = [s.send(q, max_tokens=4) for q in json.loads(sys.argv[3])]
e.disk.flush()
print(json.dumps({"history": s.history, "prompt_ids": turns[-1].prompt_ids}), flush=True)
os._exit(0)  # no clean shutdown: only the per-turn writes are on disk
"""


def test_sessions_reuse_from_disk_in_a_new_process(tiny, tmp_path):
    """A session in one process (ended without a shutdown); in a new process a session with
    the same conversation, and Engine.chat, both resume from disk, exactly."""
    cache = tmp_path / "cache"
    questions = [long_question(n)["content"] for n in range(3)]
    child = subprocess.run(
        [sys.executable, "-c", _SESSION_CHILD, str(cache), SYSTEM["content"],
         json.dumps(questions)],
        capture_output=True, text=True, timeout=300, env=os.environ,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    done = json.loads(child.stdout)
    last = prompt_of(tiny, [SYSTEM, *[m for ex in done["history"] for m in ex]][:-1])
    assert last.ids == done["prompt_ids"]  # the render a resent conversation shares
    start = last.boundaries.generation_start
    e = engine.load("tiny", cache_dir=cache)
    try:
        s = e.session(SYSTEM["content"])
        s.history = done["history"]
        turn = s.send(QUESTIONS[9], max_tokens=4)
        assert e.disk.reads == 1 and turn.stats.reused_tokens >= start
        assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, 4)[0]
        messages = [SYSTEM, *[m for ex in done["history"] for m in ex], long_question(7)]
        answer = e.chat(messages, max_tokens=4, warm=False)
        assert e.stateless.pool.restores == 1 and answer.stats.reused_tokens >= start
        assert answer.token_ids == fresh_greedy(tiny, answer.prompt_ids, 4)[0]
    finally:
        e.close()


def test_warm_prompts_come_back_from_disk_after_a_restart(tmp_path):
    """--warm-prompts with a disk tier: the second start reads them instead of prefilling."""
    cache, warm = tmp_path / "cache", [[SYSTEM, long_question(5)]]
    for start in range(2):
        e = engine.load("tiny", cache_dir=cache)
        config = ServerConfig(port=0, context_window=4096, warm=False, warm_prompts=warm)
        with BackgroundServer(e, config):
            restores, reads = e.stateless.pool.restores, e.disk.reads
        e.close()
        assert (restores, reads) == ((0, 0) if start == 0 else (1, 1))


def test_a_second_server_on_the_folder_is_refused_before_loading(tmp_path):
    """A second `chatml serve` on a held folder exits 1 naming it, before the model loads: its
    --model is a folder that fails to load (shown), so reaching the load would say so."""
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        engine.load(not_a_model)
    held = FolderLock(tmp_path / "cache")
    try:
        with pytest.raises(DiskCacheBusy, match="in use"):  # the Python API: the same order
            engine.load(not_a_model, cache_dir=held.dir)
        second = subprocess.run(
            [sys.executable, "-m", "engine.cli", "serve", "--model", str(not_a_model),
             "--port", "0", "--cache-dir", str(held.dir)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        held.release()
    assert second.returncode == 1, second.stderr
    assert "chatml serve: error:" in second.stderr and "in use by another process" in second.stderr
    assert "config.json" not in second.stderr + second.stdout  # it never tried to load
    with pytest.raises(CheckpointError):  # and the failed start left the folder free
        engine.load(not_a_model, cache_dir=held.dir)
    FolderLock(held.dir).release()


def test_a_cache_folder_that_cannot_be_made_is_an_error_before_loading(tmp_path):
    """A --cache-dir that cannot be a folder (a file there; read-only, or no such disk alike)
    ended `chatml serve` with a traceback from the folder lock, not an error naming it."""
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("mine")
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(tmp_path / "none"),
         "--port", "0", "--cache-dir", str(not_a_folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert (
        f"chatml serve: error: the disk cache {not_a_folder}" in r.stderr
        and "--no-disk-cache" in r.stderr
    )
    assert not_a_folder.read_text() == "mine"


def test_session_evicted_to_disk_and_back_gives_the_same_answer(tiny, eng, disk):
    s = eng.session(SYSTEM["content"])
    first = s.send(long_question(2)["content"], max_tokens=4)
    eng.budget.max_bytes = 1  # everything leaves RAM, to disk
    try:
        eng.budget.enforce()
        assert not s.seq.cache_bytes
        disk.flush()  # a lookup sees written entries only
        second = s.send(QUESTIONS[4], max_tokens=4)
    finally:
        eng.budget.max_bytes = 1 << 40
    assert disk.reads == 1
    start = prompt_of(eng, [SYSTEM, long_question(2)]).boundaries.generation_start
    assert first.prompt_ids[:start] == second.prompt_ids[:start]
    assert second.stats.reused_tokens >= start
    assert second.token_ids == fresh_greedy(tiny, second.prompt_ids, 4)[0]


def test_the_cache_folder_and_its_entries_are_the_users_alone(eng, tmp_path):
    """States computed from conversations: 0700 folders and 0600 entries even under umask 0."""
    old = os.umask(0)
    try:
        disk = eng.attach_disk(tmp_path / "cache", 1 << 30, min_tokens=8)
        eng.chat(conversation(0), max_tokens=2, warm=False)
        disk.flush()
    finally:
        os.umask(old)
        eng.detach_disk()
    entries = list(disk.ns.glob("*.safetensors"))
    assert entries, "the turn kept no entry on disk"
    for folder in (disk.dir, disk.ns):
        assert (folder.stat().st_mode & 0o777) == 0o700, folder
    for entry in entries:
        assert (entry.stat().st_mode & 0o777) == 0o600, entry
