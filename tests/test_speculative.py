"""Speculative decoding against independent references: plain decoding and a fresh prefill.

The drafter that forces every path proposes the target's own greedy continuation (computed by
a fresh prefill) with wrong tokens injected at a given rate; after any rejection the caches
must equal a fresh prefill of exactly the tokens that stood.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import QUESTIONS, fresh_greedy

import engine
import kernels.sampling
from bench.spec_scripts import cache_error
from engine.runtime.generate import decode, prefill
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.speculative import (
    DraftLength,
    InjectedDrafter,
    LookupDrafter,
    Speculation,
    SpeculationStats,
    speculative_decode,
    verify,
)

PROMPT = [9707, 11, 1879, 0, 3555, 525, 498, 30, 151645, 198, 151644, 77091, 198] * 3
N = 16


def _plain(model, ids, n, stop_ids=(), params=None):
    caches = model.make_caches()
    logits, _ = prefill(model, caches, ids, 0)
    return list(decode(model, caches, logits, Sampler(params or SamplingParams()), max_tokens=n,
                       stop_ids=stop_ids, history=list(ids)))  # fmt: skip


@pytest.fixture(scope="module")
def truth(tiny):
    return _plain(tiny.model, PROMPT, N + 4)


def _speculate(model, drafter, k, n=N, stop_ids=(), params=None):
    caches = model.make_caches()
    logits, _ = prefill(model, caches, PROMPT, 0)
    stats = SpeculationStats()
    steps = speculative_decode(
        model, caches, logits, Sampler(params or SamplingParams()), max_tokens=n, stop_ids=stop_ids,
        history=list(PROMPT), drafter=drafter, policy=DraftLength(k, adaptive=False), stats=stats,
    )  # fmt: skip
    return caches, steps, stats


def _assert_holds(model, caches, tokens, next_token, state_atol=1e-4):
    """`caches` equal a fresh prefill of `tokens`: states, and the logits after `next_token`
    (within 1e-4, the exactness rule). The states' tolerance scales with their size: the
    fresh prefill runs the chunked algorithm and the speculative steps the per-token update,
    which sum in other orders, so float32 rounding grows with the magnitudes summed (tiny's
    states reach ~2.5; an element differed by 1.06e-4 on this machine's CPU, and by 1.1e-4
    in other tests here before any change to the model)."""
    assert {c.offset for c in caches} == {len(tokens)}
    state, logits = cache_error(model, caches, tokens, next_token)
    assert state <= state_atol and logits <= 1e-4, (state, logits)


def test_lookup_proposes_what_followed_the_latest_match_longest_ngram_first():
    d = LookupDrafter(max_ngram=3)
    assert d.propose([1, 2, 3], 4) == []
    assert d.propose([1, 2, 3, 9, 1, 2], 4) == [3, 9, 1, 2]  # "1 2" matched, its follower on
    assert d.propose([1, 2, 3, 9, 1, 2, 7, 5, 2], 2) == [7, 5]  # "2": the latest occurrence
    # a longer match wins over a later shorter one: "9 1 2" -> 3, not "2" -> what came last
    assert LookupDrafter(3).propose([9, 1, 2, 3, 4, 2, 8, 9, 1, 2], 2) == [3, 4]
    assert d.propose([5], 3) == [] and d.propose([1, 1], 0) == []


@pytest.mark.parametrize(("k", "rate"), [(1, 0.5), (4, 0.0), (4, 0.25), (4, 0.5), (4, 1.0)])
def test_greedy_output_equals_plain_decoding_and_caches_a_fresh_prefill(tiny, truth, k, rate):
    model = tiny.model
    caches, steps, stats = _speculate(model, InjectedDrafter(truth, len(PROMPT), rate), k)
    out = list(steps)
    assert out == truth[:N]
    assert stats.drafted > 0 and stats.verifies > 0
    if rate == 0.0:
        assert stats.accepted == stats.drafted and stats.tokens_per_verify > 2
    if rate == 1.0:
        assert stats.accepted == 0 and stats.tokens_per_verify == 1
    # every yielded token but the last is fed, exactly as a fresh prefill would hold them
    _assert_holds(model, caches, PROMPT + out[:-1], out[-1])


@pytest.mark.parametrize("j", [3, 5])  # with k=4: a stop inside the drafts, then as the bonus
def test_a_stop_token_inside_an_accepted_run_ends_the_answer_unfed(tiny, truth, j):
    model = tiny.model
    stop = truth[j]
    assert stop not in truth[:j]
    caches, steps, stats = _speculate(model, InjectedDrafter(truth, len(PROMPT), 0.0), 4,
                                      stop_ids=(stop,))  # fmt: skip
    assert list(steps) == truth[: j + 1] == _plain(model, PROMPT, N, (stop,))
    _assert_holds(model, caches, PROMPT + truth[:j], stop)


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_tokens_is_exact_inside_a_run(tiny, truth, n):
    caches, steps, _ = _speculate(tiny.model, InjectedDrafter(truth, len(PROMPT), 0.0), 4, n=n)
    assert list(steps) == truth[:n]
    assert {c.offset for c in caches} == {len(PROMPT) + n - 1}


@pytest.mark.parametrize("stop_at", [2, 4, 6])  # a draft token, the bonus, a later draft
def test_a_consumer_that_stops_mid_run_leaves_only_what_it_read_but_the_last(tiny, truth, stop_at):
    model = tiny.model
    caches, steps, _ = _speculate(model, InjectedDrafter(truth, len(PROMPT), 0.0), 4)
    read = [t for _, t in zip(range(stop_at), steps)]
    steps.close()
    assert read == truth[:stop_at]
    _assert_holds(model, caches, PROMPT + read[:-1], read[-1])


def test_lookup_drafts_on_a_repeated_prompt_and_keeps_the_output(tiny, truth):
    """The prompt quotes the model's own continuation, so lookup proposes it after the echo."""
    model = tiny.model
    ids = PROMPT + truth[:8] + PROMPT
    want = _plain(model, ids, N)
    caches = model.make_caches()
    logits, _ = prefill(model, caches, ids, 0)
    stats = SpeculationStats()
    out = list(speculative_decode(
        model, caches, logits, Sampler(SamplingParams()), max_tokens=N, stop_ids=(),
        history=list(ids), drafter=LookupDrafter(), policy=DraftLength(4, adaptive=False),
        stats=stats,
    ))  # fmt: skip
    assert out == want and stats.drafted > 0
    _assert_holds(model, caches, ids + out[:-1], out[-1])


# Penalties that bite on tiny's random weights (its greedy answers never repeat a token, so
# positive penalties change nothing there): a boost for a token seen once that turns into a
# penalty from its second use (answers come in pairs), a repetition boost over the prompt
# and the answer, and the checkpoint's default presence penalty as the CLI and server apply it.
PENALTIES = [
    SamplingParams(presence_penalty=-2.0, frequency_penalty=1.0),
    SamplingParams(repetition_penalty=0.3, repetition_window=16),
    SamplingParams(presence_penalty=1.5),
]


@pytest.mark.parametrize("params", PENALTIES, ids=["presence-frequency", "repetition", "default"])
@pytest.mark.parametrize("rate", [0.0, 0.4])
def test_penalties_under_speculation_equal_plain_decoding(tiny, params, rate):
    """Each verified position is penalized as if the drafts before it had been picked (their
    counts differ per position), and the penalties then count exactly the tokens that stood."""
    model = tiny.model
    want = _plain(model, PROMPT, 16, params=params)
    if params.presence_penalty < 0 or params.repetition_penalty < 1:
        assert want != _plain(model, PROMPT, 16)  # the penalty changes the answer
    caches, steps, stats = _speculate(model, InjectedDrafter(want, len(PROMPT), rate), 4, n=16,
                                      params=params)  # fmt: skip
    out = list(steps)
    assert out == want
    assert stats.accepted > 0 and (stats.accepted < stats.drafted) == (rate > 0)
    _assert_holds(model, caches, PROMPT + out[:-1], out[-1])


@pytest.mark.parametrize("rate", [0.0, 0.4])
def test_a_logit_bias_under_speculation_equals_plain_decoding(tiny, rate):
    model = tiny.model
    plain = _plain(model, PROMPT, 16)
    params = SamplingParams(logit_bias={plain[1]: -100, plain[6]: -100, 7: 30.0})
    want = _plain(model, PROMPT, 16, params=params)
    assert want != plain and plain[1] not in want and plain[6] not in want
    caches, steps, stats = _speculate(model, InjectedDrafter(want, len(PROMPT), rate), 4, n=16,
                                      params=params)  # fmt: skip
    assert list(steps) == want and stats.accepted > 0


def test_a_thinking_budget_under_speculation_closes_where_plain_decoding_does(tiny):
    from engine.runtime.thinking import ThinkingBudget

    model, end = tiny.model, 151668  # any token: the budget forces it after 5 picks

    def sampler():
        return Sampler(SamplingParams(), [ThinkingBudget(5, end)])

    caches = model.make_caches()
    logits, _ = prefill(model, caches, PROMPT, 0)
    want = list(decode(model, caches, logits, sampler(), max_tokens=12, stop_ids=(),
                       history=list(PROMPT)))  # fmt: skip
    assert want[5] == end
    for rate in (0.0, 0.5):
        caches = model.make_caches()
        logits, _ = prefill(model, caches, PROMPT, 0)
        stats = SpeculationStats()
        out = list(speculative_decode(
            model, caches, logits, sampler(), max_tokens=12, stop_ids=(), history=list(PROMPT),
            drafter=InjectedDrafter(want, len(PROMPT), rate), policy=DraftLength(4, adaptive=False),
            stats=stats,
        ))  # fmt: skip
        assert out == want and stats.accepted > 0


class Oracle:
    """A drafter for session scripts: the fresh-prefill greedy continuation of the prompt
    (found from the first call's history; with `params`, plain decoding's under them), with
    rejections injected at `rate`."""

    def __init__(self, eng, rate, params=None):
        self.eng, self.rate, self.params, self.inner = eng, rate, params, None

    def propose(self, history, k):
        if self.inner is None:
            prompt = list(history[:-1])
            if self.params is None:
                cont, _ = fresh_greedy(self.eng, prompt, 24)
            else:
                cont = _plain(self.eng.model, prompt, 24, params=self.params)
            self.inner = InjectedDrafter(cont, len(prompt), self.rate, seed=len(prompt))
        return self.inner.propose(history, k)


@pytest.fixture(scope="module")
def spec_engine():
    return engine.load("tiny", speculative="lookup", num_draft=3)


@pytest.mark.parametrize("drafter", ["lookup", "oracle"])
def test_session_scripts_answer_as_a_fresh_prefill_does(spec_engine, drafter):
    """Plain turns, trimming turns, regenerate, an interrupted stream: every answer equals a
    fresh prefill's greedy tokens, and the Turn reports what drafting did."""
    eng = spec_engine
    if drafter == "oracle":
        eng.speculative = Speculation(lambda: Oracle(eng, 0.3), 3, adaptive=False)
    else:
        eng.speculative = Speculation(LookupDrafter, 3, adaptive=False)
    s = eng.session("You are terse.", max_exchanges=2)
    turns = [s.send(q, max_tokens=10) for q in QUESTIONS[:4]]  # turns 3, 4 trim
    assert turns[-1].stats.dropped_exchanges == 1
    turns.append(s.regenerate(max_tokens=10))
    history = [list(e) for e in s.history]
    stream = s.stream(QUESTIONS[4], max_tokens=10)
    next(stream)
    stream.close()  # walked away mid-answer: no trace
    assert s.history == history
    turns.append(s.send(QUESTIONS[5], max_tokens=10))
    for turn in turns:
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 10)[0]
    if drafter == "oracle":
        st = turns[0].stats
        assert st.drafted_tokens > 0 and 0 < st.accepted_tokens <= st.drafted_tokens
        assert st.acceptance_rate == st.accepted_tokens / st.drafted_tokens
        assert st.tokens_per_verify > 1


@pytest.mark.parametrize("params", [PENALTIES[0], PENALTIES[2]], ids=["biting", "default"])
def test_session_turns_with_penalties_draft_and_answer_as_plain_decoding(spec_engine, params):
    """The CLI's and server's default presence penalty no longer switches drafting off."""
    eng = spec_engine
    eng.speculative = Speculation(lambda: Oracle(eng, 0.3, params), 3, adaptive=False)
    s = eng.session("You are terse.", max_exchanges=2)
    p = {"presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty}
    turns = [s.send(q, max_tokens=8, **p) for q in QUESTIONS[:3]]  # the third trims
    turns.append(s.regenerate(max_tokens=8, **p))
    for turn in turns:
        want = _plain(eng.model, turn.prompt_ids, 8, stop_ids=eng.stop_ids, params=params)
        assert turn.token_ids == [t for t in want if t not in eng.stop_ids]
        assert turn.stats.drafted_tokens > 0 and turn.stats.accepted_tokens > 0


# Randomized session scripts (bench/spec_scripts.py; the same runs on the 0.8B build there):
# seeds chosen so that together they play every turn shape, for each drafter (lookup drafts
# from the tools' text in a forced call: 7 has every draft stand, 18 some refused).
SCRIPTS = [("oracle", 6), ("oracle", 13), ("lookup", 7), ("lookup", 18), ("mtp", 0), ("mtp", 7),
           ("draft:tiny", 2)]  # fmt: skip


@pytest.fixture(scope="module")
def script_engine():
    """`tiny` with the MTP head: every drafter runs on it (the head's cache rides along)."""
    return engine.load("tiny", speculative="mtp")


@pytest.mark.parametrize("drafter,seed", SCRIPTS, ids=[f"{d}-{s}" for d, s in SCRIPTS])
def test_randomized_session_scripts_draft_exactly(script_engine, drafter, seed):
    """Each answer with drafting equals the one without, which equals a fresh prefill's; the
    session's caches at the end equal a fresh prefill of its tokens."""
    from bench import spec_scripts

    eng = script_engine
    spec = spec_scripts.speculations(eng, [drafter], 3, reject=0.3)[drafter]
    row = spec_scripts.check(eng, seed, spec)
    assert row["problems"] == []
    assert row["answers"] >= 3 and row["drafted"] > 0
    if drafter == "oracle":  # rejections at every position, and runs that stand
        assert 0 < row["accepted"] < row["drafted"]
    if drafter == "draft:tiny":  # drafting for itself: every draft stands
        assert row["accepted"] == row["drafted"]


def test_a_script_that_leaves_the_session_empty_is_checked_not_crashed(script_engine):
    """Script 116 (no system prompt, two exchanges kept) ends with two interrupted turns that
    trim the window: each rolls back to its restore point, position 0, so the session's caches
    end empty. The cache check compares empty caches (equal) instead of failing on them."""
    from bench import spec_scripts

    eng = script_engine
    assert cache_error(eng.model, eng.model.make_caches(), []) == (0.0, 0.0)
    spec = spec_scripts.speculations(eng, ["oracle"], 3, reject=0.3)["oracle"]
    row = spec_scripts.check(eng, 116, spec)
    assert row["actions"][-2:] == ["interrupt", "interrupt"] and row["problems"] == []


def test_the_scripts_play_every_turn_shape():
    """Guards the seeds above: the oracle's scripts (rejections at every position) and the
    MTP head's (its own cache) each play every turn shape."""
    from bench.spec_scripts import plan

    shapes = {"send", "regenerate", "warm", "tool", "interrupt", "fail"}
    for drafter in ("oracle", "mtp"):
        played = {a for d, seed in SCRIPTS if d == drafter for a, _ in plan(seed)[2]}
        assert played >= shapes, (drafter, shapes - played)
    assert {plan(seed)[1] for _, seed in SCRIPTS} == {1, 2}  # windows that trim at once, later


def test_load_options_are_checked(tiny):
    from engine.runtime.mtp import MTPDrafter

    assert isinstance(engine.engine.speculation("lookup", 2), Speculation)
    assert engine.engine.speculation("mtp", 3).drafter is MTPDrafter
    assert engine.engine.speculation(None) is None
    with pytest.raises(ValueError, match="speculative must be one of lookup, mtp, draft:NAME or"):
        engine.engine.speculation("medusa")
    with pytest.raises(ValueError, match="num_draft must be an integer from 1 to 8"):
        engine.engine.speculation("lookup", 0)


def test_low_acceptance_costs_at_most_five_percent_over_plain_decoding():
    """Simulated: every draft rejected, a k-draft verify costs (1 + 0.5k) plain steps. The
    policy stops drafting, probes at doubling intervals, and stays within 5% of plain."""
    policy, plain, made, spent = DraftLength(4), 1.0, 0, 0.0
    while made < 4000:
        k = policy.next()
        if k == 0:
            m = policy.plain_tokens()
            policy.record_plain(m, m * plain)
            made, spent = made + m, spent + m * plain
        else:
            cost = plain * (1 + 0.5 * k)
            policy.record_verify(k, 0, cost)
            made, spent = made + 1, spent + cost
    assert spent / (made * plain) < 1.05
    # and when every draft stands and a verify is cheap, it drafts the most it may
    good = DraftLength(4)
    for _ in range(3):
        good.record_plain(16, 16 * plain)
        good.record_verify(4, 4, 1.2 * plain)
    assert good.next() == 4


@pytest.mark.parametrize("native", [True, False])
def test_speculative_sampling_keeps_the_target_distribution(monkeypatch, native):
    """verify() on fixed logits over 5 tokens: the first emitted token follows p0, the one
    after an accepted first draft p1 (chi-square, seeded, so it never flakes). The naive rule
    (resample from p0 without removing the draft) fails the same bound. Both ways to draw:
    the native pass on the CPU and MLX's ops (a GPU's, or without the native module)."""
    if not native:
        monkeypatch.setattr(kernels.sampling, "_module", lambda logits: None)
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((3, 5)).astype(np.float32) * 1.5)
    drafts = [2, 4]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    probs = np.array(mx.softmax(logits, axis=-1), dtype=np.float64)
    probs /= probs.sum(axis=-1, keepdims=True)
    first, second, naive = [], [], []
    naive_rng = np.random.default_rng(1)
    for _ in range(1500):
        accept, fallback = verify(sampler, logits, drafts)
        first.append(drafts[0] if accept[0] else fallback[0])
        if accept[0]:
            second.append(drafts[1] if accept[1] else fallback[1])
        naive.append(drafts[0] if accept[0] else int(naive_rng.choice(5, p=probs[0])))

    def stat(samples, p):
        counts = np.bincount(samples, minlength=5)
        expected = p * len(samples)
        return float(((counts - expected) ** 2 / expected).sum())

    bound = 33.38  # chi-square, 4 degrees of freedom: exceeded with probability 1e-6
    assert stat(first, probs[0]) < bound
    assert stat(second, probs[1]) < bound and len(second) > 100
    assert stat(naive, probs[0]) > bound


def test_sampled_speculation_stays_in_the_top_k_of_a_fresh_prefill(tiny, truth):
    params = SamplingParams(temperature=0.8, top_k=3, seed=3)

    class GreedyFromHere:  # the model's own greedy continuation of whatever stands
        def propose(self, history, k):
            return _plain(tiny.model, list(history), k)

    _, steps, stats = _speculate(tiny.model, GreedyFromHere(), 3, n=8, params=params)
    out = list(steps)
    assert len(out) == 8 and stats.drafted > 0
    for i, t in enumerate(out):
        logits, _ = prefill(tiny.model, tiny.model.make_caches(), PROMPT + out[:i], 0)
        assert t in np.argsort(np.array(logits))[-3:]


def test_the_server_answers_with_speculation_as_a_fresh_prefill_does(spec_engine):
    import openai

    from engine.serving.server import BackgroundServer, ServerConfig

    eng = spec_engine
    eng.speculative = Speculation(lambda: Oracle(eng, 0.3), 3, adaptive=False)
    with BackgroundServer(eng, ServerConfig(port=0, context_window=4096, warm=False)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": QUESTIONS[2]}]
        for _ in range(2):  # the second time from the pool's cached sequence
            r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0, presence_penalty=0)  # fmt: skip
            turn = eng.chat(messages, max_tokens=8)  # the Python API, same engine
            assert r.choices[0].message.content == turn.text
            assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 8)[0]
            assert turn.stats.drafted_tokens > 0


def test_a_stop_string_inside_an_accepted_run_ends_the_answer_as_plain_decoding_does(spec_engine):
    """Every draft stands (k = 4), so the stop string ends the text inside a verified run:
    the answer is plain decoding's, and the pool's sequence it leaves serves the next turn as
    a fresh prefill would."""
    eng = spec_engine
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    eng.speculative = None
    answer = eng.chat(messages, max_tokens=16, warm=False)
    full, start = answer.text, len(eng.tokenizer.decode(answer.token_ids[:6]))  # past a verify
    stop = next(full[i : i + 2] for i in range(start, len(full) - 2)
                if full[i : i + 2] not in full[: i + 1])  # fmt: skip
    plain = eng.chat(messages, max_tokens=16, stop=[stop], warm=False)
    assert plain.finish_reason == "stop" and full.startswith(plain.text) and stop not in plain.text
    eng.speculative = Speculation(lambda: Oracle(eng, 0.0), 4, adaptive=False)
    turn = eng.chat(messages, max_tokens=16, stop=[stop], warm=False)
    assert (turn.text, turn.finish_reason) == (plain.text, "stop")
    assert turn.stats.accepted_tokens == turn.stats.drafted_tokens > 0
    more = messages + [turn.message(), {"role": "user", "content": QUESTIONS[3]}]
    nxt = eng.chat(more, max_tokens=6, warm=False)
    assert nxt.stats.reused_tokens > 0  # restored from the sequence the speculative turn left
    assert nxt.token_ids == fresh_greedy(eng, nxt.prompt_ids, 6)[0]


class Failing:
    """Drafts as `inner` does, and raises on its `n`-th proposal (a draft model out of memory
    mid-answer)."""

    def __init__(self, inner, n):
        self.inner, self.n, self.calls = inner, n, 0

    def propose(self, history, k):
        self.calls += 1
        if self.calls == self.n:
            raise MemoryError("injected in the drafter")
        return self.inner.propose(history, k)


def test_a_drafter_failing_mid_answer_leaves_the_session_as_it_was(spec_engine):
    """The failure comes after verify steps have fed and rolled back drafts: the turn raises,
    the history is unchanged, and the next turn answers from exact caches."""
    eng = spec_engine
    eng.speculative = Speculation(lambda: Oracle(eng, 0.3), 3, adaptive=False)
    s = eng.session("You are terse.", max_exchanges=2)
    s.send(QUESTIONS[0], max_tokens=8)
    history = [list(e) for e in s.history]
    eng.speculative = Speculation(lambda: Failing(Oracle(eng, 0.3), 3), 3, adaptive=False)
    with pytest.raises(MemoryError, match="injected in the drafter"):
        s.send(QUESTIONS[1], max_tokens=12)
    assert s.history == history
    eng.speculative = Speculation(lambda: Oracle(eng, 0.3), 3, adaptive=False)
    turn = s.send(QUESTIONS[1], max_tokens=8)
    assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 8)[0]
    assert turn.stats.reused_tokens > 0 and turn.stats.drafted_tokens > 0
    with eng.lock:
        _assert_holds(eng.model, s.seq.caches, list(s.seq.tokens), 198)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_the_adaptive_policy_switching_drafting_off_and_on_keeps_the_output(tiny, rate):
    """Adaptive k runs verifies, plain pipelined runs and probes in one answer: the tokens and
    the caches are those of plain decoding whatever it picks."""
    model = tiny.model
    want = _plain(model, PROMPT, 40)
    caches = model.make_caches()
    logits, _ = prefill(model, caches, PROMPT, 0)
    policy = DraftLength(4, cooloff=4)
    out = list(speculative_decode(
        model, caches, logits, Sampler(SamplingParams()), max_tokens=40, stop_ids=(),
        history=list(PROMPT), drafter=InjectedDrafter(want, len(PROMPT), rate), policy=policy,
        stats=SpeculationStats(),
    ))  # fmt: skip
    assert out == want
    assert policy.verifies >= 2 and policy.plain_s is not None  # both kinds of step ran
    # 40 tokens of rounding (plain decoding itself drifts 6e-5 from a fresh prefill here):
    # the states within 1e-3, the logits they give within the 1e-4 rule
    _assert_holds(model, caches, PROMPT + out[:-1], out[-1], state_atol=1e-3)


class Repeating:
    """Drafts the last token k times: rarely right, but every step verifies."""

    def propose(self, history, k):
        return [history[-1]] * k


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_seeded_sampled_answer_is_the_same_with_drafting_as_without(spec_engine, adaptive):
    """`seed` reproduces a sampled answer: the same tokens with drafting on or off, whatever
    the drafter proposes and whichever steps the adaptive policy (timed, engine-wide) verifies.
    Each position's token is drawn as plain decoding draws it (one key per token, in order);
    a draft stands when it is that token."""
    eng = spec_engine
    options = {"max_tokens": 16, "temperature": 0.9, "seed": 7}
    params = SamplingParams(temperature=0.9, seed=7)
    eng.speculative = None
    want = eng.session("You are terse.").send(QUESTIONS[0], **options).token_ids
    for drafter in (lambda: Oracle(eng, 0.3, params), Repeating):
        eng.speculative = Speculation(drafter, 3, adaptive=adaptive)
        for _ in range(2):  # the second answer finds the policy's timings of the first
            turn = eng.session("You are terse.").send(QUESTIONS[0], **options)
            assert turn.token_ids == want
        if drafter is not Repeating and not adaptive:
            assert turn.stats.accepted_tokens > 0


@pytest.mark.parametrize("drafter", ["oracle", "mtp"])
def test_speculative_rows_verify_in_the_batch_passes_and_answer_as_alone(monkeypatch, drafter):
    """Concurrent speculative requests: their verify rows (the pending token and the drafts)
    run in the batch's passes beside the other rows, as decode rows do, instead of each
    verifying alone between passes; every answer is still a fresh prefill's greedy one."""
    from test_batch import Held, Request, messages

    import engine.runtime.batch as batch_module

    if drafter == "oracle":
        eng = engine.load("tiny", speculative="lookup", num_draft=3, max_batch=4)
        eng.speculative = Speculation(lambda: Oracle(eng, 0.3), 3, adaptive=False)
    else:  # the MTP head reads each row's hidden states out of the packed pass
        eng = engine.load("tiny", speculative="mtp", num_draft=3, max_batch=4)
        eng.speculative = Speculation(eng.speculative.drafter, 3, adaptive=False)
    passes = []
    real = batch_module.run
    monkeypatch.setattr(batch_module, "run", lambda model, rows: (
        passes.append([(row.size, row.partial) for row in rows]) or real(model, rows)))  # fmt: skip
    sampled = {"temperature": 0.9, "top_k": 20, "seed": 7}
    held = Held(eng)
    requests = [Request(eng, messages(60 + i), max_tokens=12) for i in range(3)]
    requests.append(Request(eng, messages(63), max_tokens=12, **sampled))
    held.release()
    turns = [r.turn() for r in requests]
    for turn in turns[:3]:
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 12)[0]
        assert turn.stats.drafted_tokens > 0
    shared = [p for p in passes if len(p) >= 2 and any(n > 1 and not part for n, part in p)]
    assert shared, passes  # verify rows shared passes with other rows
    eng.close()
    # A seed draws what plain decoding alone draws, whatever rows shared the passes.
    plain = engine.load("tiny", max_batch=1)
    assert Request(plain, messages(63), max_tokens=12, **sampled).turn().token_ids == (
        turns[3].token_ids
    )
    plain.close()
