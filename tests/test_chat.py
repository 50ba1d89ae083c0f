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
from engine.storage.store import SessionStore

STATS = re.compile(r"^\[prompt (\d+) tok: reused (\d+), prefilled (\d+); generated (\d+);", re.M)
SYSTEM = "You are a helpful assistant."
QUESTIONS = ["Hi! My order number is 48213.", "What is my order number?", "你好", "Thanks!"]


def chatml(*args, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI with the test run's CHATML_HOME (so `tiny` is not rebuilt)."""
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "CHATML_HOME": os.environ["CHATML_HOME"]},
    )


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
    assert r.returncode == 0, r.stderr
    assert "unknown command /nonsense" in r.stderr
    assert len(STATS.findall(r.stdout)) == 1  # only the escaped line was a question
    assert [t["messages"][0]["content"] for t in turns(sid)] == ["/etc/hosts is what?"]


def test_no_history_sends_independent_prompts():
    sid = new_id("nohist")
    r = chatml("chat", "--no-history", "--max-tokens", "3", "--session", sid,
               stdin="Hello\nHello\nHello\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    log = turns(sid)
    assert len(log) == 3 and len(STATS.findall(r.stdout)) == 3
    assert log[0]["prompt_ids"] == log[1]["prompt_ids"] == log[2]["prompt_ids"]
    assert [t["index"] for t in log] == [0, 0, 0]
    assert SessionStore().read(sid).history == [log[2]["messages"]]


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


def test_resume_in_a_new_process_equals_an_uninterrupted_run(tiny):
    sid = new_id("resume")
    opts = ("--system", SYSTEM, "--max-tokens", "5", "--session", sid, *GREEDY)
    first = chatml("chat", *opts, stdin="\n".join(QUESTIONS[:3]) + "\n")
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
    assert chatml("chat", "-p", "one", "--max-tokens", "2", "--session", sid).returncode == 0
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
