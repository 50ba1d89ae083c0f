"""The session log's format: one checksummed JSON record a line, replayed into a `SessionLog`.

Records: a `session` header (the options), `turn` (an exchange at an index of the history, with
the key of the caches after it; `pending` while tool results are awaited), `reset` and
`options`. A record carries `sum`, a checksum of its own content, so a torn or edited line is
recognised and skipped while the records around it are kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from renderer import RenderError, validate_exchange
from renderer.validation import validate_message

OPTIONS = ("model", "system", "max_exchanges", "enable_thinking")


def _checksum(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != "sum"}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode_record(record: dict) -> bytes:
    """One log line: the record with its checksum, newline-terminated UTF-8."""
    record = {**record, "sum": _checksum(record)}
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _exchange_problem(msgs, pending: bool) -> str | None:
    """Why a turn's messages are not an exchange the renderer accepts, or None: a user
    message, tool rounds, and the final answer (a pending one ends with its tool calls)."""
    if not isinstance(msgs, list) or not msgs:
        return "turn without messages"
    try:
        if not pending:
            validate_exchange(msgs, where="exchange")
            return None
        validate_exchange(msgs[:-1], complete=False, where="exchange")
        last = validate_message(msgs[-1], len(msgs) - 1, where="exchange")
        if last["role"] != "assistant" or not last.get("tool_calls"):
            return "invalid exchange: a pending turn must end with the assistant's tool calls"
    except (RenderError, TypeError, AttributeError) as e:
        return f"invalid exchange: {e}"
    return None


def _options_problem(rec: dict) -> str | None:
    """Why a header or options record holds an option of the wrong type, or None."""
    for key, ok in (("model", str), ("system", str), ("max_exchanges", int),
                    ("enable_thinking", bool)):  # fmt: skip
        value = rec.get(key)
        if value is None:
            continue
        if not isinstance(value, ok) or (ok is int and (isinstance(value, bool) or value < 0)):
            return f"bad option {key}={value!r}"
    return None


def _check_record(rec) -> str | None:
    """Why a parsed record is unusable, or None."""
    if not isinstance(rec, dict) or not isinstance(rec.get("type"), str):
        return "not a record"
    if "sum" in rec and rec["sum"] != _checksum(rec):
        return "checksum mismatch"
    if rec["type"] == "turn":
        if not isinstance(rec.get("index"), int) or rec["index"] < 0:
            return "turn without index"
        return _exchange_problem(rec.get("messages"), bool(rec.get("pending")))
    if rec["type"] in ("session", "options"):
        return _options_problem(rec)
    return None


@dataclass
class SessionLog:
    """What a log says: options, the conversation, and which state belongs after it."""

    options: dict = field(default_factory=dict)  # model, system, max_exchanges, enable_thinking
    history: list[list[dict]] = field(default_factory=list)
    pending: list[dict] = field(default_factory=list)  # the exchange awaiting tool results
    records: list[dict] = field(default_factory=list)  # good records, in order
    state_key: str | None = None  # key of the caches after the last good turn
    turns: int = 0  # turn records (including regenerated ones)
    skipped: int = 0  # damaged lines
    created: float | None = None
    updated: float | None = None

    @property
    def has_header(self) -> bool:
        return any(r.get("type") == "session" for r in self.records)


def read_log(path: Path, warn: Callable[[str], None]) -> SessionLog:
    """Replay a log; damaged lines are skipped with `warn`, everything else is kept."""
    log = SessionLog()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return log
    lines = data.split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
            why = _check_record(rec)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # junk nests deep
            rec, why = None, f"unreadable ({e.__class__.__name__})"
        if why is not None:
            last = lineno == len(lines) and not data.endswith(b"\n")
            where = "last line, cut short by a crash?" if last else f"line {lineno}"
            warn(f"{path}: skipped {where}: {why}")
            log.skipped += 1
            continue
        _apply(log, rec)
    return log


def _apply(log: SessionLog, rec: dict) -> None:
    kind = rec["type"]
    log.records.append(rec)
    when = rec.get("time")
    if isinstance(when, (int, float)):
        log.created = when if log.created is None else log.created
        log.updated = when
    if kind in ("session", "options"):
        log.options.update({k: rec[k] for k in OPTIONS if k in rec})
    elif kind == "reset":
        log.history, log.pending, log.state_key = [], [], None
    elif kind == "turn":
        log.turns += 1
        log.state_key = rec.get("state_key")
        if rec.get("pending"):  # waiting for tool results: not history yet, resumed as pending
            log.history, log.pending = log.history[: rec["index"]], rec["messages"]
        else:
            log.history = log.history[: rec["index"]] + [rec["messages"]]
            log.pending = []
