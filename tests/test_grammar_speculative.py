"""Constrained decoding under speculative decoding (issue 20's last piece).

References are independent of the speculative loop: plain constrained decoding (one step at
a time, the matcher advanced by each pick) after a fresh prefill, `jsonschema`, `re`, the
masked softmax of fixed logits computed here in float64, and a fresh prefill's caches.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from test_constrained import SCHEMA, TOOLS
from test_speculative import _assert_holds

from engine.runtime.generate import decode, prefill
from engine.runtime.grammar import GrammarProcessor, tool_call_spec
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.speculative import (
    DraftLength,
    InjectedDrafter,
    Speculation,
    SpeculationStats,
    speculative_decode,
    verify,
)
from engine.runtime.thinking import ThinkingBudget

pytest.importorskip("llguidance")

PROMPT = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]
REGEX = r"(yes|no), [0-9]{1,3}"
NESTED = {  # arrays, enums, a nested object, an optional key: all bounded, so answers close
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3},
                   "at": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                          "required": ["ok"], "additionalProperties": False},
                   "n": {"type": "number", "minimum": -1, "maximum": 1}},
    "required": ["tags", "at"], "additionalProperties": False,
}  # fmt: skip


def _tool_spec(eng) -> dict:
    tok = eng.tokenizer
    return tool_call_spec(TOOLS, tok.token_id("<tool_call>"), tok.token_id("</tool_call>"))


SPECS = {
    "json_schema": lambda eng: {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    "nested": lambda eng: {"type": "json_schema", "json_schema": {"schema": NESTED}},
    "regex": lambda eng: {"type": "regex", "regex": REGEX},
    "tool_choice_required": _tool_spec,
}


def _check_answer(eng, name: str, ids: list[int]) -> None:
    """The answer (stop token excluded) is what its constraint asks for."""
    assert ids and ids[-1] in eng.stop_ids, "the grammar closed the answer"
    text = eng.tokenizer.decode(ids[:-1])
    if name == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "nested":
        jsonschema.validate(json.loads(text), NESTED)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        from engine.turn import parse_tool_calls

        _, calls, error = parse_tool_calls(text)
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        assert error is None and len(calls) == 1, text
        jsonschema.validate(calls[0].arguments, by_name[calls[0].name])


def _sampler(eng, spec, params=None, *, budget=None, top_logprobs=None) -> Sampler:
    chain = []
    start_after = None
    if budget is not None:  # a think block: `</think>` forced after `budget` tokens
        start_after = eng.tokenizer.token_id("</think>")
        chain.append(ThinkingBudget(budget, start_after))
    chain.append(GrammarProcessor(eng, spec, start_after=start_after))
    return Sampler(params or SamplingParams(), chain, top_logprobs=top_logprobs)


def _plain(eng, make_sampler, n=60, ids=PROMPT):
    """Plain constrained decoding after a fresh prefill: (tokens, sampler)."""
    caches = eng.model.make_caches()
    logits, _ = prefill(eng.model, caches, ids, 0)
    sampler = make_sampler()
    out = list(decode(eng.model, caches, logits, sampler, max_tokens=n, stop_ids=eng.stop_ids,
                      history=list(ids)))  # fmt: skip
    return out, sampler


def _speculate(eng, make_sampler, drafter, k=4, n=60, ids=PROMPT):
    """Speculative constrained decoding: (tokens, caches, stats, sampler)."""
    caches = eng.model.make_caches()
    logits, _ = prefill(eng.model, caches, ids, 0)
    stats, sampler = SpeculationStats(), make_sampler()
    out = list(speculative_decode(
        eng.model, caches, logits, sampler, max_tokens=n, stop_ids=eng.stop_ids,
        history=list(ids), drafter=drafter, policy=DraftLength(k, adaptive=False), stats=stats,
    ))  # fmt: skip
    return out, caches, stats, sampler


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_constrained_speculation_equals_plain_constrained_decoding(tiny, name, rate):
    spec = SPECS[name](tiny)
    want, _ = _plain(tiny, lambda: _sampler(tiny, spec))
    _check_answer(tiny, name, want)
    drafter = InjectedDrafter(want, len(PROMPT), rate)
    out, caches, stats, sampler = _speculate(tiny, lambda: _sampler(tiny, spec), drafter)
    assert out == want
    assert sampler.processors[0].complete and sampler.processors[0].drafted == 0
    if rate == 0.0:  # every draft stood: drafting happened, and paid
        assert stats.drafted > 0 and stats.accepted == stats.drafted
        assert stats.tokens_per_verify > 2
    if rate == 1.0:
        assert stats.accepted == 0
    # every token but the stop is fed, as a fresh prefill would hold them
    _assert_holds(tiny.model, caches, PROMPT + out[:-1], out[-1])


class Spiked:
    """The plain answer's next token, then one the grammar refuses, then the right ones: a
    draft that must be cut after its first token."""

    def __init__(self, truth, prompt_len, bad):
        self.truth, self.prompt_len, self.bad = truth, prompt_len, bad

    def propose(self, history, k):
        at = len(history) - self.prompt_len
        assert list(history[self.prompt_len :]) == self.truth[:at]
        return [self.truth[at], self.bad, *self.truth[at + 1 : at + k - 1]][:k]


@pytest.mark.parametrize("name", ["json_schema", "tool_choice_required"])
def test_drafts_the_grammar_refuses_are_cut_before_verifying(tiny, name):
    spec = SPECS[name](tiny)
    want, _ = _plain(tiny, lambda: _sampler(tiny, spec))
    bad = tiny.tokenizer.token_id("<think>")  # no constrained answer holds it
    assert _sampler(tiny, spec).allowed([want[0], bad, want[1]]) == 1
    out, caches, stats, _ = _speculate(tiny, lambda: _sampler(tiny, spec),
                                       Spiked(want, len(PROMPT), bad))  # fmt: skip
    assert out == want
    # each verify checked one draft (the spike and what follows it were cut), which stood
    assert stats.verifies > 0 and stats.drafted == stats.accepted == stats.verifies
    assert stats.cut >= stats.verifies  # the spike at least, each time
    _assert_holds(tiny.model, caches, PROMPT + out[:-1], out[-1])


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_the_constraint_after_a_think_block_speculates_as_plain_decoding(tiny, rate):
    """Free reasoning, `</think>` forced by a budget inside a draft, then the grammar: the
    drafts cross the point where the constraint starts."""
    spec = SPECS["json_schema"](tiny)
    think_end = tiny.tokenizer.token_id("</think>")
    want, _ = _plain(tiny, lambda: _sampler(tiny, spec, budget=3))
    assert want[3] == think_end
    _check_answer(tiny, "json_schema", want[4:])
    out, caches, stats, _ = _speculate(tiny, lambda: _sampler(tiny, spec, budget=3),
                                       InjectedDrafter(want, len(PROMPT), rate))  # fmt: skip
    assert out == want and stats.accepted > 0
    _assert_holds(tiny.model, caches, PROMPT + out[:-1], out[-1])


class MaskDrafter:
    """Random tokens the grammar allows from here (its own matcher, seeded): drafts that
    stand at forced positions and mostly fail elsewhere, independent of the target's draws."""

    def __init__(self, eng, spec, prompt_len, seed):
        self.g = GrammarProcessor(eng, spec)
        self.prompt_len, self.seen, self.rng = prompt_len, 0, random.Random(seed)
        self.vocab = eng.model.arch.vocab_size

    def propose(self, history, k):
        new = list(history[self.prompt_len + self.seen :])
        self.g.accept(new)
        self.seen += len(new)
        saved, out = self.g.save(), []
        for _ in range(k):
            masked = np.array(self.g(mx.zeros((self.vocab,)), history))
            token = self.rng.choice(np.flatnonzero(masked == 0).tolist())
            out.append(token)
            if token in self.g.stops:
                break
            self.g.draft(token)
        self.g.restore(saved)
        return out


@pytest.mark.parametrize("name", ["json_schema", "regex", "tool_choice_required"])
def test_sampled_constrained_speculation_validates(tiny, name):
    spec = SPECS[name](tiny)
    accepted = 0
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed)
        drafter = MaskDrafter(tiny, spec, len(PROMPT), seed)
        out, caches, stats, _ = _speculate(tiny, lambda p=params: _sampler(tiny, spec, p),
                                           drafter, k=3, n=80)  # fmt: skip
        _check_answer(tiny, name, out)
        assert stats.drafted > 0
        accepted += stats.accepted
        _assert_holds(tiny.model, caches, PROMPT + out[:-1], out[-1])
    assert accepted > 0


def test_sampled_verify_keeps_the_masked_distribution_at_each_position(tiny):
    """verify() with a grammar on fixed logits: the first token follows the softmax over the
    tokens the grammar allows first, the one after an accepted first draft the softmax over
    those allowed after it (chi-square, seeded). A mask not advanced through the draft would
    let "a" follow "a"."""
    a, b, c, d = (tiny.tokenizer.token_id(x) for x in "abcd")
    spec = {"type": "regex", "regex": "a[bcd]|b[acd]"}
    letters = [a, b, c, d]
    logits = np.full((3, tiny.model.arch.vocab_size), -1e4, dtype=np.float32)  # others ~0
    # the most likely letter is one the grammar refuses there: "c" first, "a" after "a"
    logits[:, letters] = [[1.0, 0.2, 3.0, 0.0], [3.0, 0.5, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]]
    sampler = _sampler(tiny, spec, SamplingParams(temperature=1.0, seed=5))
    drafts = [a, b]
    assert sampler.allowed([c]) == 0 and sampler.allowed(drafts) == 2

    def masked(row, allowed):
        p = np.exp(logits[row, allowed].astype(np.float64) - logits[row, allowed].max())
        return allowed, p / p.sum()

    first, second = [], []
    for _ in range(400):  # ~50 ms each: three rows over the whole vocabulary
        accept, fallback = verify(sampler, mx.array(logits), drafts, PROMPT)
        first.append(drafts[0] if accept[0] else fallback[0])
        if accept[0]:
            second.append(drafts[1] if accept[1] else fallback[1])
    assert sampler.processors[0].drafted == 0  # the matcher is back where it started

    def stat(samples, allowed, p):
        assert set(samples) <= set(allowed), set(samples) - set(allowed)
        counts = np.array([samples.count(t) for t in allowed])
        expected = p * len(samples)
        return float(((counts - expected) ** 2 / expected).sum())

    # chi-square bounds exceeded with probability 1e-6: 1 and 2 degrees of freedom
    assert stat(first, *masked(0, [a, b])) < 23.93
    assert len(second) > 100 and stat(second, *masked(1, [b, c, d])) < 27.63


def test_logprobs_under_speculation_equal_plain_decodings(tiny):
    spec = SPECS["json_schema"](tiny)

    def make():
        return _sampler(tiny, spec, top_logprobs=3)

    want, plain = _plain(tiny, make)
    out, _, stats, sampler = _speculate(tiny, make, InjectedDrafter(want, len(PROMPT), 0.3))
    assert out == want and stats.accepted > 0
    assert len(sampler.recorded) == len(plain.recorded) == len(want)
    for ours, theirs in zip(sampler.recorded, plain.recorded):
        assert ours.token == theirs.token
        assert abs(ours.logprob - theirs.logprob) < 1e-4
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(ours.top, theirs.top))


class ConstrainedOracle:
    """For sessions: plain constrained greedy decoding of the turn's prompt (found from the
    first call's history), with rejections injected at `rate`."""

    def __init__(self, eng, spec, rate):
        self.eng, self.spec, self.rate, self.inner = eng, spec, rate, None

    def propose(self, history, k):
        if self.inner is None:
            prompt = list(history[:-1])
            truth, _ = _plain(self.eng, lambda: _sampler(self.eng, self.spec), ids=prompt)
            self.inner = InjectedDrafter(truth, len(prompt), self.rate, seed=len(prompt))
        return self.inner.propose(history, k)


def test_session_constrained_turns_speculate_and_the_cache_stays_exact(tiny, monkeypatch):
    """Constrained turns with logprobs draft (Speculation.applies lets them), answer as a
    fresh prefill's plain constrained decoding does, and leave the session cache exact: the
    next (free) turn equals a fresh prefill's greedy answer."""
    from helpers import fresh_greedy

    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    spec = SPECS["json_schema"](tiny)
    monkeypatch.setattr(tiny, "speculative", Speculation(
        lambda: ConstrainedOracle(tiny, spec, 0.3), 3, adaptive=False))  # fmt: skip
    s = tiny.session("Answer in JSON.")
    turns = []
    for q in ("Who?", "And now?"):
        turn = s.send(q, max_tokens=40, response_format=fmt, logprobs=True)
        jsonschema.validate(json.loads(turn.text), SCHEMA)
        want, _ = _plain(tiny, lambda: _sampler(tiny, spec), n=40, ids=turn.prompt_ids)
        assert turn.token_ids == [t for t in want if t not in tiny.stop_ids]
        assert turn.stats.drafted_tokens > 0 and turn.stats.accepted_tokens > 0
        assert len(turn.logprobs) == len(turn.token_ids)
        turns.append(turn)
    assert turns[1].stats.reused_tokens > 0
    monkeypatch.setattr(tiny, "speculative", None)  # the next turn, plainly
    free = s.send("Thanks.", max_tokens=8)
    assert free.stats.reused_tokens > 0
    assert free.token_ids == fresh_greedy(tiny, free.prompt_ids, 8)[0]
