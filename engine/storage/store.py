"""Persistent conversations: an append-only turn log plus the engine's cache state on disk.

Layout of `<CHATML_HOME>/sessions/<id>/`:

- `log.jsonl`: one JSON record a line (a header, then turns, resets and option changes). Lines
  are appended with fsync and never rewritten, so a crash loses at most the line being
  written; a line that fails to write (disk full) is cut off again, so it is neither replayed
  nor glued to the next one. Each record carries a checksum of its own content; a line that does not parse or
  whose checksum fails is skipped with a warning, and the records around it are kept.
- `state.safetensors`: the caches after the last logged turn (the token ids, the live KV and
  recurrent caches, the recurrent arrays of every snapshot), written atomically. It is used only
  if it was made by the same weights and dtype, its checksum holds, and its token ids are the
  ones the last good log record names; otherwise the history is rebuilt from the log and the
  next turn prefills it. The log is the truth; the state is only ever a shortcut.
- `lock`: held (flock) while a process has the session open, so two never interleave.

A session folder, or a file in it, that is a symbolic link is refused, never followed: the
store reads, writes and deletes only inside `<CHATML_HOME>/sessions`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ..paths import PRIVATE_DIR, atomic_write, chatml_home
from .session_log import OPTIONS, SessionLog, encode_record, read_log
from .state_file import (
    FORMAT,
    VERSION,
    CapturedState,
    StateError,
    capture_state,
    decode_state,
    state_key,
)

LOG, STATE, LOCK = "log.jsonl", "state.safetensors", "lock"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class StoreWarning(UserWarning):
    """Damage that was survived: a skipped log line, an ignored state file."""


class SessionIdError(ValueError):
    """A session id that could escape the sessions folder or is not a plain name."""


class SessionBusy(RuntimeError):
    """The session is open in another process."""


def check_id(session_id: str) -> str:
    """Return `session_id` if it is a plain name: letters, digits, '.', '_', '-' (max 64)."""
    if not isinstance(session_id, str) or not _ID.fullmatch(session_id):
        raise SessionIdError(
            f"invalid session id {session_id!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no path separators, no '..')"
        )
    return session_id


# ----- the store ----------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _naming(path: Path):
    """Let an OSError of the block name `path` where it names no file (write, fsync)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def _default_warn(message: str) -> None:
    warnings.warn(message, StoreWarning, stacklevel=3)


class SessionStore:
    """The sessions under `<home>/sessions`: list, read, open (resume or create), remove."""

    def __init__(self, home: str | os.PathLike | None = None, *, warn=None):
        self.home = Path(home) if home is not None else chatml_home()
        self.root = self.home / "sessions"
        self.warn: Callable[[str], None] = _default_warn if warn is None else warn

    def path(self, session_id: str) -> Path:
        """The folder of `session_id`, validated to be a direct child of the sessions folder.

        A folder (or one of its files) that is a symbolic link or resolves elsewhere is refused
        with `SessionIdError`: following it would write or delete files outside the store.
        """
        p = self.root / check_id(session_id)
        if p.parent != self.root:  # belt and braces: the id pattern already rules this out
            raise SessionIdError(f"invalid session id {session_id!r}")
        for link in (p, p / LOG, p / STATE, p / LOCK):
            if link.is_symlink():
                raise SessionIdError(
                    f"session {session_id!r}: {link} is a symbolic link; refusing to follow it "
                    f"out of {self.root}"
                )
        if p.exists() and p.resolve().parent != self.root.resolve():
            raise SessionIdError(f"session {session_id!r}: {p} resolves outside {self.root}")
        return p

    def exists(self, session_id: str) -> bool:
        return (self.path(session_id) / LOG).is_file()

    def ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            if not _ID.fullmatch(p.name):
                continue
            try:
                self.path(p.name)
            except SessionIdError as e:  # a symlink: listed as a warning, never followed
                self.warn(f"skipped {e}")
                continue
            if (p / LOG).is_file():
                out.append(p.name)
        return sorted(out)

    def read(self, session_id: str) -> SessionLog:
        """The log of `session_id` (empty if there is none), without loading any model."""
        return read_log(self.path(session_id) / LOG, self.warn)

    def remove(self, session_id: str) -> None:
        path = self.path(session_id)
        if not path.is_dir():
            raise FileNotFoundError(f"no session {session_id!r}")
        with _locked(path, session_id):  # deleted before it is let go: nobody recreates it
            shutil.rmtree(path)

    def open(self, session_id: str, engine, *, model: str | None = None, **options):
        """Resume `session_id` (or create it) on `engine`: returns a `StoredSession`.

        `options` go to `Engine.session`; `system`, `max_exchanges` and `enable_thinking`
        default to the stored ones (None means "as stored"), and a change is logged.
        """
        stored = StoredSession(self, session_id, engine)
        new = stored.new  # under the lock: no other process can create it meanwhile
        try:
            stored._load(model, options)
        except BaseException:
            stored.discard(new)  # e.g. a bad option: a new one leaves no folder or log behind
            raise
        return stored

    def attach(self, session_id: str, session, turns=(), *, model: str | None = None):
        """Start persisting an in-memory `session` under a new id (`/save`).

        `turns` are the Turns of `session.history`'s exchanges where known (None elsewhere).
        """
        exists = FileExistsError(f"session {session_id!r} already exists")
        if self.exists(session_id):
            raise exists
        stored = StoredSession(self, session_id, session.engine)
        new = stored.new
        try:
            if not new:  # created by another process since the check above
                raise exists
            stored.session = session
            stored._create(model)
            turns = list(turns) + [None] * (len(session.history) - len(turns))
            last = len(session.history) - (0 if session.pending else 1)
            for i, (exchange, turn) in enumerate(zip(session.history, turns)):
                key = "live" if i == last else None  # the live caches follow the last one
                stored.append_turn(turn, messages=exchange, index=i, key=key)
            if session.pending:  # tool calls waiting for their results
                stored.append_turn(None, messages=session.pending, index=last, pending=True)
            stored.save_state()
        except BaseException:
            stored.discard(new)
            raise
        return stored


@contextlib.contextmanager
def _locked(path: Path, session_id: str):
    # A session holds a conversation: its folder and files are the user's alone (0700, 0600),
    # as a shell keeps its history.
    path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    path.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    f = _open_nofollow(path / LOCK, os.O_RDWR)  # held for the session's lifetime elsewhere
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise SessionBusy(f"session {session_id!r} is open in another process") from e
        yield f
    finally:
        f.close()


def _open_nofollow(path: Path, flags: int):
    """Open (creating) a binary file, refusing a symbolic link: the store writes only its own."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    return os.fdopen(fd, "r+b" if flags & os.O_RDWR else "ab")


class StoredSession:
    """One open persistent session: its `Session`, its log file and its state file."""

    def __init__(self, store: SessionStore, session_id: str, engine):
        self.store, self.id, self.engine = store, session_id, engine
        self.dir = store.path(session_id)
        self.session = None
        self.resumed_turns = 0  # exchanges rebuilt from the log
        self.state_loaded = False  # whether the caches came back from disk (no re-prefill)
        self.state_error: str | None = None
        self._n = 0  # turn records written so far (numbering)
        self._log = None
        self._saving: threading.Thread | None = None  # a background state write
        self._lock_cm = _locked(self.dir, session_id)
        self._lock = self._lock_cm.__enter__()

    # ----- opening ----------------------------------------------------------------------

    @property
    def new(self) -> bool:
        """Whether the session has no log yet (reliable while we hold its lock)."""
        return not (self.dir / LOG).exists()

    def discard(self, new: bool) -> None:
        """Close a session that failed to open; a `new` one is deleted first, while its lock
        still keeps any other process from creating it."""
        if new:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.close()

    def _load(self, model: str | None, options: dict) -> None:
        log = read_log(self.dir / LOG, self.store.warn)
        stored = log.options
        given = {k: options.pop(k, None) for k in ("system", "max_exchanges", "enable_thinking")}
        given["model"] = model
        chosen = {k: given[k] if given[k] is not None else stored.get(k) for k in OPTIONS}
        self.session = self.engine.session(
            chosen["system"],
            max_exchanges=6 if chosen["max_exchanges"] is None else chosen["max_exchanges"],
            enable_thinking=chosen["enable_thinking"],
            **options,
        )
        if not log.has_header:
            if log.records:
                self.store.warn(f"{self.dir / LOG}: header missing; keeping the turns")
            self._create(chosen["model"])
        else:
            self._open_log()
            changed = {k: v for k, v in given.items() if v is not None and v != stored.get(k)}
            if changed:
                self._append({"type": "options", **changed})
        self._n = log.turns
        for tmp in self.dir.glob(f".{STATE}.*.tmp"):  # left by a crash mid-save; we hold the lock
            tmp.unlink(missing_ok=True)
        self.session.history = [list(ex) for ex in log.history]
        self.session.pending = list(log.pending)  # tool calls still waiting for their results
        self.resumed_turns = len(log.history)
        self._load_state(log.state_key)

    def _load_state(self, key: str | None) -> None:
        path = self.dir / STATE
        if key is None or not path.exists():
            return
        try:
            # MLX arrays are made on the model thread, where the session's turns use them.
            self.engine.worker.call(self._adopt_state, path.read_bytes(), key)
        except Exception as e:  # whatever the damage, the log is the truth: rebuild from it
            self.state_error = str(e) if isinstance(e, StateError) else repr(e)
            self.store.warn(f"{path}: ignored ({e}); the history is rebuilt from the log")
            return
        self.state_loaded = True

    def _adopt_state(self, data: bytes, key: str) -> None:
        tokens, caches, snapshots = decode_state(data, self.engine, key)
        self.session.seq.load(tokens, caches, snapshots)

    def _create(self, model: str | None) -> None:
        s = self.session
        header = self._encode(  # first: a header that cannot be written leaves no file behind
            {
                "type": "session",
                "format": FORMAT,
                "version": VERSION,
                "id": self.id,
                "model": model or self.engine.entry.name,
                "fingerprint": self.engine.fingerprint,
                "system": s.system,
                "max_exchanges": s.max_exchanges,
                "enable_thinking": s.enable_thinking,
            }
        )
        self.dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        self._open_log()
        self._write(header)
        _fsync_dir(self.dir)
        _fsync_dir(self.store.root)

    def _open_log(self) -> None:
        path = self.dir / LOG
        self._log = _open_nofollow(path, os.O_WRONLY | os.O_APPEND)  # kept open while in use
        # A crash mid-line leaves no newline: end that line so the next record starts clean.
        if path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._write(b"\n")

    # ----- writing ----------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Append `data` to the log durably, or leave the log as it was and raise an OSError
        that names it: a torn line would swallow the next one, an unsynced one is replayed."""
        fd = self._log.fileno()
        with _naming(self.dir / LOG):
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)  # we hold the lock: nobody else appends
                raise

    @staticmethod
    def _encode(record: dict) -> bytes:
        return encode_record({**record, "time": time.time()})

    def _append(self, record: dict) -> None:
        data = self._encode(record)  # before writing: a record that cannot be encoded is no line
        if self._log is None:
            raise ValueError(f"session {self.id!r} is closed")
        self._write(data)

    def append_turn(self, turn, *, messages=None, index: int | None = None, key="live",
                    pending: bool | None = None) -> None:  # fmt: skip
        """Log a completed turn (call right after it finishes, before `save_state`).

        By default the exchange is the one the turn just added to the history (or the pending
        one, while tool calls wait for results: resumed as pending) and the state key names
        the live caches.
        """
        s = self.session
        if pending is None:
            pending = turn is not None and bool(turn.tool_calls) and messages is None
        if messages is None:
            messages = s.pending if pending else s.history[-1]
        if index is None:
            index = len(s.history) if pending else len(s.history) - 1
        self._n += 1
        record = {"type": "turn", "n": self._n, "index": index, "messages": messages}
        if pending:
            record["pending"] = True
        if turn is not None:
            record.update(
                prompt_ids=list(turn.prompt_ids),
                token_ids=list(turn.token_ids),
                finish_reason=turn.finish_reason,
                stats=turn.stats.to_dict(),
            )
            if turn.tool_call_error:
                record["tool_call_error"] = turn.tool_call_error
        if key == "live":
            key = state_key(s.seq.tokens) if s.seq.tokens else None
        record["state_key"] = key
        self._append(record)

    def record_reset(self) -> None:
        """Log that the conversation was forgotten (the system prompt stays)."""
        self._append({"type": "reset"})

    def save_state(self, *, background: bool = False) -> bool:
        """Write the live caches and snapshots atomically; False if there is nothing to save.

        The caches are copied out at once (the next turn may change them). With `background`
        the checksum, serialization and write run on a thread, so a chat shows its next prompt
        without waiting for the disk; a failure there is a warning (the log still holds the
        turn, and a resume then prefills it). The next save and `close` wait for that write.
        """
        seq = self.session.seq
        if not seq.tokens or self._log is None:
            return False
        # On the model thread, between its jobs: nothing moves the caches meanwhile, and the
        # arrays are read where they were made. The copy is numpy: any thread may write it.
        captured = self.engine.worker.call(capture_state, seq, self.engine)
        self.wait_saved()
        if not background:
            self._write_state(captured)
            return True
        self._saving = threading.Thread(
            target=self._write_state, args=(captured, True), name="chatml-save"
        )  # not a daemon: the interpreter finishes the write before it exits
        self._saving.start()
        return True

    def wait_saved(self) -> None:
        """Wait for a background state write to finish."""
        if self._saving is not None:
            self._saving.join()
            self._saving = None

    def _write_state(self, captured: CapturedState, background: bool = False) -> None:
        try:
            with _naming(self.dir / STATE):
                atomic_write(self.dir / STATE, captured.encode())
            _fsync_dir(self.dir)
        except OSError as e:
            if not background:
                raise
            self.store.warn(f"session {self.id!r}: state not saved ({e}); resuming will prefill")

    def close(self) -> None:
        self.wait_saved()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)
            self._lock_cm = None

    def __enter__(self) -> StoredSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
