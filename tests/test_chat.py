"""`chatml chat` and `chatml sessions` end to end: the real CLI in a subprocess on `tiny`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest

from engine.chat import AnswerRejected, schema_validator
from engine.cli import main
from engine.storage.store import SessionStore

STATS = re.compile(r"^\[prompt (\d+) tok: reused (\d+), prefilled (\d+); generated (\d+);", re.M)
SYSTEM = "You are a helpful assistant."
QUESTIONS = ["Hi! My order number is 48213.", "What is my order number?", "你好", "Thanks!"]


def chatml(*args, stdin: str | bytes = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI with the test run's CHATML_HOME (so `tiny` is not rebuilt). With bytes
    (stdin or an argument) it talks bytes: stdout and stderr are decoded with "replace"."""
    raw = isinstance(stdin, bytes) or any(isinstance(a, bytes) for a in args)
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        input=stdin.encode() if raw and isinstance(stdin, str) else stdin,
        capture_output=True,
        text=not raw,
        timeout=timeout,
        env={**os.environ, "CHATML_HOME": os.environ["CHATML_HOME"]},
    )
    if raw:
        r.stdout, r.stderr = (b.decode("utf-8", "replace") for b in (r.stdout, r.stderr))
    return r


# Plain greedy decoding, whatever the model's generation_config.json recommends.
GREEDY = ("--temperature", "0", "--presence-penalty", "0")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def turns(sid: str) -> list[dict]:
    return [r for r in SessionStore().read(sid).records if r["type"] == "turn"]


def test_pipe_mode_answers_each_line_with_stats_and_logs_the_session():
    sid = new_id("pipe")
    r = chatml("chat", "--system", SYSTEM, "--max-tokens", "4", "--session", sid,
               stdin="\n".join(QUESTIONS[:3]) + "\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    stats = [tuple(map(int, m)) for m in STATS.findall(r.stdout)]
    assert len(stats) == 3
    prompt, reused, prefilled, generated = zip(*stats)
    assert prompt[0] < prompt[1] < prompt[2]  # the history grows
    assert reused[0] == 0 and all(u > 0 for u in reused[1:])  # and is reused
    assert all(p + f == t for p, f, t in zip(reused, prefilled, prompt))
    assert all(0 < g <= 4 for g in generated)
    log = turns(sid)
    assert [t["messages"][0]["content"] for t in log] == QUESTIONS[:3]
    assert [len(t["prompt_ids"]) for t in log] == list(prompt)
    assert [t["index"] for t in log] == [0, 1, 2]


def test_double_slash_sends_a_question_that_starts_with_a_slash():
    sid = new_id("slash")
    r = chatml("chat", "--max-tokens", "2", "--session", sid,
               stdin="/nonsense\n//etc/hosts is what?\n")  # fmt: skip
    assert r.returncode == 1, r.stderr  # the unknown command failed
    assert "unknown command /nonsense" in r.stderr
    assert len(STATS.findall(r.stdout)) == 1  # only the escaped line was a question
    assert [t["messages"][0]["content"] for t in turns(sid)] == ["/etc/hosts is what?"]


def test_no_history_sends_independent_prompts():
    r = chatml("chat", "--no-history", "--max-tokens", "3", stdin="Hello\nHello\nHello\n/save\n")
    assert r.returncode == 1, r.stderr  # the /save failed
    prompts = [int(m[0]) for m in STATS.findall(r.stdout)]
    assert len(prompts) == 3 and prompts[0] == prompts[1] == prompts[2]
    assert "--no-history keeps no conversation to save" in r.stderr


@pytest.mark.parametrize(
    "lines, message",
    [
        ("/bogus\n", "unknown command /bogus"),
        ("/regenerate\n", "error: there is no exchange to redo"),
        ("Hi\n/save other\n", "error: already saving as"),
        ("Hi\n/history\n/stats\n/help\n/save\n", None),  # all done: status 0
    ],
)
def test_a_failed_command_in_a_pipe_makes_the_exit_status_1(lines, message):
    r = chatml("chat", "--max-tokens", "2", "--session", new_id("cmd"), stdin=lines)
    if message is None:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1 and message in r.stderr, r.stderr


def test_no_history_with_a_session_is_refused_and_the_conversation_kept():
    sid = new_id("nh")
    first = chatml("chat", "--session", sid, "--max-tokens", "4", stdin="one\ntwo\nthree\n")
    assert first.returncode == 0, first.stderr
    before = (SessionStore().path(sid) / "log.jsonl").read_bytes()
    r = chatml("chat", "--session", sid, "--no-history", "--max-tokens", "4", stdin="q\n")
    assert r.returncode == 2 and "--no-history cannot be used with --session" in r.stderr
    assert (SessionStore().path(sid) / "log.jsonl").read_bytes() == before
    again = chatml("chat", "--session", sid, "--max-tokens", "4", stdin="four\n")
    assert "3 exchanges resumed" in again.stderr
    shown = json.loads(chatml("sessions", "show", sid, "--json").stdout)
    assert [ex[0]["content"] for ex in shown["history"]] == ["one", "two", "three", "four"]


def test_prompt_with_no_history_is_a_usage_error():
    r = chatml("chat", "-p", "Hi", "--no-history")
    assert r.returncode == 2
    assert "--no-history has no effect with -p" in r.stderr


@pytest.mark.parametrize(
    "command, flag, value, message",
    [
        ("chat", "--max-exchanges", "-1", "argument --max-exchanges: must be >= 0, got -1"),
        ("chat", "--max-tokens", "0", "argument --max-tokens: must be >= 1, got 0"),
        ("chat", "--max-tokens", "many", "argument --max-tokens: expected an integer, got 'many'"),
        ("chat", "--temperature", "-0.5", "argument --temperature: must be >= 0.0, got -0.5"),
        ("chat", "--temperature", "nan", "argument --temperature: expected a number, got 'nan'"),
        ("chat", "--max-thinking-tokens", "-5", "--max-thinking-tokens: must be >= 0, got -5"),
        ("serve", "--port", "70000", "argument --port: must be <= 65535, got 70000"),
        ("serve", "--max-tokens", "-5", "argument --max-tokens: must be >= 1, got -5"),
        ("serve", "--sequences", "0", "argument --sequences: must be >= 1, got 0"),
    ],
)
def test_bad_numbers_are_usage_errors(command, flag, value, message):
    r = chatml(command, flag, value, stdin="Hi\n")
    assert r.returncode == 2 and message in r.stderr


def test_zero_exchanges_keeps_no_history():
    r = chatml("chat", "--max-exchanges", "0", "--max-tokens", "2", stdin="Hello\nHello\n")
    assert r.returncode == 0, r.stderr
    (p1, _, _, _), (p2, _, _, _) = STATS.findall(r.stdout)
    assert p1 == p2  # the second prompt holds no earlier exchange (0 is not "the default")


def test_zero_exchanges_in_a_session_stays_zero_when_resumed():
    sid = new_id("mx0")
    r = chatml("chat", "--session", sid, "--max-exchanges", "0", "--max-tokens", "2", "-p", "Hi")
    assert r.returncode == 0, r.stderr
    again = chatml("chat", "--session", sid, "--max-tokens", "2", stdin="Hello\n")
    assert again.returncode == 0, again.stderr
    assert "max 0 exchanges" in chatml("sessions", "show", sid).stdout
    prompt = STATS.findall(again.stdout)[0][0]
    alone = chatml("chat", "--max-tokens", "2", "-p", "Hello")
    assert STATS.findall(alone.stdout)[0][0] == prompt  # the resumed question is on its own


def test_resume_in_a_new_process_equals_an_uninterrupted_run(tiny):
    sid = new_id("resume")
    opts = ("--system", SYSTEM, "--max-tokens", "5", "--session", sid, *GREEDY)
    first = chatml("chat", "--model", "tiny", *opts, stdin="\n".join(QUESTIONS[:3]) + "\n")
    assert first.returncode == 0, first.stderr
    second = chatml("chat", *opts, stdin=QUESTIONS[3] + "\n")
    assert second.returncode == 0, second.stderr
    assert "3 exchanges resumed, cache restored" in second.stderr
    ref = tiny.session(SYSTEM)
    expected = [ref.send(q, max_tokens=5) for q in QUESTIONS]
    log = turns(sid)
    assert [t["token_ids"] for t in log] == [t.token_ids for t in expected]
    resumed, uninterrupted = log[3]["stats"], expected[3].stats
    assert resumed["prefilled_tokens"] == uninterrupted.prefilled_tokens
    assert resumed["reused_tokens"] == uninterrupted.reused_tokens > resumed["prefilled_tokens"]


def test_json_schema_rejects_what_the_model_cannot_satisfy(tmp_path):
    sid = new_id("schema")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["answer"]}))
    ok = chatml("chat", "-p", "First", "--max-tokens", "3", "--session", sid)
    assert ok.returncode == 0, ok.stderr
    assert len(STATS.findall(ok.stdout)) == 1  # -p: one answer, one stats line
    before = SessionStore().read(sid).history
    r = chatml("chat", "--max-tokens", "3", "--session", sid, "--json-schema", str(schema),
               stdin="Answer in JSON\nAgain\n")  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.count("[rejected: the answer is not JSON") == 2
    assert not STATS.findall(r.stdout)
    after = SessionStore().read(sid)
    assert after.history == before and len(turns(sid)) == 1


def test_bad_schema_fails_before_loading(tmp_path):
    schema = tmp_path / "bad.json"
    schema.write_text(json.dumps({"type": 12}))
    r = chatml("chat", "-p", "x", "--json-schema", str(schema))
    assert r.returncode == 1 and "--json-schema" in r.stderr


def test_schema_validator_reports_where_the_answer_fails(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    validate = schema_validator(str(path))
    validate(SimpleNamespace(text='{"n": 3}'))
    with pytest.raises(AnswerRejected, match="at n: 'x' is not of type 'integer'"):
        validate(SimpleNamespace(text='{"n": "x"}'))
    with pytest.raises(AnswerRejected, match="not JSON"):
        validate(SimpleNamespace(text="hello"))


def test_sigkill_mid_answer_keeps_the_finished_turns(tiny):
    sid = new_id("kill")
    # tiny: its random weights answer at length, so the kill lands mid-answer; the resumed
    # session keeps the model it was made with
    first = chatml("chat", "--model", "tiny", "-p", "one", "--max-tokens", "2", "--session", sid)
    assert first.returncode == 0
    env = {**os.environ, "CHATML_HOME": os.environ["CHATML_HOME"]}
    child = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "chat", "--max-tokens", "400", "--session", sid],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        child.stdin.write(b"two\n")
        child.stdin.flush()
        child.stdout.read(1)  # the answer is streaming: the process is killed mid-turn
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    with SessionStore().open(sid, tiny) as s:
        assert [ex[0]["content"] for ex in s.session.history] == ["one"]
        assert s.state_loaded


def test_sessions_list_show_rm():
    sid = new_id("cmd")
    saving = chatml("chat", "--max-tokens", "2", "--system", "S",
                    stdin=f"Question one\n/save {sid}\nQuestion two\n")  # fmt: skip
    assert saving.returncode == 0 and f"saved session {sid}" in saving.stderr
    listed = chatml("sessions", "list")
    assert listed.returncode == 0 and sid in listed.stdout and "Question one" in listed.stdout
    shown = chatml("sessions", "show", sid)
    assert shown.returncode == 0 and "system: S" in shown.stdout
    assert "[1] user: Question one" in shown.stdout and "matches the last turn" in shown.stdout
    as_json = json.loads(chatml("sessions", "show", sid, "--json").stdout)
    assert as_json["system"] == "S" and len(as_json["history"]) == 2  # /save, then one more
    assert chatml("sessions", "rm", sid).returncode == 0
    assert sid not in chatml("sessions").stdout
    gone = chatml("sessions", "show", sid)
    assert gone.returncode == 1 and "no session" in gone.stderr


@pytest.mark.parametrize("bad", ["../x", "/etc", "a/b"])
def test_traversal_ids_are_usage_errors(bad):
    r = chatml("chat", "--session", bad, "-p", "hi")
    assert r.returncode == 2 and "invalid session id" in r.stderr
    r = chatml("sessions", "rm", bad)
    assert r.returncode == 2 and "invalid session id" in r.stderr


@pytest.mark.parametrize("name", ["log.jsonl", "lock"])
def test_a_session_file_that_cannot_be_opened_is_an_error_naming_it(name):
    """A session whose log (read before the model loads) or lock (taken after) cannot be
    opened - here a folder where the file should be; unreadable or on a broken disk alike -
    ended `chatml chat` with a traceback instead of an error."""
    sid = new_id("unopenable")
    path = SessionStore().path(sid) / name
    path.mkdir(parents=True)
    r = chatml("chat", "--session", sid, "--model", "tiny", "-p", "hi")
    assert r.returncode == 1 and f"chatml chat: [Errno 21] Is a directory: '{path}'" in r.stderr
    assert "Traceback" not in r.stderr and path.is_dir()


def test_sessions_rm_of_a_session_that_cannot_be_locked_is_an_error_naming_it():
    sid = new_id("unlockable")
    assert chatml("chat", "--session", sid, "--max-tokens", "2", stdin="Hello\n").returncode == 0
    lock = SessionStore().path(sid) / "lock"
    lock.unlink()
    lock.mkdir()
    r = chatml("sessions", "rm", sid)
    assert r.returncode == 1 and f"chatml sessions: [Errno 21] Is a directory: '{lock}'" in r.stderr
    assert "Traceback" not in r.stderr and SessionStore().exists(sid)


# ----- hardening: undecodable input, symlinks, limits, broken pipes ------------------------

BAD_BYTES = [b"\xff\xfe", b"caf\xe9", b"\xe4\xbd", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80"]


@pytest.mark.parametrize("bad", BAD_BYTES, ids=lambda b: b.hex())
def test_an_undecodable_pipe_line_is_one_error_and_the_rest_is_answered(bad):
    sid = new_id("utf8")
    r = chatml("chat", "--max-tokens", "3", "--session", sid,
               stdin=b"good\nbad " + bad + b" line\n/save " + bad + b"\nafter\n")  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "input line 2 is not valid UTF-8" in r.stderr
    assert "input line 3 is not valid UTF-8" in r.stderr
    assert len(STATS.findall(r.stdout)) == 2
    assert [t["messages"][0]["content"] for t in turns(sid)] == ["good", "after"]


@pytest.mark.parametrize(
    "args, flag",
    [
        (["-p", b"\xff"], "--prompt"),
        (["-p", b"caf\xe9?"], "--prompt"),
        (["--session", "S", "--system", b"caf\xe9"], "--system"),
        (["--session", b"s\xff", "-p", "hi"], "--session"),
        (["--model", b"/tmp/m\xe9", "-p", "hi"], "--model"),
    ],
)
def test_undecodable_arguments_are_usage_errors_that_write_nothing(args, flag):
    sid = new_id("arg")
    args = [sid if a == "S" else a for a in args]
    r = chatml("chat", *args)
    assert r.returncode == 2 and f"chatml chat: {flag} is not valid UTF-8" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not SessionStore().path(sid).exists()


def test_symlinked_session_folders_are_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "log.jsonl").write_text("precious\n")
    sid = new_id("link")
    root = SessionStore().root
    root.mkdir(parents=True, exist_ok=True)
    (root / sid).symlink_to(elsewhere, target_is_directory=True)
    try:
        for args in (["chat", "--session", sid, "-p", "hi", "--max-tokens", "2"],
                     ["sessions", "rm", sid], ["sessions", "show", sid]):  # fmt: skip
            r = chatml(*args)
            assert r.returncode == 2 and "is a symbolic link" in r.stderr, (args, r.stderr)
            assert "Traceback" not in r.stderr
        listed = chatml("sessions", "list")
        assert listed.returncode == 0 and sid not in listed.stdout
        assert [p.name for p in elsewhere.iterdir()] == ["log.jsonl"]
        assert (elsewhere / "log.jsonl").read_text() == "precious\n"
    finally:
        (root / sid).unlink()


@pytest.mark.parametrize("extra, verb", [(0, "fills"), (1, "exceeds"), (30_000, "exceeds")])
def test_max_tokens_beyond_the_context_window_is_a_usage_error(tiny, extra, verb):
    window, sid = tiny.entry.context_window, new_id("window")
    r = chatml("chat", "--model", "tiny", "--max-tokens", str(window + extra), "-p", "hi",
               "--session", sid)  # fmt: skip
    assert r.returncode == 2 and not SessionStore().path(sid).exists(), r.stderr
    assert (f"--max-tokens {window + extra} {verb} the context window of tiny ({window} tokens)"
            in r.stderr)  # fmt: skip
    assert "budget" not in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["sessions", "show", "SID", "--json"],
        ["sessions", "list"],
        ["sessions", "show", "SID"],
        ["models"],
        ["chat", "-p", "Hi", "--max-tokens", "3"],
    ],  # fmt: skip
)
def test_a_reader_that_goes_away_ends_the_command_quietly(args):
    sid = new_id("pipe")
    assert chatml("chat", "--session", sid, "--max-tokens", "2", stdin="Hello\n").returncode == 0
    child = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", *[sid if a == "SID" else a for a in args]],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "CHATML_HOME": os.environ["CHATML_HOME"]},
    )  # fmt: skip
    child.stdout.close()  # `| head -c 0`: every write the command makes finds no reader
    err = child.stderr.read().decode()
    assert child.wait(120) == 141 and err == "", err


# ----- a newcomer's rough edges -----------------------------------------------------------


def test_version_and_help_show_defaults():
    version = chatml("--version")
    assert version.returncode == 0 and re.fullmatch(r"chatml \d+\.\d+\.\d+\S*\n", version.stdout)
    help_text = " ".join(chatml("chat", "--help").stdout.split())
    for option, default in (("--max-tokens", "256"), ("--max-exchanges", "6"),
                            ("--model", "tiny")):  # fmt: skip
        assert re.search(rf"{option} \S+ .*?\(default: [^)]*{default}", help_text), option


def test_serve_help_shows_defaults():
    """`chatml serve --help` named no default for --port, --max-tokens or --num-draft."""
    help_text = " ".join(chatml("serve", "--help").stdout.split())
    for option, default in (("--port", "8080"), ("--max-tokens", "512"), ("--num-draft", "4"),
                            ("--max-batch", "8"), ("--pass-tokens", "256")):  # fmt: skip
        assert re.search(rf"{option} \S+ .*?default:? {default}\)", help_text), option


def test_bench_help_lists_every_benchmark():
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    runnable = {p.stem for p in bench.glob("*.py") if "\ndef main(" in p.read_text()}
    assert {"prefill", "report", "replay", "throughput", "kernels", "render"} <= runnable
    out = chatml("bench", "--help").stdout
    listed = set(re.findall(r"^  (\w+)  ", out, re.M))
    assert runnable <= listed, runnable - listed
    unknown = chatml("bench", "nope")
    assert unknown.returncode == 2 and "known: " in unknown.stderr and "prefill" in unknown.stderr


def test_bench_help_gives_each_benchmark_a_whole_summary():
    """The list showed each docstring's first line only: "grammar ... (and where the",
    "stall ... `python -m bench.stall [--model tiny". It shows the first paragraph."""
    out = chatml("bench", "--help").stdout.split("benchmarks (chatml bench NAME")[1]
    summaries: dict[str, str] = {}
    for line in out.splitlines()[1:]:
        if m := re.match(r"^  (\w+)  +(.*)", line):
            name = m.group(1)
            summaries[name] = m.group(2)
        elif line.strip():
            summaries[name] += " " + line.strip()
    assert {"grammar", "kernels", "stall"} <= set(summaries)
    for name, text in summaries.items():
        assert text.endswith(".") and text.count("[") == text.count("]"), (name, text)
    assert "--pass-tokens 128,256,512]" in summaries["stall"]


def test_a_bench_that_returns_its_results_exits_0_and_one_that_fails_exits_1(monkeypatch):
    """`chatml bench render` returns its results as a dict (sys.exit printed that dict to
    stderr and exited 1); a bench's own int status still passes through."""
    from bench import render

    assert main(["bench", "render"]) == 0
    monkeypatch.setattr(render, "main", lambda: 1)
    assert main(["bench", "render"]) == 1


def test_a_new_session_says_where_it_is_saved_and_show_has_no_none():
    sid = new_id("where")
    r = chatml("chat", "--session", sid, "--max-tokens", "2", stdin="Hello\n/stats\n")
    assert r.returncode == 0, r.stderr
    assert f"[session {sid}: new, saved in {SessionStore().path(sid)}]" in r.stderr
    assert "this run: 1 answer;" in r.stdout and "1 exchange in the conversation" in r.stdout
    assert "dropped 0 exchanges]" in r.stdout
    again = chatml("chat", "--session", sid, "--max-tokens", "2", stdin="Again\n")
    assert "new, saved" not in again.stderr and "1 exchange resumed" in again.stderr
    shown = chatml("sessions", "show", sid)
    assert "None" not in shown.stdout and "thinking the model's default" in shown.stdout
    assert f"{sid}" in chatml("sessions", "list").stdout


@pytest.mark.parametrize(
    "options, hint",
    [
        (("--temperature", "0"), "greedy decoding (--temperature 0) gives the same answer again"),
        (("--temperature", "0.8", "--seed", "3"), "a fixed --seed gives the same answer again"),
        (("--temperature", "0.8"), None),
    ],  # fmt: skip
)
def test_regenerate_says_when_it_will_give_the_same_answer(options, hint):
    sid = new_id("regen")
    r = chatml("chat", "--session", sid, "--max-tokens", "4", *options,
               stdin="Hello\n/regenerate\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    first, again = turns(sid)
    if hint is None:
        assert "same answer" not in r.stderr
    else:
        assert hint in r.stderr
        assert first["token_ids"] == again["token_ids"]  # and it is true


def test_a_resumed_chat_warms_before_the_first_question(tiny, tmp_path, monkeypatch):
    from engine.chat import Chat
    from engine.session import Session

    store = SessionStore(tmp_path, warn=lambda m: None)
    with store.open("w", tiny, system=SYSTEM) as stored:
        for q in QUESTIONS[:2]:
            stored.append_turn(stored.session.send(q, max_tokens=4))
        stored.save_state()
    # Warm synchronously: what the background thread does, done before the question arrives.
    monkeypatch.setattr(Session, "warm_in_background", lambda self: self.warm())
    args = SimpleNamespace(json_schema=None, max_tokens=4, temperature=0.0, seed=None,
                           no_history=False, stats=False, warm=True)  # fmt: skip
    with store.open("w", tiny) as stored:
        assert stored.state_loaded
        chat = Chat(args, tiny, stored.session, stored, store, "tiny", interactive=True)
        chat.run(iter([QUESTIONS[2]]))
    s = chat.last.stats
    assert s.warm_tokens > 0  # the re-rendered last answer was prefilled before the question
    new_message = len(tiny.tokenizer.encode(f"<|im_start|>user\n{QUESTIONS[2]}<|im_end|>\n"))
    assert s.prefilled_tokens <= new_message + 8  # the question and the generation prompt


def test_ctrl_c_as_the_answer_is_handed_over_is_not_recorded_anywhere(tiny, tmp_path,
                                                                      monkeypatch, capsys):  # fmt: skip
    """Ctrl+C that lands once the model thread has finished the answer (deterministically: as
    the caller's wait for it ends): "not recorded" is true of the session, its log and the
    conversation the next prompt holds; /regenerate leaves the question once."""
    from engine.chat import Chat
    from engine.runtime.worker import ModelThread

    real_iterate = ModelThread.iterate

    def interrupted(self, make):
        yield from real_iterate(self, make)  # the job ran to its end and returned
        raise KeyboardInterrupt

    store = SessionStore(tmp_path, warn=lambda m: None)
    args = SimpleNamespace(json_schema=None, max_tokens=4, temperature=0.0, seed=None,
                           no_history=False, stats=False, warm=False)  # fmt: skip
    with store.open("ki", tiny, system=SYSTEM) as stored:
        s = stored.session
        chat = Chat(args, tiny, s, stored, store, "tiny", interactive=False)
        assert chat.ask(QUESTIONS[0])
        monkeypatch.setattr(ModelThread, "iterate", interrupted)
        assert not chat.ask(QUESTIONS[1])
        chat.command("/regenerate")
        monkeypatch.undo()
        assert capsys.readouterr().err.count("[interrupted: the question was not recorded]") == 2
        assert [ex[0]["content"] for ex in s.history] == QUESTIONS[:1] and len(chat.turns) == 1
        assert chat.ask(QUESTIONS[1])
        prompt = tiny.tokenizer.decode(chat.last.prompt_ids)
    assert [ex[0]["content"] for ex in store.read("ki").history] == QUESTIONS[:2]
    assert all(prompt.count(q) == 1 for q in QUESTIONS[:2])


def test_a_disk_error_while_saving_is_an_error_and_the_chat_goes_on(tiny, tmp_path, monkeypatch,
                                                                     capsys):  # fmt: skip
    """Disk full while logging a turn, a /reset or a /save raised out of Chat: `chatml chat`
    died with a traceback and the conversation in memory was lost with it. Each is now an
    error naming the file; the answer stays in the conversation, /reset changes nothing."""
    from engine.chat import Chat

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    store = SessionStore(tmp_path, warn=lambda m: None)
    args = SimpleNamespace(json_schema=None, max_tokens=4, temperature=0.0, seed=None,
                           no_history=False, stats=False, warm=False)  # fmt: skip
    log = store.path("full") / "log.jsonl"
    with store.open("full", tiny, system=SYSTEM) as stored:
        chat = Chat(args, tiny, stored.session, stored, store, "tiny", interactive=False)
        assert chat.ask(QUESTIONS[0])
        stored.wait_saved()
        before = log.read_bytes()
        monkeypatch.setattr(os, "fsync", disk_full)
        assert chat.ask(QUESTIONS[1])  # answered: kept in this conversation, not logged
        chat.command("/reset")
        chat.command("/save")
        monkeypatch.undo()
        assert [ex[0]["content"] for ex in chat.session.history] == QUESTIONS[:2]
        assert log.read_bytes() == before and chat.failures == 3
        err = capsys.readouterr().err
        assert err.count(f"No space left on device: '{log}'") == 2
        assert "error: the answer stands but is not saved: [Errno 28]" in err
        assert "error: /reset failed, nothing cleared: [Errno 28]" in err
        assert f"No space left on device: '{log.parent / 'state.safetensors'}'" in err
        assert chat.ask(QUESTIONS[2])  # room again: logged
    assert [ex[0]["content"] for ex in store.read("full").history] == [QUESTIONS[0], QUESTIONS[2]]
    chat = Chat(args, tiny, tiny.session(SYSTEM), None, store, "tiny", interactive=False)
    assert chat.ask(QUESTIONS[0])
    monkeypatch.setattr(os, "fsync", disk_full)
    chat.command("/save new")  # attach: the header cannot be written
    monkeypatch.undo()
    assert chat.stored is None and chat.failures == 1 and not store.path("new").exists()
    assert "No space left on device" in capsys.readouterr().err


def test_save_under_an_id_another_process_is_creating_is_an_error(tiny, tmp_path, capsys):
    """/save NAME while another process holds NAME but has not written its log yet raised
    SessionBusy out of Chat: the chat ended and the conversation was lost."""
    from engine.chat import Chat
    from engine.storage.store import _locked

    store = SessionStore(tmp_path, warn=lambda m: None)
    args = SimpleNamespace(json_schema=None, max_tokens=4, temperature=0.0, seed=None,
                           no_history=False, stats=False, warm=False)  # fmt: skip
    chat = Chat(args, tiny, tiny.session(SYSTEM), None, store, "tiny", interactive=False)
    assert chat.ask(QUESTIONS[0])
    with _locked(store.path("taken"), "taken"):  # the other process, before its header
        chat.command("/save taken")
    assert chat.stored is None and chat.failures == 1 and len(chat.session.history) == 1
    assert "is open in another process" in capsys.readouterr().err


def test_sampling_defaults_come_from_the_checkpoint_and_flags_override_them(tiny, tmp_path):
    """A checkpoint whose generation_config.json asks for greedy decoding with penalties:
    `chatml chat` answers as the Python API does when given those values; a flag replaces
    one value; the Python API itself stays plain greedy."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny.path, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "presence_penalty": -1.0, "frequency_penalty": 0.3}
    ))  # fmt: skip
    question = "Say something again and again."

    def chat_tokens(*flags) -> list[int]:
        sid = new_id("defaults")
        r = chatml("chat", "--model", str(folder), "--max-tokens", "12", "--session", sid,
                   *flags, stdin=question + "\n")  # fmt: skip
        assert r.returncode == 0, r.stderr
        return turns(sid)[0]["token_ids"]

    def api_tokens(**options) -> list[int]:
        return tiny.session(None).send(question, max_tokens=12, **options).token_ids

    penalized = api_tokens(presence_penalty=-1.0, frequency_penalty=0.3)
    assert penalized != api_tokens()  # the defaults make a difference
    assert chat_tokens() == penalized
    assert chat_tokens("--presence-penalty", "0", "--frequency-penalty", "0") == api_tokens()
    assert chat_tokens("--frequency-penalty", "0") == api_tokens(presence_penalty=-1.0)


@pytest.mark.parametrize(
    "flags, words",
    [(("--top-p", "0"), "top_p must be in (0, 1]"), (("--min-p", "1"), "min_p"),
     (("--top-k", "1.5"), "expected an integer"), (("--presence-penalty", "3"), "<= 2.0"),
     (("--seed", "-1"), "seed must be an integer from 0 to 2**64-1")],
)  # fmt: skip
def test_bad_sampling_flags_are_usage_errors(flags, words):
    r = chatml("chat", "-p", "hi", *flags)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_json_schema_constrains_the_answer(tmp_path):
    """--json-schema constrains decoding: even random weights answer valid JSON."""
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    r = chatml("chat", "-p", "Answer", "--max-tokens", "16", "--json-schema", str(path))
    assert r.returncode == 0, r.stderr
    import jsonschema

    # The answer, before the stats line; the grammar lets it open with up to two newlines.
    answer = r.stdout.split("\n[prompt ")[0]
    jsonschema.validate(json.loads(answer), schema)
