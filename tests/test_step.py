"""engine.runtime.step: a step over rows, rollback by position, acceptance, the processor chain.

The reference for every rollback is a fresh full prefill of exactly the tokens that stood.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.runtime.cache import KVCache
from engine.runtime.generate import decode, prefill
from engine.runtime.sampling import LogitsProcessor, Sampler, SamplingParams
from engine.runtime.step import Row, accepted, forward, rollback, run

PROMPT = [9707, 11, 1879, 0, 3555, 525, 498, 30, 151645, 198, 151644, 77091, 198] * 3


def _greedy(model, ids: list[int], n: int) -> list[int]:
    caches = model.make_caches()
    logits, _ = prefill(model, caches, ids, 0)
    return list(decode(model, caches, logits, Sampler(SamplingParams()), max_tokens=n,
                       stop_ids=(), history=list(ids)))  # fmt: skip


def _next_logits(model, caches, token: int) -> np.ndarray:
    ((logits, _),) = forward(model, [Row(caches, [token])])
    return np.array(logits[-1])


def _states(caches) -> list[np.ndarray]:
    out = []
    for c in caches:
        if isinstance(c, KVCache):
            out += [np.array(a) for a in c.state]
        else:
            out += [np.array(c.conv), np.array(c.state)]
    return out


@pytest.mark.parametrize("k", [1, 4])
def test_a_verify_step_rolls_back_to_every_acceptance_length(tiny, k):
    """Feed [t, d1..dk] in one pass, keep the states at every position, accept j drafts (the
    drafts are the greedy continuation with a wrong token at j), roll back: the caches must
    equal a fresh prefill of prompt + t + d1..dj, and the step's logits the fresh ones."""
    model = tiny.model
    t, *truth = _greedy(model, PROMPT, k + 2)
    for j in range(k + 1):
        drafts = truth[:k]
        if j < k:
            drafts = drafts[:j] + [(drafts[j] + 1) % 1000] + drafts[j + 1 :]
        caches = model.make_caches()
        prefill(model, caches, PROMPT, 0)
        row = Row(caches, [t, *drafts], logits=k + 1, keep=range(1, k + 1))
        ((logits, mark),) = forward(model, [row])
        picked = np.argmax(np.array(logits), axis=-1).tolist()
        n = accepted(drafts, picked)
        assert n == j and picked[: j + 1] == truth[: j + 1]
        rollback(caches, mark, mark.start + 1 + n)
        kept = PROMPT + [t, *drafts[:n]]
        assert {c.offset for c in caches} == {len(kept)}

        fresh = model.make_caches()
        fresh_logits, _ = prefill(model, fresh, kept, 0)
        np.testing.assert_allclose(np.array(logits[n]), np.array(fresh_logits), atol=1e-4)
        for ours, theirs in zip(_states(caches), _states(fresh)):
            np.testing.assert_allclose(ours, theirs, atol=1e-4)
        # and the next token after it computes the same either way
        np.testing.assert_allclose(
            _next_logits(model, caches, picked[n]), _next_logits(model, fresh, picked[n]),
            atol=1e-4,
        )  # fmt: skip


def test_rollback_to_the_start_is_exact_and_unkept_positions_are_refused(tiny):
    model = tiny.model
    caches = model.make_caches()
    prefill(model, caches, PROMPT, 0)
    before = _states(caches)
    ((_, mark),) = forward(model, [Row(caches, [5, 6, 7], logits=0, keep=[2])])
    assert mark.start == len(PROMPT) and mark.end == len(PROMPT) + 3
    with pytest.raises(ValueError, match="kept no state"):
        rollback(caches, mark, mark.start + 1)
    rollback(caches, mark, mark.end)  # a no-op
    assert {c.offset for c in caches} == {mark.end}
    rollback(caches, mark, mark.start)
    for ours, theirs in zip(_states(caches), before):
        np.testing.assert_array_equal(ours, theirs)


def test_acceptance_cuts_at_the_first_disagreement_and_after_a_stop():
    assert accepted([1, 2, 3], [1, 2, 3]) == 3
    assert accepted([1, 2, 3], [1, 9, 3]) == 1
    assert accepted([1, 2, 3], [7, 2, 3]) == 0
    assert accepted([1, 2, 3], [1, 2, 3], stop_ids=[2]) == 2  # the stop stands, nothing after
    assert accepted([], []) == 0


class Recorder(LogitsProcessor):
    """Adds a fixed bias and records what it saw (the chain's order and the accepted tokens)."""

    def __init__(self, name: str, log: list, bias: mx.array, reads_history: bool = False):
        self.name, self.log, self.bias, self.reads_history = name, log, bias, reads_history
        self.accepted: list[int] = []

    def __call__(self, logits, history):
        self.log.append(self.name)
        return logits + self.bias

    def accept(self, tokens):
        self.accepted.extend(tokens)


@pytest.mark.parametrize("reads_history", [False, True])
def test_the_chain_runs_in_order_and_sees_every_token_that_stood(tiny, reads_history):
    vocab = tiny.model.arch.vocab_size
    log: list[str] = []
    ban = mx.zeros((vocab,))
    ban[: vocab // 2] = -mx.inf  # the first processor bans the lower half of the vocabulary
    first = Recorder("penalty", log, ban, reads_history)
    second = Recorder("mask", log, mx.zeros((vocab,)))
    sampler = Sampler(SamplingParams(), [first, second])
    assert sampler.reads_history is reads_history

    caches = tiny.model.make_caches()
    logits, _ = prefill(tiny.model, caches, PROMPT, 0)
    tokens = list(decode(tiny.model, caches, logits, sampler, max_tokens=6, stop_ids=(),
                         history=list(PROMPT)))  # fmt: skip
    assert log[:2] == ["penalty", "mask"] and log == ["penalty", "mask"] * (len(log) // 2)
    assert all(t >= vocab // 2 for t in tokens)
    assert first.accepted == tokens == second.accepted

    raw = mx.random.normal((vocab,))
    lp = np.array(sampler.logprobs(sampler.process(raw, [])))
    processed = np.array(raw) + np.array(ban)
    want = (
        processed
        - np.log(np.exp(processed[vocab // 2 :] - processed.max()).sum())
        - processed.max()
    )
    np.testing.assert_allclose(lp[vocab // 2 :], want[vocab // 2 :], atol=1e-4)
    assert np.isneginf(lp[: vocab // 2]).all()


def test_decoding_through_the_step_equals_a_fresh_prefill_of_each_prefix(tiny):
    """Each greedy token decoded step by step is the argmax of a fresh full prefill of the
    prompt and the tokens before it."""
    model = tiny.model
    tokens = _greedy(model, PROMPT, 5)
    for i, token in enumerate(tokens):
        logits, _ = prefill(model, model.make_caches(), PROMPT + tokens[:i], 0)
        assert int(np.argmax(np.array(logits))) == token


def _penalized_reference(logits, prompt, answer, p: SamplingParams) -> np.ndarray:
    """Penalties by their definitions, in float64 over host lists."""
    out = np.array(logits, dtype=np.float64)
    if p.repetition_penalty != 1.0:
        for t in set((prompt + answer)[-p.repetition_window :]):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(answer):
        out[t] -= p.presence_penalty + p.frequency_penalty * answer.count(t)
    return out


@pytest.mark.parametrize(
    "params",
    [SamplingParams(repetition_penalty=1.8, repetition_window=5),
     SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
     SamplingParams(repetition_penalty=0.7, repetition_window=3, presence_penalty=-0.5,
                    frequency_penalty=2.0)],
)  # fmt: skip
def test_penalties_match_their_definitions_step_by_step(params):
    rng = np.random.default_rng(0)
    vocab, prompt, answer = 12, [3, 5, 5, 7, 1, 2], []
    sampler = Sampler(params)
    for _ in range(15):
        logits = rng.standard_normal(vocab).astype(np.float32) * 3
        logits[answer[-1] if answer else 0] += 4  # keep repeats likely, so penalties matter
        token, processed = sampler.sample(mx.array(logits), prompt + answer)
        want = _penalized_reference(logits, prompt, answer, params)
        np.testing.assert_allclose(np.array(processed), want, atol=1e-5)
        assert token.item() == int(np.argmax(want))
        answer.append(token.item())
    assert len(set(answer)) > 1


class HostBound(LogitsProcessor):
    reads_history = True  # forces decoding one step at a time

    def __call__(self, logits, history):
        return logits


def test_penalties_run_ahead_and_equal_step_by_step_decoding(tiny):
    # Negative presence/frequency favour what was said: the answer changes for sure.
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=-2.0, frequency_penalty=-2.0)
    assert not Sampler(params).reads_history  # device-side state: decoding runs ahead

    def run(extra):
        sampler = Sampler(params)
        sampler.processors += extra
        caches = tiny.model.make_caches()
        logits, _ = prefill(tiny.model, caches, PROMPT, 0)
        return list(decode(tiny.model, caches, logits, sampler, max_tokens=12, stop_ids=(),
                           history=list(PROMPT)))  # fmt: skip

    ahead, stepwise = run([]), run([HostBound()])
    assert ahead == stepwise
    assert ahead != _greedy(tiny.model, PROMPT, 12)  # the penalties changed the answer


def test_a_step_that_fails_in_a_pick_leaves_every_row_and_sampler_as_before(tiny):
    """`step.run`: the pass goes through, then one row's processor raises while the picks are
    made. Every row's caches are back at the step's start and no sampler holds a pick, so the
    step is served again as if it never ran: the picks equal those of a run that never
    failed."""
    model = tiny.model

    class Fails(LogitsProcessor):
        armed = True

        def __call__(self, logits, history):
            if Fails.armed:
                raise RuntimeError("injected pick failure")
            return logits

    def rows(samplers):
        out = []
        for n, sampler in zip((5, 9), samplers):
            caches = model.make_caches()
            prefill(model, caches, PROMPT[:n], 0)
            out.append(Row(caches, [PROMPT[n]], sampler=sampler, history=PROMPT[:n]))
        return out

    params = SamplingParams(temperature=0.8, top_k=20, seed=4)
    samplers = [Sampler(params), Sampler(params, [Fails()])]
    failing = rows(samplers)
    before = [_states(r.caches) for r in failing]
    with pytest.raises(RuntimeError, match="injected pick failure"):
        run(model, failing)
    for row, states in zip(failing, before):
        assert row.caches[0].offset == len(row.history)
        for a, b in zip(_states(row.caches), states, strict=True):
            assert np.array_equal(a, b)
    assert all(s._last is None for s in samplers)
    Fails.armed = False
    picks = [t.item() for _, _, t in run(model, failing)]
    clean = [t.item() for _, _, t in run(model, rows([Sampler(params), Sampler(params)]))]
    assert picks == clean
