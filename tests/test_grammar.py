"""engine.runtime.grammar: constrained answers always match their constraint.

The reference is independent of the engine: `json` + `jsonschema` for JSON Schema answers,
`re.fullmatch` for regular expressions.
"""

from __future__ import annotations

import json
import random
import re
import threading
import types

import jsonschema
import pytest

from engine.runtime import grammar
from engine.runtime.generate import decode, prefill
from engine.runtime.grammar import GrammarError, GrammarProcessor
from engine.runtime.sampling import Sampler, SamplingParams

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance")

PROMPT = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]


def _answer(eng, spec, params: SamplingParams, max_tokens: int = 160, start_after=None):
    processor = GrammarProcessor(eng, spec, start_after=start_after)
    sampler = Sampler(params, [processor])
    caches = eng.model.make_caches()
    logits, _ = prefill(eng.model, caches, PROMPT, 0)
    ids = list(decode(eng.model, caches, logits, sampler, max_tokens=max_tokens,
                      stop_ids=eng.stop_ids, history=list(PROMPT)))  # fmt: skip
    stopped = bool(ids) and ids[-1] in eng.stop_ids
    return eng.tokenizer.decode(ids[:-1] if stopped else ids), stopped, processor


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON Schema whose instances are short (bounded strings, arrays, numbers)."""
    kinds = ["string", "integer", "enum", "boolean", "number"] + (
        ["object", "array"] if depth < 2 else []
    )
    kind = rng.choice(kinds)
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(0, 6)}
        if rng.random() < 0.3:
            s = {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]$"])}
        return s
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["id", "name", "tags", "price", "ok", "kind"], rng.randint(1, 3))
    props = {n: _schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": rng.sample(names, rng.randint(0, len(names)))}  # fmt: skip


@pytest.mark.parametrize("block", range(8))
def test_constrained_answers_parse_and_validate(tiny, block):
    """200 random schemas (25 per block), each answered greedily and at temperature 1: every
    answer ends (the schemas bound their instances) and validates."""
    for seed in range(25 * block, 25 * block + 25):
        schema = _schema(random.Random(seed))
        spec = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=seed)):
            text, stopped, processor = _answer(tiny, spec, params)
            assert stopped and processor.complete, (schema, text)
            jsonschema.validate(json.loads(text), schema)


def test_json_object_and_regex(tiny):
    text, stopped, _ = _answer(
        tiny, {"type": "json_object"}, SamplingParams(temperature=1.0, seed=3)
    )
    if stopped:
        assert isinstance(json.loads(text), dict)
    for seed in range(4):
        text, stopped, _ = _answer(tiny, {"type": "regex", "regex": r"(yes|no), [0-9]{1,3}"},
                                   SamplingParams(temperature=1.0, seed=seed), max_tokens=12)  # fmt: skip
        assert stopped and re.fullmatch(r"(yes|no), [0-9]{1,3}", text), text


def test_the_constraint_waits_for_the_think_block_to_close(tiny):
    think_end = tiny.tokenizer.token_id("</think>")
    processor = GrammarProcessor(tiny, {"type": "regex", "regex": "ok"}, start_after=think_end)
    import mlx.core as mx

    logits = mx.zeros((tiny.model.arch.vocab_size,))
    stops = sorted(tiny.stop_ids)
    for _ in range(2):  # thinking: only the stop tokens are masked (the answer must come)
        free = processor(logits, []).tolist()
        assert [i for i, v in enumerate(free) if v != 0] == stops
        assert all(free[i] == -float("inf") for i in stops)
        processor.accept(tiny.tokenizer.encode("some reasoning"))
    reasoning = tiny.tokenizer.encode("more")
    assert processor.allows([*reasoning, stops[0], think_end]) == len(reasoning)
    assert processor.allows([*reasoning, think_end]) == len(reasoning) + 1
    processor.accept([think_end])
    masked = processor(logits, [])
    allowed = [i for i, v in enumerate(masked.tolist()) if v == 0]
    assert allowed and all("ok".startswith(tiny.tokenizer.decode([i])) for i in allowed)


@pytest.mark.parametrize("spec", [{"type": "json_schema", "json_schema": {"schema": "x"}},
                                  {"type": "regex", "regex": "("}, {"type": "yaml"}])  # fmt: skip
def test_bad_constraints_are_named(tiny, spec):
    with pytest.raises(GrammarError):
        GrammarProcessor(tiny, spec)


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"a[^\s\S]b"])
def test_a_constraint_no_answer_can_match_is_refused_before_the_turn(tiny, regex):
    """A regex that matches nothing compiles, and its matcher allows only the stop token:
    the turn answered '' (finish "stop"), an answer the constraint does not match. It is a
    GrammarError at the call now, and the conversation is untouched."""
    session = tiny.session()
    with pytest.raises(GrammarError, match="no answer can match"):
        session.send("Hi", max_tokens=4, response_format={"type": "regex", "regex": regex})
    assert session.history == [] and session.tokens == []


# ----- llguidance's view of the tokenizer: built once, shared, ready before it is needed --


def test_llguidance_sees_the_engines_tokens(tiny):
    """Its tokens decode to what the engine's tokenizer decodes; text it tokenizes (the bytes
    a grammar forces) never becomes an added token such as `</tool_call>`."""
    llt = grammar.tokenizer_for(tiny)
    tok = tiny.tokenizer
    text = "Héllo, 世界! <tool_call> x</tool_call>\n\t</think> 3.14 🙂"
    ids = tok.encode(text)  # the engine's own encoding (added tokens as single ids)
    assert tok.token_id("</tool_call>") in ids
    assert llt.decode_bytes(ids).decode() == tok.decode(ids) == text
    added = set(tok.backend.get_added_tokens_decoder())
    assert all(llt.decode_bytes([i]).decode() == tok.decode([i]) for i in added)
    forced = llt.tokenize_str(text)
    assert not added & set(forced) and tok.decode(forced) == text


def test_the_tokenizer_is_built_once_and_shared(tiny, tiny_sequential):
    assert tiny_sequential.path == tiny.path
    assert grammar.tokenizer_for(tiny) is grammar.tokenizer_for(tiny_sequential)


class _Watched(threading.Event):
    """A build's `done` event that says when someone starts waiting on it unfinished."""

    waiting = threading.Event()

    def wait(self, timeout=None):
        if not self.is_set():
            _Watched.waiting.set()
        return super().wait(timeout)


class _WatchedBuild(grammar._Build):
    def __init__(self) -> None:
        super().__init__()
        self.done = _Watched()


def test_a_request_waits_for_the_background_build_instead_of_rebuilding(tiny, monkeypatch,
                                                                         tmp_path):  # fmt: skip
    fake = types.SimpleNamespace(path=str(tmp_path), model=tiny.model, stop_ids=tiny.stop_ids,
                                 tokenizer=tiny.tokenizer)  # fmt: skip
    started, release, calls = threading.Event(), threading.Event(), []

    def make(tokenizer, vocab, eos):
        if calls:  # a second build (the bug): let the test go on to fail on `calls`
            _Watched.waiting.set()
        calls.append(vocab)
        started.set()
        release.wait()
        return object()

    monkeypatch.setattr(grammar, "_make_tokenizer", make)
    monkeypatch.setattr(grammar, "_Build", _WatchedBuild)
    builder = grammar.prepare(fake)
    started.wait()
    got = []
    waiter = threading.Thread(target=lambda: got.append(grammar.tokenizer_for(fake)))
    waiter.start()
    try:
        _Watched.waiting.wait()  # the request is blocked on the build's event...
        assert calls == [tiny.model.arch.vocab_size] and not got  # ...and built nothing itself
    finally:
        release.set()
    builder.join()
    waiter.join()
    assert got == [grammar.tokenizer_for(fake)] and len(calls) == 1


def test_a_failed_build_is_raised_and_retried(tiny, monkeypatch, tmp_path):
    fake = types.SimpleNamespace(path=str(tmp_path), model=tiny.model, stop_ids=tiny.stop_ids,
                                 tokenizer=tiny.tokenizer)  # fmt: skip
    outcomes = [RuntimeError("no tokenizer"), "built"]

    def make(*_):
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(grammar, "_make_tokenizer", make)
    with pytest.raises(RuntimeError, match="no tokenizer"):
        grammar.tokenizer_for(fake)
    assert grammar.tokenizer_for(fake) == "built" and not outcomes


@pytest.mark.parametrize("prepare", [True, False])
def test_the_server_starts_the_build_at_start_up(tiny, monkeypatch, prepare):
    from engine.serving.server import BackgroundServer, ServerConfig

    started = []
    monkeypatch.setattr(grammar, "prepare", started.append)
    config = ServerConfig(port=0, warm=False, prepare_grammar=prepare)
    with BackgroundServer(tiny, config):
        assert started == ([tiny] if prepare else [])
