"""`chatml chat` and `chatml sessions`: conversations on a terminal or from a pipe, kept on disk.

On a terminal the answer streams as it is generated, input lines are edited and recalled with
`readline`, and Ctrl+C stops an answer (the question is then not recorded). From a pipe each
input line is one question, answered by its text and one line of token counts, so the command
scripts well. Lines starting with `/` are commands in both modes (`/help`); a question that
itself starts with `/` is typed with `//` (one `/` is removed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .args import (
    DefaultsFormatter,
    add_sampling_flags,
    add_shard_flags,
    add_speculative_flags,
    number,
    sampling_overrides,
    speculative_options,
)
from .checkpoints.registry import DEFAULT_MODEL

COMMANDS = {
    "/reset": "forget the conversation (the system prompt stays)",
    "/history": "show the exchanges (* marks those in the model's window)",
    "/stats": "token counts and timings of the last answer, and totals",
    "/regenerate": "answer the last question again (the same answer when greedy or seeded)",
    "/save": "/save [ID]: keep the conversation on disk (and keep saving it)",
    "/exit": "leave (so do Ctrl+D and Ctrl+C at the prompt)",
    "/help": "this list",
    "//...": "a question starting with '/': //etc/hosts sends /etc/hosts",
}


class AnswerRejected(ValueError):
    """The answer failed `--json-schema`: the turn is rolled back, the history unchanged."""


# ----- argument parsing ---------------------------------------------------------------------


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat with a model (interactive, or line by line from a pipe)",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    c.add_argument("--model", default=None,
                   help="registry alias, checkpoint folder or Hub id (default: the session's, or tiny-chat)")  # fmt: skip
    c.add_argument("--quantize", type=int, choices=[8, 4], default=None,
                   help="quantize a float checkpoint at load (bits; group 64)")  # fmt: skip
    c.add_argument("--system", default=None,
                   help="system prompt (default: the session's, or none)")  # fmt: skip
    c.add_argument("--max-exchanges", type=number(0), default=None,
                   help="exchanges kept in the window; 0: each question on its own, the history "
                        "still kept (default: the session's, or 6)")  # fmt: skip
    c.add_argument("--max-tokens", type=number(1), default=256, help="answer length limit")
    c.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for repeatable answers (default: random)")  # fmt: skip
    c.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="thinking mode (default: the model's)")  # fmt: skip
    c.add_argument("--session", default=None, metavar="ID",
                   help="resume or create the conversation ID, saved under CHATML_HOME/sessions")  # fmt: skip
    c.add_argument("--no-history", action="store_true",
                   help="every question on its own (not with --session or -p)")  # fmt: skip
    c.add_argument("--stats", action="store_true", help="print token counts and timings per turn")
    c.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="on a terminal, prefill the next prompt's known part while you type")  # fmt: skip
    c.add_argument("--json-schema", default=None, metavar="FILE",
                   help="answers are JSON valid against this JSON Schema (constrained "
                        "decoding, then checked)")  # fmt: skip
    c.add_argument(
        "--json",
        action="store_true",
        help="answers are a JSON object (constrained decoding, then checked)",
    )
    c.add_argument("--max-thinking-tokens", type=number(0), default=None, metavar="N",
                   help="close the think block after N tokens (thinking mode)")  # fmt: skip
    c.add_argument("-p", "--prompt", default=None, help="ask one question and exit")
    c.add_argument("--parse-special-in-content", action="store_true",
                   help="special tokens typed in messages (<|im_end|>...) become control tokens "
                        "(default: ordinary text)")  # fmt: skip
    add_sampling_flags(c, "every answer")
    add_speculative_flags(c)
    add_shard_flags(c)
    c.set_defaults(func=run_chat)


def add_sessions_parser(sub) -> None:
    s = sub.add_parser("sessions", help="list, show or remove saved conversations",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    s.add_argument("action", nargs="?", choices=["list", "show", "rm"], default="list")
    s.add_argument("id", nargs="?")
    s.add_argument("--json", action="store_true", help="machine-readable output (show)")
    s.set_defaults(func=run_sessions)


# ----- helpers ------------------------------------------------------------------------------


def _count(n: int, noun: str) -> str:
    """`1 answer`, `2 answers`."""
    return f"{n} {noun}{'s' * (n != 1)}"


def _stats_line(turn) -> str:
    s = turn.stats
    return (
        f"[prompt {s.prompt_tokens} tok: reused {s.reused_tokens}, prefilled "
        f"{s.prefilled_tokens}; generated {s.generated_tokens}; ttft {s.ttft_s * 1000:.0f} ms; "
        f"decode {s.decode_tps:.1f} tok/s; dropped {_count(s.dropped_exchanges, 'exchange')}]"
    )


class BadLine(str):
    """An input line that could not be decoded: its text is the error to report."""


def _decode_line(raw: str | bytes, number: int) -> str:
    """A line without its newline, or a `BadLine` if it is not UTF-8. A terminal's text (a
    str) carries undecodable bytes as surrogates (surrogateescape): they are checked too."""
    try:
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "surrogateescape")
        return raw.rstrip(b"\n").removesuffix(b"\r").decode("utf-8")
    except UnicodeError as e:
        byte = f"byte 0x{raw[e.start]:02x}" if isinstance(raw, bytes) else "a character"
        return BadLine(f"error: input line {number} is not valid UTF-8 ({byte} at offset "
                       f"{e.start}); skipped")  # fmt: skip


def _bad_text(args, names: tuple[str, ...]) -> str | None:
    """The first option whose value is not valid text (undecodable bytes in argv become lone
    surrogates), as a usage error, or None."""
    for name in names:
        value = getattr(args, name.lstrip("-").replace("-", "_"))
        try:
            if value is not None:
                value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{name} is not valid UTF-8 (an undecodable byte at character {e.start})"
    return None


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _shielded():
    """Ignore Ctrl+C while a write or a rollback completes (a half-done one would be worse)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def read_schema(path: str) -> dict:
    """The JSON Schema in `path` (SystemExit naming the file if unreadable)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"chatml chat: --json-schema {path}: {e}") from e


def schema_validator(path: str) -> Callable:
    """A `validate=` callable: the answer must be JSON valid against the schema in `path`."""
    try:
        import jsonschema
    except ImportError as e:
        raise SystemExit("chatml chat: --json-schema needs the jsonschema package") from e
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except (OSError, ValueError, jsonschema.SchemaError) as e:
        msg = getattr(e, "message", None) or str(e)
        raise SystemExit(f"chatml chat: --json-schema {path}: {msg}") from e
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def validate(turn) -> None:
        try:
            value = json.loads(turn.text)
        except ValueError as e:
            raise AnswerRejected(f"the answer is not JSON ({e})") from None
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "the top level"
            raise AnswerRejected(
                f"the answer does not match the schema at {where}: {error.message}"
            )

    return validate


def _object_validator(turn) -> None:
    """--json: the answer must be a JSON object."""
    try:
        value = json.loads(turn.text)
    except ValueError as e:
        raise AnswerRejected(f"the answer is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise AnswerRejected("the answer is not a JSON object")


# ----- the conversation ---------------------------------------------------------------------


class Chat:
    """One conversation on the command line: questions, slash commands, persistence."""

    def __init__(self, args, engine, session, stored, store, model: str, interactive: bool):
        self.args, self.engine, self.session = args, engine, session
        self.stored, self.store, self.model = stored, store, model
        self.interactive = interactive
        self.validate = schema_validator(args.json_schema) if args.json_schema else None
        # The model's recommended sampling, then the flags given (checked in run_chat).
        sampling = {**engine.sampling_defaults, **sampling_overrides(args)}
        self.options = dict(max_tokens=args.max_tokens, seed=args.seed, **sampling)
        # --json-schema and --json constrain decoding; the validator stays as a check.
        if args.json_schema:
            schema = {"name": "answer", "schema": read_schema(args.json_schema)}
            self.options["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif getattr(args, "json", False):
            self.options["response_format"] = {"type": "json_object"}
            self.validate = _object_validator
        if "response_format" in self.options:
            from .runtime.grammar import prepare

            prepare(engine)  # llguidance's tokenizer, built while the user types (seconds)
        if getattr(args, "max_thinking_tokens", None) is not None:
            self.options["max_thinking_tokens"] = args.max_thinking_tokens
        self.turns: list = [None] * len(session.history)  # Turns of the history's exchanges
        self.last = None
        self.totals = dict(turns=0, reused=0, prefilled=0, generated=0)
        self.failures = 0

    # ----- questions --------------------------------------------------------------------

    def ask(self, text: str) -> bool:
        """Answer `text`, streaming it; True if the exchange was recorded."""
        s, out = self.session, sys.stdout
        kept = (s.history, self.turns) if self.args.no_history else None
        if kept:
            s.history, self.turns = [], []  # the cache stays: the system prompt is reused
        turn, problem, stream, wrote = None, None, None, False
        try:
            stream = s.stream(text, validate=self.validate, **self.options)
            for item in stream:
                if isinstance(item, str):
                    out.write(item)
                    out.flush()
                    wrote = True
                else:
                    turn = item
        except KeyboardInterrupt:
            problem = "[interrupted: the question was not recorded]"
        except AnswerRejected as e:
            problem = f"[rejected: {e}; the question was not recorded]"
        except ValueError as e:  # bad input or a render error: nothing changed
            problem = f"error: {e}"
        finally:
            if stream is not None:
                with _shielded():
                    stream.close()  # an abandoned stream rolls the session back
        if wrote or turn is not None:
            out.write("\n")
            out.flush()
        if turn is None:
            if kept:
                s.history, self.turns = kept
            self.failures += 1
            _err(problem or "error: no answer")
            return False
        with _shielded():  # the turn is complete: keep it whole on disk
            if not turn.tool_calls:
                self.turns.append(turn)
            if self.stored is not None:
                self._persist("the answer stands but is not saved", self._log_turn, turn)
        self.last = turn
        t = self.totals
        t["turns"] += 1
        t["reused"] += turn.stats.reused_tokens
        t["prefilled"] += turn.stats.prefilled_tokens
        t["generated"] += turn.stats.generated_tokens
        if self.args.stats or not self.interactive:
            print(_stats_line(turn), file=sys.stderr if self.interactive else out, flush=True)
        return True

    def _log_turn(self, turn) -> None:
        self.stored.append_turn(turn)
        self.stored.save_state(background=True)  # the next prompt need not wait

    def _persist(self, failure: str, write, *args) -> bool:
        """Write to the session's files, shielded from Ctrl+C; a failure (disk full, a
        read-only folder) is an error that names the file, and the conversation goes on."""
        try:
            with _shielded():
                write(*args)
        except OSError as e:
            self._failed(f"error: {failure}: {e}")
            return False
        return True

    # ----- slash commands ---------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a slash command; False when the conversation should end."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            for cmd, what in COMMANDS.items():
                print(f"  {cmd:<12} {what}")
        elif name == "/reset":
            if self.stored is not None and not self._persist(
                "/reset failed, nothing cleared", self.stored.record_reset
            ):
                return True  # logged first: a reset the log does not hold is not done
            self.session.reset()
            self.turns = []
            _err("[conversation cleared]")
        elif name == "/history":
            self._history()
        elif name == "/stats":
            self._stats()
        elif name == "/regenerate":
            self._regenerate()
        elif name == "/save":
            self._save(arg or None)
        else:
            self._failed(f"unknown command {name} (/help lists them; //... sends a question "
                         "that starts with '/')")  # fmt: skip
        return True

    def _failed(self, message: str) -> None:
        """A command that could not do its work: said, and counted (the exit status)."""
        self.failures += 1
        _err(message)

    def _history(self) -> None:
        h = self.session.history
        if not h:
            print("(no exchanges yet)")
        first_in_window = max(0, len(h) - self.session.max_exchanges)
        for i, exchange in enumerate(h):
            mark = "*" if i >= first_in_window else " "
            for j, m in enumerate(exchange):
                label = f"{mark}[{i + 1}]" if j == 0 else " " * (len(str(i + 1)) + 3)
                print(f"{label} {m['role']}: {m.get('content') or ''}")

    def _stats(self) -> None:
        if self.last is None:
            print("(no answer yet)")
        else:
            print(_stats_line(self.last))
            st = self.last.stats
            print(f"  prefill {st.prefill_s * 1000:.0f} ms ({st.prefill_tps:.0f} tok/s), decode "
                  f"{st.decode_s * 1000:.0f} ms; cache {st.cache_bytes / 2**20:.1f} MiB")  # fmt: skip
        t = self.totals
        print(f"  this run: {_count(t['turns'], 'answer')}; reused {t['reused']}, prefilled "
              f"{t['prefilled']}, generated {t['generated']} tokens; "
              f"{_count(len(self.session.history), 'exchange')} in the conversation")  # fmt: skip
        if self.stored is not None:
            print(f"  session {self.stored.id}: {self.stored.dir}")

    def _regenerate(self) -> None:
        s = self.session
        if not s.history:
            self._failed("error: there is no exchange to redo")
            return
        o = self.options
        greedy = o.get("temperature", 0.0) == 0
        if greedy or o["seed"] is not None:  # the same prompt, the same tokens
            why = "greedy decoding (--temperature 0)" if greedy else "a fixed --seed"
            _err(f"[{why} gives the same answer again; --temperature > 0 without --seed varies it]")
        history, turns = list(s.history), list(self.turns)
        last = s.history.pop()
        if self.turns:
            self.turns.pop()
        if not self.ask(last[0]["content"]):  # the conversation as it was, the exchange once
            s.history[:], self.turns = history, turns

    def _save(self, session_id: str | None) -> None:
        from .storage.store import SessionBusy, SessionIdError

        if self.args.no_history:
            self._failed("error: --no-history keeps no conversation to save")
            return
        if self.stored is not None:
            if session_id and session_id != self.stored.id:
                self._failed(f"error: already saving as {self.stored.id!r}")
                return
            if self._persist("the cache state is not saved", self.stored.save_state):
                _err(f"[saved session {self.stored.id} in {self.stored.dir}]")
            return
        session_id = session_id or time.strftime("chat-%Y%m%d-%H%M%S")
        try:
            with _shielded():
                self.stored = self.store.attach(session_id, self.session, self.turns,
                                                model=self.model)  # fmt: skip
        except (SessionIdError, SessionBusy, OSError) as e:  # taken, or the disk: nothing kept
            self._failed(f"error: {e}")
            return
        _err(f"[saved session {session_id}: resume it with chatml chat --session {session_id}]")

    # ----- the loop ---------------------------------------------------------------------

    def run(self, lines: Iterator[str]) -> None:
        self._warm()  # a resumed conversation too: the first question waits only for itself
        for line in lines:
            if isinstance(line, BadLine):
                self.failures += 1
                _err(line)
            elif line.startswith("//"):
                self.ask(line[1:])
            elif line.startswith("/"):
                if not self.command(line):
                    return
            elif line.strip():
                self.ask(line)
            self._warm()

    def _warm(self) -> None:
        if self.interactive and self.args.warm and not self.args.no_history:
            # While the user reads and types: the next question waits only for itself.
            self.session.warm_in_background()


def _lines(interactive: bool) -> Iterator[str]:
    """Input lines; one that is not UTF-8 comes as a `BadLine` and the input goes on."""
    number = 0
    while True:
        number += 1
        try:
            # From a pipe: bytes, decoded line by line, so one bad line costs only itself.
            raw = input(">>> ") if interactive else sys.stdin.buffer.readline()
        except (EOFError, KeyboardInterrupt):  # Ctrl+D or Ctrl+C at the prompt: leave cleanly
            if interactive:
                print()
            return
        except UnicodeDecodeError as e:  # a terminal in a strict locale
            yield BadLine(f"error: input line {number} is not valid UTF-8 ({e.reason}); skipped")
            continue
        if not interactive and not raw:
            return
        yield _decode_line(raw, number)


@contextlib.contextmanager
def _readline(home: Path):
    """Line editing, and input history kept across runs in `<home>/chat_history`."""
    try:
        import readline
    except ImportError:  # not on every platform; input() still works
        yield
        return
    path = home / "chat_history"
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            home.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)


# ----- commands -----------------------------------------------------------------------------


def run_chat(args) -> int:
    if args.no_history and args.prompt is not None:
        _err("chatml chat: --no-history has no effect with -p (one question has no history)")
        return 2
    if args.no_history and args.session is not None:
        # Its questions are not a conversation: logged, they would replace the stored one.
        _err("chatml chat: --no-history cannot be used with --session (a session keeps "
             "its conversation); use --max-exchanges 0 to ask each question on its own")  # fmt: skip
        return 2
    bad = _bad_text(args, ("--prompt", "--system", "--session", "--model"))
    if bad:
        _err(f"chatml chat: {bad}")
        return 2
    try:
        sampling_overrides(args)
        if args.seed is not None:
            from .runtime.sampling import SamplingParams

            SamplingParams(seed=args.seed)  # MLX takes 0 to 2**64-1
    except ValueError as e:
        _err(f"chatml chat: error: {e}")
        return 2
    from .storage.store import SessionBusy, SessionIdError, SessionStore

    warned: set[str] = set()

    def warn(message: str) -> None:
        if message not in warned:  # the log is read twice (model choice, then open)
            warned.add(message)
            _err(f"warning: {message}")

    store = SessionStore(warn=warn)
    model = args.model
    if args.session is not None:
        try:
            store.path(args.session)  # a plain name, and no symbolic link to elsewhere
            model = model or store.read(args.session).options.get("model")
        except SessionIdError as e:
            _err(f"chatml chat: {e}")
            return 2
        except OSError as e:  # an unreadable log: it names itself
            _err(f"chatml chat: {e}")
            return 1
    model = model or DEFAULT_MODEL
    if Path(model).is_dir():
        model = str(Path(model).resolve())  # a folder: the session must find it from anywhere
    if args.json_schema:
        schema_validator(args.json_schema)  # a bad schema fails before the model loads
    import engine

    try:
        spec = speculative_options(args)
    except ValueError as e:  # before the model loads
        _err(f"chatml chat: {e}")
        return 2
    from .runtime.shard import ShardError

    try:  # with --shard, the other ranks serve rank 0 inside load and exit there
        eng = engine.load(model, quantize=getattr(args, "quantize", None), shard=args.shard, **spec)
    except ShardError as e:
        _err(f"chatml chat: {e}")
        return 3
    window = eng.entry.context_window  # what the session gets: no room left for the prompt?
    if args.max_tokens >= window:
        _err(f"chatml chat: --max-tokens {args.max_tokens} "
             f"{'exceeds' if args.max_tokens > window else 'fills'} the context window of "
             f"{model} ({window} tokens)")  # fmt: skip
        return 2
    stored = None
    special = "parse" if args.parse_special_in_content else "text"
    options = dict(system=args.system, max_exchanges=args.max_exchanges,
                   enable_thinking=args.thinking, special_tokens_in_content=special)  # fmt: skip
    if args.session is not None:
        new = not store.exists(args.session)
        try:
            stored = store.open(args.session, eng, model=model, **options)
        except (SessionBusy, OSError) as e:  # open elsewhere; or its files, which it names
            _err(f"chatml chat: {e}")
            return 1
        session = stored.session
        if new:
            _err(f"[session {stored.id}: new, saved in {stored.dir}]")
        elif stored.resumed_turns:
            how = ("cache restored" if stored.state_loaded
                   else "no usable cache state: the next turn prefills the history")  # fmt: skip
            n = stored.resumed_turns
            _err(f"[session {stored.id}: {n} exchange{'s' * (n != 1)} resumed, {how}]")
    else:
        if options["max_exchanges"] is None:
            options["max_exchanges"] = 6
        session = eng.session(options.pop("system"), **options)
    interactive = args.prompt is None and sys.stdin.isatty()
    chat = None
    try:
        chat = Chat(args, eng, session, stored, store, model, interactive)
        if args.prompt is not None:
            chat.ask(args.prompt)
        elif interactive:
            _err(f"chatml chat: {model}; /help for commands, Ctrl+C stops an answer, "
                 "Ctrl+D leaves")  # fmt: skip
            with _readline(store.home):
                chat.run(_lines(True))
        else:
            chat.run(_lines(False))
    except ShardError as e:  # a rank died or hangs: the answer cannot go on
        _err(f"chatml chat: {e}")
        return 3
    finally:
        session.stop_warm()  # no MLX work may outlive the interpreter
        for s in {stored, chat and chat.stored} - {None}:  # /save may have opened one
            s.close()
    return 1 if chat.failures and not interactive else 0


def run_sessions(args) -> int:
    from .storage.state_file import StateError, read_header
    from .storage.store import STATE, SessionBusy, SessionIdError, SessionStore

    store = SessionStore(warn=lambda m: _err(f"warning: {m}"))
    if args.action != "list" and not args.id:
        _err(f"chatml sessions {args.action}: a session id is required")
        return 2
    try:
        if args.action == "list":
            ids = store.ids()
            if not ids:
                print(f"no sessions in {store.root}")
            for sid in ids:
                log = store.read(sid)
                first = log.history[0][0].get("content", "") if log.history else ""
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(log.updated or 0))
                print(f"{sid:<24} {_count(len(log.history), 'exchange'):>13}  {when}  "
                      f"{log.options.get('model', '?')}  {first[:40]!r}")  # fmt: skip
            return 0
        if not store.exists(args.id):
            _err(f"chatml sessions: no session {args.id!r}")
            return 1
        if args.action == "rm":
            store.remove(args.id)
            print(f"removed session {args.id}")
            return 0
        log = store.read(args.id)
        path = store.path(args.id) / STATE
        try:
            key = read_header(path.read_bytes()).get("key") if path.exists() else None
            state = ("none" if not path.exists()
                     else "matches the last turn" if key and key == log.state_key
                     else "stale (not used)")  # fmt: skip
        except (OSError, StateError):
            state = "unreadable (not used)"
        if args.json:
            print(json.dumps({"id": args.id, **log.options, "history": log.history,
                              "turns": log.turns, "skipped_lines": log.skipped,
                              "state": state}, ensure_ascii=False, indent=1))  # fmt: skip
            return 0
        o = log.options
        think = {True: "on", False: "off"}.get(o.get("enable_thinking"), "the model's default")
        print(f"session {args.id}: model {o.get('model')}, max {o.get('max_exchanges')} "
              f"exchanges, thinking {think}; cache state: {state}")  # fmt: skip
        if o.get("system") is not None:
            print(f"system: {o['system']}")
        for i, exchange in enumerate(log.history):
            for m in exchange:
                label = f"[{i + 1}] {m['role']}" if m["role"] == "user" else f"    {m['role']}"
                print(f"{label}: {m.get('content') or ''}")
        return 0
    except SessionIdError as e:
        _err(f"chatml sessions: {e}")
        return 2
    except BrokenPipeError:
        raise  # the reader went away: the CLI ends quietly (141)
    except (SessionBusy, OSError) as e:  # open elsewhere; or its files, which it names
        _err(f"chatml sessions: {e}")
        return 1
