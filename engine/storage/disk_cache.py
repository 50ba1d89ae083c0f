"""The disk tier of the prefix cache: cached token prefixes that left RAM, as state files.

An entry is one token prefix with everything needed to resume after it (the attention KV rows
and the recurrent state at its end), encoded by `state_file` (the CLI's persisted sessions use
the same code). Entries live in `DIR/<namespace>/<n>-<key>.safetensors`: the namespace names
the weights (fingerprint), the dtype and the tokenizer files, the key is the content hash of
the `n` token ids. So a lookup needs no file reads: hash the prompt's first `n` ids for each
length `n` on disk.

Writes are atomic (temporary file, fsync, rename), so a crash leaves at most a temporary file,
which is never indexed and is deleted at the next start. Every read is checked in full by
`decode_state` (format, fingerprint, dtype, checksum, token key, layer shapes); an entry that
fails is deleted with a warning and the request prefills instead. One process owns a DIR at a
time (an exclusive lock on `DIR/lock`): a second one is refused with `DiskCacheBusy`, so two
servers never evict or write under each other.

What reaches disk: what the RAM budget evicts (`spill`), every pool sequence at a clean
shutdown (`Engine.save_pool`), and after each turn the point its conversation resumes from
(`keep_turn`: the answer's `<|im_start|>assistant\n` and the system block's end), so a process
killed with SIGKILL loses at most the last few turns. That per-turn write is bounded (`gap`):
a prefix of `n` tokens is written only if it holds at least `max(min_tokens, n / write_factor)`
tokens more than every entry already on disk (or queued) that is a prefix of it. So each such
entry holds at most `write_factor` times the tokens it adds, the lengths along a conversation
grow geometrically, all its per-turn entries together hold at most `write_factor` times the
KV rows of its longest one (plus one recurrent state each), and after a kill a conversation
re-prefills at most about 1/`write_factor` of itself (or `min_tokens`) beyond its last turn.

Threads: `store` copies the arrays out of MLX on the model thread (numpy from then on); a
writer thread checksums, encodes and writes; `lookup` and `restore` run on the model thread.
An entry still queued for writing is served too: `lookup` finds it, and `restore` builds the
caches from its numpy copy (no file read) until the writer has put its file in place.
The LRU size budget covers every entry under DIR (all namespaces), oldest use first.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import PRIVATE_DIR, atomic_write, chatml_home
from .state_file import (
    CapturedState,
    StateError,
    capture_state,
    decode_state,
    restore_captured,
    state_key,
)

log = logging.getLogger("chatml.disk_cache")

GiB = 1 << 30
DEFAULT_BYTES = 8 * GiB  # at most; never more than a tenth of the free space (default_bytes)
MIN_TOKENS = 32  # a shorter gain is prefilled: not worth a file read
WRITE_FACTOR = 8  # per-turn writes: see the module docstring
INITIAL_READ_BPS = 200e6  # until a read is measured: a slow SSD, read + checksum + decode
_NAME = re.compile(r"^(\d+)-([0-9a-f]{32})\.safetensors$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class DiskCacheError(RuntimeError):
    """The cache folder cannot be used: it cannot be made or opened, or it is busy."""


class DiskCacheBusy(DiskCacheError):
    """Another process holds the cache folder."""


class FolderLock:
    """The exclusive lock on a cache folder (`DIR/lock`), held until `release`.

    Taken on its own before a model loads (`engine.load(cache_dir=)`, `chatml serve`), so a
    second process on the folder is refused at once, not after a long load; the DiskCache
    made later takes it over."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.dir = Path(directory) if directory is not None else default_dir()
        try:
            self.dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)  # states of chats
            f = open(self.dir / "lock", "a+b")  # noqa: SIM115  (held until release)
        except OSError as e:  # a file there, read-only, no such disk: said before a load
            raise DiskCacheError(
                f"the disk cache {self.dir} cannot be used ({e}); give this one another "
                "--cache-dir or --no-disk-cache"
            ) from e
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise DiskCacheBusy(
                f"the disk cache {self.dir} is in use by another process; give this one another "
                "folder (--cache-dir; cache_dir= in Python) or none (--no-disk-cache; "
                "cache_dir=None)"
            ) from None
        self._file = f

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def default_dir() -> Path:
    return chatml_home() / "prefix-cache"


def default_bytes(directory: Path) -> int:
    """DEFAULT_BYTES, or a tenth of the free space on that disk if that is less."""
    directory.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(directory)
    return min(DEFAULT_BYTES, st.f_bavail * st.f_frsize // 10)


def namespace(engine) -> str:
    """Names what makes a state valid: the weights, the dtype, the tokenizer (and template)."""
    h = hashlib.sha256(f"{engine.fingerprint}|{engine.dtype}".encode())
    for name in _TOKENIZER_FILES:
        path = Path(engine.path) / name
        if path.is_file():
            h.update(name.encode() + b"|" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def worth_reading(nbytes: int, gain: int, read_bps: float, prefill_tps: float | None,
                  min_tokens: int = MIN_TOKENS) -> bool:  # fmt: skip
    """Is reading `nbytes` faster than prefilling the `gain` tokens it saves?"""
    if gain < min_tokens:
        return False
    return prefill_tps is None or nbytes / read_bps < gain / prefill_tps


def _delete(path: Path, what: str) -> None:
    """Delete an entry's file. One that cannot be (another user's in a shared folder, a
    read-only disk) is left, unindexed by the caller: never read again, nor counted."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("%s: not %s (%s); no longer indexed", path, what, e)


@dataclass
class Entry:
    path: Path
    tokens: int  # how many token ids it holds (0: another namespace's, never looked up)
    key: str
    nbytes: int
    used: float  # last use (file mtime): the LRU order
    # Queued for writing and not written yet: its arrays, restored from RAM meanwhile.
    captured: CapturedState | None = None


class DiskCache:
    """Cached prefixes on disk for one engine: `store`, `lookup`, `restore`; `close` at the end."""

    def __init__(self, engine, directory: str | os.PathLike | None = None,
                 max_bytes: int | None = None, *, min_tokens: int = MIN_TOKENS,
                 write_factor: int = WRITE_FACTOR, lock: FolderLock | None = None):  # fmt: skip
        """`lock`: the folder's lock if the caller took it already (released by `close`)."""
        if write_factor < 1:
            raise ValueError(f"write_factor must be >= 1, got {write_factor!r}")
        self.engine = engine
        self.dir = Path(directory) if directory is not None else default_dir()
        if lock is not None and (not lock.held or lock.dir.resolve() != self.dir.resolve()):
            raise ValueError(f"the lock given is not held on {self.dir}")
        self.min_tokens = min_tokens
        self.write_factor = write_factor
        self.read_bps = INITIAL_READ_BPS
        self.prefill_tps: float | None = None  # measured by the caller (observe_prefill)
        self.writes = self.reads = self.memory_reads = self.rejected = 0
        self._index: dict[Path, Entry] = {}
        self._guard = threading.Lock()  # the index: the writer thread adds, the model thread reads
        self._pending: dict[str, Entry] = {}  # queued for writing (their `captured` set)
        self._queue: queue.Queue = queue.Queue()
        self._lock = lock or FolderLock(self.dir)
        try:
            self.max_bytes = default_bytes(self.dir) if max_bytes is None else max_bytes
            self.ns = self.dir / namespace(engine)
            self.ns.mkdir(mode=PRIVATE_DIR, exist_ok=True)
            self._scan()
        except BaseException:
            self._lock.release()  # a folder this process cannot use is not kept from others
            raise
        self._writer = threading.Thread(target=self._write_loop, name="chatml-disk", daemon=True)
        self._writer.start()

    # ----- opening ----------------------------------------------------------------------

    def _scan(self) -> None:
        """Index every entry under DIR; delete temporary files a crash left (we hold the lock)."""
        for path in self.dir.glob("*/*"):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            m = _NAME.match(path.name)
            if m is None or not path.is_file():
                continue
            st = path.stat()
            ours = path.parent == self.ns
            self._index[path] = Entry(path, int(m[1]) if ours else 0, m[2], st.st_size,
                                      st.st_mtime)  # fmt: skip
        self._evict()  # a budget smaller than last time's holds from the start

    @property
    def entries(self) -> int:
        """Entries of this engine's namespace."""
        with self._guard:
            return sum(1 for e in self._index.values() if e.tokens)

    @property
    def nbytes(self) -> int:
        with self._guard:
            return sum(e.nbytes for e in self._index.values())

    # ----- writing (capture on the model thread, the rest on the writer) ----------------

    def _path(self, n: int, key: str) -> Path:
        return self.ns / f"{n}-{key}.safetensors"

    def store(self, seq, pos: int) -> bool:
        """Queue `seq`'s prefix of `pos` tokens (a snapshot position or its live end) for
        writing; False if it is already on disk or queued. Call on the model thread."""
        if pos < self.min_tokens:
            return False  # too short to be worth a read
        key = state_key(seq.prefix(pos))
        path = self._path(pos, key)
        with self._guard:
            if path in self._index:
                self._touch(self._index[path])
                return False
            if key in self._pending:
                return False
        captured = capture_state(seq, self.engine, pos)
        entry = Entry(path, pos, key, captured.nbytes, time.time(), captured)
        with self._guard:
            self._pending[key] = entry
        self._queue.put(entry)
        return True

    def store_sequence(self, seq, snapshots: int = 2) -> None:
        """Queue a sequence's live end and its `snapshots` deepest snapshots below it (where
        its conversation's next request resumes: the last answer's start)."""
        if not seq.tokens:
            return
        self.store(seq, len(seq.tokens))
        for p in sorted((p for p in seq.snapshots if p < len(seq.tokens)), reverse=True)[
            :snapshots
        ]:
            self.store(seq, p)

    def keep_turn(self, seq, positions) -> int:
        """After a turn, on the model thread: queue `seq`'s prefixes at `positions` (snapshot
        positions or its live end) that the write bound allows (module docstring): those
        with no entry on disk or queued within `gap(n)` tokens below. Returns how many were
        queued; a position `seq` holds no state for (evicted, never taken) is skipped."""
        queued = 0
        for pos in sorted({p for p in positions if p}):
            if pos > len(seq.tokens) or (pos < len(seq.tokens) and pos not in seq.snapshots):
                continue  # evicted (the spill kept it, if it was worth it) or never taken
            if self._holds(seq.prefix(pos), max(0, pos - self.gap(pos))):
                continue
            try:
                queued += self.store(seq, pos)
            except Exception as e:  # the disk tier is an optimisation: the turn stands
                log.warning("could not keep a turn's prefix on disk: %r", e)
        return queued

    def gap(self, n: int) -> int:
        """How many tokens a per-turn entry of `n` tokens must add over the entries below it."""
        return max(self.min_tokens, -(-n // self.write_factor))

    def _holds(self, ids, above: int) -> bool:
        """Is an entry on disk or queued, of more than `above` tokens, a prefix of `ids`?"""
        with self._guard:
            lengths = {e.tokens for e in self._index.values() if above < e.tokens <= len(ids)}
            keys = {e.key for e in self._index.values() if e.tokens in lengths}
            lengths |= {e.tokens for e in self._pending.values() if above < e.tokens <= len(ids)}
            keys |= set(self._pending)
        return any(state_key(ids[:n]) in keys for n in lengths)

    def spill(self, seq, pos: int | None) -> None:
        """CacheBudget's hook, before it evicts: a snapshot at `pos`, or (None) the live cache.
        Only sequences that can be restored from here spill (the pool's, sessions')."""
        if not getattr(seq, "spillable", False):
            return
        try:
            if pos is None:
                self.store_sequence(seq)
            else:
                self.store(seq, pos)
        except Exception as e:  # the disk tier is an optimisation: eviction goes on
            log.warning("could not keep an evicted prefix on disk: %r", e)

    def flush(self) -> None:
        """Wait until every queued entry is written."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception as e:  # whatever it was, the writer must outlive it: see flush
                log.warning("disk cache writer: %r", e)
            finally:
                self._queue.task_done()

    def _write(self, entry: Entry) -> None:
        """Write a queued entry, then index it; until then `lookup` finds it in `_pending`
        and `restore` takes its arrays from RAM (they are dropped once the file is in place)."""
        problem = self._put(entry)
        if problem is not None:
            log.warning("%s: not written (%s); that prefix will be prefilled", entry.path, problem)
            with self._guard:
                self._pending.pop(entry.key, None)
            return
        with self._guard:
            del self._pending[entry.key]
            entry.nbytes, entry.used = entry.path.stat().st_size, time.time()
            self._index[entry.path] = entry
            self.writes += 1
            self._evict()
        entry.captured = None  # a `restore` that took it as pending reads the file instead

    def _put(self, entry: Entry) -> str | None:
        """Encode and write an entry's file; why it was not written, if it was not."""
        try:
            data = entry.captured.encode()
            if len(data) > self.max_bytes:  # it would evict every other entry, then itself
                return f"{len(data)} bytes, more than the whole budget of {self.max_bytes}"
            atomic_write(entry.path, data)
        except Exception as e:  # disk full, no memory to encode: the writer must go on
            return f"{e.__class__.__name__}: {e}"
        return None

    def _evict(self) -> None:
        """Delete least recently used entries until the folder fits the budget (guard held)."""
        total = sum(e.nbytes for e in self._index.values())
        for entry in sorted(self._index.values(), key=lambda e: e.used):
            if total <= self.max_bytes:
                break
            _delete(entry.path, "evicted")
            del self._index[entry.path]
            total -= entry.nbytes

    def _touch(self, entry: Entry) -> None:
        entry.used = time.time()
        try:
            os.utime(entry.path, (entry.used, entry.used))  # the LRU order survives a restart
        except OSError:
            pass

    # ----- reading (model thread) --------------------------------------------------------

    def lookup(self, ids, *, above: int = 0, need_logits: bool = True) -> Entry | None:
        """The longest entry that is a prefix of `ids`, holds more than `above` tokens, and
        is worth reading instead of prefilling the difference; None if there is none."""
        limit = len(ids) - 1 if need_logits else len(ids)  # the last token's logits are needed
        with self._guard:
            held = [*self._index.values(), *self._pending.values()]
        ours = [e for e in held if above < e.tokens <= limit]
        by_length: dict[int, list[Entry]] = {}
        for e in ours:
            by_length.setdefault(e.tokens, []).append(e)
        for n in sorted(by_length, reverse=True):
            key = state_key(ids[:n])
            for e in by_length[n]:
                if e.key == key:
                    # A queued entry is a copy in RAM: no read to weigh against the prefill.
                    nbytes = 0 if e.captured is not None else e.nbytes
                    ok = worth_reading(nbytes, n - above, self.read_bps, self.prefill_tps,
                                       self.min_tokens)  # fmt: skip
                    return e if ok else None
        return None

    def restore(self, entry: Entry):
        """(tokens, caches) of an entry, checked in full; None (entry deleted) if unusable.
        An entry still queued for writing comes from its arrays in RAM (`memory_reads`)."""
        captured = entry.captured  # once: the writer drops it when the file is in place
        if captured is not None:
            try:
                tokens, caches, _ = restore_captured(captured, self.engine, entry.key)
            except StateError as e:  # not expected (this process made it): prefill instead
                log.warning("%s: queued entry not restored (%s)", entry.path, e)
                return None
            self.memory_reads += 1
            return tokens, caches
        t = time.perf_counter()
        try:
            data = entry.path.read_bytes()
            tokens, caches, _ = decode_state(data, self.engine, entry.key)
        except (FileNotFoundError, PermissionError) as e:  # gone, or another user's: left be
            log.warning("%s: not read (%s); no longer indexed", entry.path, e)
            with self._guard:
                self._index.pop(entry.path, None)
            return None
        except (MemoryError, OSError) as e:  # says nothing of the file: a later turn retries
            log.warning("%s: not read (%s: %s); kept", entry.path, e.__class__.__name__, e)
            return None
        except Exception as e:  # damage the decoder chokes on: prefill instead
            log.warning("%s: skipped and deleted (%s: %s)", entry.path, e.__class__.__name__, e)
            self.rejected += 1
            self._forget(entry)
            return None
        if len(tokens) != entry.tokens:
            log.warning("%s: skipped and deleted (holds %d tokens)", entry.path, len(tokens))
            self.rejected += 1
            self._forget(entry)
            return None
        elapsed = time.perf_counter() - t
        if elapsed > 0 and len(data) > 1 << 20:  # small reads measure latency, not speed
            self.read_bps = 0.5 * self.read_bps + 0.5 * len(data) / elapsed
        with self._guard:
            self._touch(entry)
        self.reads += 1
        return tokens, caches

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill's speed (the other side of `worth_reading`); long ones only."""
        if tokens >= 64 and seconds > 0:
            tps = tokens / seconds
            self.prefill_tps = tps if self.prefill_tps is None else 0.5 * (self.prefill_tps + tps)

    def _forget(self, entry: Entry) -> None:
        with self._guard:
            self._index.pop(entry.path, None)
        _delete(entry.path, "deleted")

    # ----- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the queued writes, stop the writer, release the folder."""
        if not self._lock.held:
            return
        self._queue.put(None)
        self._writer.join()
        self._lock.release()
