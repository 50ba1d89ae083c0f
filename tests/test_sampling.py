"""Sampling options: checked up front, and the penalties against a numpy reference.

Reference semantics (OpenAI): a token already generated in this answer loses
`presence_penalty` once plus `frequency_penalty` x its count; the prompt does not count.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kernels.sampling
from engine.runtime.generate import prefill
from engine.runtime.sampling import (
    RepetitionPenalty,
    Sampler,
    SamplingParams,
    draw,
    pick_rows,
    token_logprobs,
)


def reference(logits, prompt, generated, *, presence=0.0, frequency=0.0, repetition=1.0,
              window=64, bias=None) -> np.ndarray:  # fmt: skip
    """The biased and penalized logits, in float64 numpy, straight from the definitions."""
    out = np.asarray(logits, dtype=np.float64).copy()
    for t, b in (bias or {}).items():
        out[t] += b
    if repetition != 1.0:
        for t in set((list(prompt) + list(generated))[-window:]):
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=len(out))
    return out - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize(
    "presence, frequency, repetition, bias",
    [(1.5, 0.0, 1.0, None), (0.0, 0.7, 1.0, None), (-1.0, 2.0, 1.0, None),
     (0.5, -0.25, 1.3, None), (2.0, 2.0, 0.8, None), (0.0, 0.0, 1.0, {3: -100, 7: 2.5, 49: 100}),
     (1.5, 0.5, 1.3, {0: 5, 4: -0.5})],
)  # fmt: skip
def test_penalties_match_numpy(presence, frequency, repetition, bias):
    rng = np.random.default_rng(7)
    vocab = 50
    prompt = rng.integers(0, vocab, 30).tolist()
    generated = rng.integers(0, 12, 40).tolist()  # a few tokens, many repeats
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition, logit_bias=bias)  # fmt: skip
    sampler = Sampler(params)
    assert not sampler.reads_history  # device-side counts: the decode loop runs ahead
    history = list(prompt)
    for step in range(len(generated) + 1):
        logits = rng.normal(0, 3, vocab).astype(np.float32)
        got = np.array(sampler.process(mx.array(logits), history))
        want = reference(logits, prompt, generated[:step], presence=presence,
                         frequency=frequency, repetition=repetition, bias=bias)  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
        # Greedy picks the reference's best token.
        assert int(Sampler(SamplingParams()).__call__(mx.array(want, dtype=mx.float32), [])) == int(
            np.argmax(want)
        )
        if step < len(generated):
            history.append(generated[step])
            for p in sampler.processors:  # the answer's next token, as a pick would push it
                p.advance(mx.array(generated[step]))


def test_repetition_penalty_from_an_empty_history():
    """No prompt: nothing is penalized until the first pick enters the window; the caller's
    logits are never written (the penalty scatters into its own array)."""
    logits = mx.array([2.0, -1.0, 3.0, 0.5])
    penalty = RepetitionPenalty(2.0, window=4)
    assert penalty(logits, []).tolist() == [2.0, -1.0, 3.0, 0.5]
    penalty.advance(mx.array(1))
    penalty.advance(mx.array(2))
    assert penalty(logits, [1, 2]).tolist() == [2.0, -2.0, 1.5, 0.5]
    assert logits.tolist() == [2.0, -1.0, 3.0, 0.5]


def test_greedy_answers_with_penalties_match_a_numpy_decode(tiny):
    """Session.send with penalties equals a decode that re-runs the whole sequence each step
    (fresh caches, no snapshots) and applies the penalties in numpy."""
    s = tiny.session("Be repetitive.")
    n = 12
    # Random weights rarely repeat a token: a negative presence penalty makes them, and the
    # frequency penalty then pushes a token away once it has repeated enough.
    options = dict(presence_penalty=-1.0, frequency_penalty=0.3)
    turn = s.send("Say something again and again.", max_tokens=n, **options)
    ids, generated = list(turn.prompt_ids), []
    with tiny.lock:
        for _ in range(len(turn.token_ids)):
            logits, _ = prefill(tiny.model, tiny.model.make_caches(), ids + generated, 0)
            want = reference(np.array(logits.astype(mx.float32)), ids, generated,
                             presence=-1.0, frequency=0.3)  # fmt: skip
            token = int(np.argmax(want))
            generated.append(token)
            if token in tiny.stop_ids:
                break
    assert turn.token_ids == generated
    assert len(set(generated)) < len(generated)  # both penalties were at work
    # The penalties changed something: plain greedy gives another answer.
    plain = tiny.session("Be repetitive.").send("Say something again and again.", max_tokens=n)
    assert plain.token_ids != turn.token_ids


@pytest.mark.parametrize(
    "options, name",
    [
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": "3"}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 10**30}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
    ],
)
def test_bad_options_fail_up_front_naming_the_option(tiny, options, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**options)
    s = tiny.session("sys")
    before = (list(s.history), list(s.seq.tokens))
    with pytest.raises(ValueError, match=name):
        s.send("hello", max_tokens=2, **options)
    assert (s.history, s.seq.tokens) == before  # nothing was touched


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_every_seed_mlx_takes_is_accepted(seed):
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    assert 0 <= int(sampler(mx.zeros(8), [])) < 8


@pytest.mark.parametrize(
    "options",
    [{"temperature": 1e-38}, {"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-40},
     {"temperature": 1.0, "min_p": 0.99999999}],
    ids=["temperature-1e-38", "temperature-1e-300", "top_p-1e-40", "min_p-0.99999999"],
)  # fmt: skip
def test_valid_extremes_keep_only_the_top_token(tiny, options):
    """Values the checks accept but float32 cannot hold (a temperature that overflows the
    division, a top_p that rounds to 0 (subnormal: the model thread flushes those), a min_p
    that rounds to 1) draw what their definitions say in float64: only the most likely token
    survives. Picked on an engine's model thread, as turns and the server pick."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(4096).astype(np.float32) * 4
    if "temperature" in options and options["temperature"] < 1e-5:
        assert SamplingParams(**options).temperature == 0  # greedy, as vLLM's epsilon
    else:
        kept = cuts_reference(logits, options["temperature"], 0, options.get("min_p", 0.0),
                              options.get("top_p", 1.0))  # fmt: skip
        assert np.isfinite(kept).sum() == 1
    for seed in range(5):
        params = SamplingParams(**options, seed=seed)
        pick = tiny.worker.call(lambda p=params: int(Sampler(p)(mx.array(logits), [])))
        assert pick == int(np.argmax(logits))


def test_a_top_k_past_int32_keeps_the_whole_vocabulary():
    logits = mx.array(np.random.default_rng(6).standard_normal(2000).astype(np.float32))
    for seed in range(5):
        picks = [Sampler(SamplingParams(temperature=1.0, top_k=k, seed=seed))(logits, [])
                 for k in (2**31, 10**30, 2000)]  # fmt: skip
        assert int(picks[0]) == int(picks[1]) == int(picks[2])  # k >= V: no cut


def cuts_reference(logits, temperature, top_k, min_p, top_p) -> np.ndarray:
    """The kept logits of a sampled pick, from the definitions in float64: `logits /
    temperature`; top-k keeps every value >= the k-th largest (ties at the k-th stay); min-p
    drops probabilities below min_p x the largest; top-p keeps each token whose more probable
    tokens hold less than top_p of the mass (so the first stays, and ties stay together)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if min_p:
        x = np.where(p < min_p * p.max(), -np.inf, x)
    if top_p < 1.0:  # each distinct value's mass, then the mass of the values above it
        which = np.unique(p, return_inverse=True)[1]  # ascending values
        mass = np.bincount(which, weights=p)
        before = np.append(np.cumsum(mass[::-1])[::-1][1:], 0.0)[which]
        x = np.where(before >= top_p, -np.inf, x)
    return x


# (top_k, min_p, top_p)
CUTS = [(20, 0.0, 1.0), (5, 0.0, 0.8), (1, 0.0, 1.0), (300, 0.0, 1.0), (0, 0.1, 1.0),
        (0, 0.0, 0.9), (20, 0.05, 0.95)]  # fmt: skip


@pytest.mark.parametrize("top_k, min_p, top_p", CUTS)
def test_cuts_match_numpy(top_k, min_p, top_p):
    """top-k / min-p / top-p keep the same tokens as the float64 reference, with ties at the
    k-th value (quantized logits) and k beyond the vocabulary."""
    rng = np.random.default_rng(top_k + 11)
    logits = np.round(rng.normal(0.0, 2.0, 257), 1).astype(np.float32)  # many ties
    params = SamplingParams(temperature=0.7, top_k=top_k, min_p=min_p, top_p=top_p)
    got = np.array(Sampler(params).final_logits(mx.array(logits)), dtype=np.float64)
    want = cuts_reference(logits, 0.7, top_k, min_p, top_p)
    assert (np.isinf(got) == np.isinf(want)).all()
    kept = ~np.isinf(want)
    assert kept.sum() >= 1 and np.allclose(got[kept], want[kept], rtol=1e-6)
    if top_k and top_p == 1.0 and not min_p:
        assert kept.sum() >= min(top_k, len(logits))  # ties at the k-th value stay


@pytest.mark.parametrize("top_k", [0, 3])
def test_top_p_keeps_tokens_tied_at_the_boundary_together(top_k):
    """Probabilities 0.5, 0.2, 0.2, 0.1 at top_p 0.6: both 0.2 tokens have 0.5 of more
    probable mass before them, so both stay whatever order a sort puts them in; 0.1 goes."""
    logits = mx.log(mx.array([0.2, 0.5, 0.1, 0.2]))
    params = SamplingParams(temperature=1.0, top_p=0.6, top_k=top_k)
    kept = ~mx.isinf(Sampler(params).final_logits(logits))
    assert kept.tolist() == [True, True, False, True]


# The native pick (kernels/native/sampling.cpp): the cuts above, then the inverse CDF at u in
# index order. Against the float64 reference, a pick counts when it is robust: the same token
# for u and the cut parameters nudged by 1e-5 relative either way (the kernel rounds in
# float32, so a u or a probability that close to a boundary may land on either side).
NUDGE = 1e-5


def draw_reference(logits, u, temperature, top_k, min_p, top_p) -> int | None:
    """The token the inverse CDF picks at `u`, or None if a nudge would change it."""

    def draw(u, min_p, top_p):
        x = cuts_reference(logits, temperature, top_k, min_p, min(top_p, 1.0))
        w = np.exp(x - x.max())
        run = np.cumsum(w)
        return int(np.argmax(run > u * run[-1]))

    picks = {draw(u * (1 + d), min_p * (1 + e), top_p if top_p == 1 else top_p * (1 + e))
             for d in (-NUDGE, 0, NUDGE) for e in (-NUDGE, 0, NUDGE)}  # fmt: skip
    return picks.pop() if len(picks) == 1 else None


@pytest.mark.parametrize("top_k, min_p, top_p", [*CUTS, (0, 0.0, 1.0)])
@pytest.mark.parametrize("vocab", [257, 5000])
def test_native_pick_matches_the_float64_draw(mod, top_k, min_p, top_p, vocab):
    """Random and tie-heavy logits, each at a spread of u: the kernel picks the reference's
    token wherever that token is robust, and at least 90% of the cases are."""
    rng = np.random.default_rng(vocab + top_k)
    robust = 0
    cases = 0
    for trial in range(6):
        logits = rng.normal(0.0, 2.0 + trial, vocab).astype(np.float32)
        if trial % 2:
            logits = np.round(logits, 0)  # many ties, at the k-th value too
        for u in rng.uniform(0.0, 1.0, 8).astype(np.float32):
            want = draw_reference(logits, float(u), 0.7, top_k, min_p, top_p)
            cases += 1
            if want is None:
                continue
            got = mod.sample(mx.array(logits), mx.array(u), 0.7, top_k, top_p, min_p).item()
            assert got == want, (trial, float(u))
            robust += 1
    assert robust >= 0.9 * cases


def test_native_pick_edges(mod):
    """Masked vocabularies (a grammar), every value tied, u at the ends, and rows of a batch."""
    masked = np.full(3000, -np.inf, dtype=np.float32)
    masked[[7, 900, 2999]] = [1.0, 3.0, 2.0]
    for u in (0.0, 0.5, 0.99):
        want = draw_reference(masked, u, 1.0, 20, 0.0, 0.9)  # k beyond the finite values
        assert mod.sample(mx.array(masked), mx.array(u), 1.0, 20, 0.9).item() == want
    assert mod.sample(mx.full((10,), -mx.inf), mx.array(0.5), 1.0, 5).item() == 0  # nothing
    # 50,000 tied values with top_k 20 keep all of them (ties stay): u = 0.5 is the middle
    assert mod.sample(mx.zeros(50_000), mx.array(0.5), 1.0, 20).item() == 25_000
    assert mod.sample(mx.zeros(100), mx.array(0.0), 1.0).item() == 0
    rows = mx.random.normal((5, 4096), key=mx.random.key(1)) * 3
    us = mx.array([0.1, 0.3, 0.5, 0.7, 0.9])
    batch = mod.sample(rows, us, 0.8, 20, 0.95).tolist()
    assert batch == [mod.sample(rows[i], us[i], 0.8, 20, 0.95).item() for i in range(5)]
    # The rows as arrays of their own (a batched step's, strided views too): the same picks.
    assert mod.sample_rows(list(rows), us, 0.8, 20, 0.95).tolist() == batch
    strided = rows[:, ::3]
    assert mod.sample_rows(list(strided), us, 0.8, 20).tolist() == mod.sample(
        strided, us, 0.8, 20).tolist()  # fmt: skip
    with pytest.raises(ValueError, match="one u per row"):
        mod.sample(rows, us[:3], 0.8)
    with pytest.raises(ValueError, match="one u per row"):
        mod.sample_rows(list(rows), us[:3], 0.8)
    with pytest.raises(ValueError, match="rows \\[V\\] of one V"):
        mod.sample_rows([rows[0], rows[1, :100]], us[:2], 0.8)
    with pytest.raises(ValueError, match="temperature"):
        mod.sample(rows, us, 0.0)
    # A row of another dtype anywhere: MLX's ops (None), not the native pass's ValueError.
    mixed = [rows[0], rows[1].astype(mx.bfloat16)]
    assert kernels.sampling.sample_rows(mixed, us[:2], temperature=0.8) is None


def test_seeded_picks_follow_the_distribution(mod):
    """4,000 seeded picks through `Sampler` (the native pass on the CPU) land on each kept
    token as often as the reference's probabilities say, and never on a cut one."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -0.5, 1.5], dtype=np.float32)
    x = cuts_reference(logits, 0.9, 5, 0.0, 0.9)
    want = np.exp(x - x.max())
    want /= want.sum()
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=7))
    picks = mx.stack([sampler.pick(mx.array(logits)) for _ in range(4000)])
    freq = np.bincount(np.array(picks), minlength=len(logits)) / 4000
    assert (freq[want == 0] == 0).all()
    assert np.abs(freq - want).max() < 0.03  # ~4 standard deviations at p = 0.5
    again = Sampler(SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=7))
    assert [again.pick(mx.array(logits)).item() for _ in range(50)] == picks[:50].tolist()


def test_pick_without_native_kernels_draws_from_the_cuts(monkeypatch):
    """Off the native path (CHATML_NATIVE=0, or a GPU) the pick is MLX's inverse-CDF `draw`
    over `final_logits`: it never lands on a cut token."""
    from kernels import native

    monkeypatch.setenv("CHATML_NATIVE", "0")
    native.reset()
    try:
        logits = mx.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=3))
        picks = {sampler.pick(logits).item() for _ in range(200)}
        assert picks == {0, 5}
    finally:
        monkeypatch.undo()
        native.reset()


@pytest.mark.parametrize("top_k, min_p, top_p", [(20, 0.05, 0.95), (0, 0.0, 1.0), (5, 0.0, 0.8)])
def test_native_residual_draw_matches_the_float64_reference(mod, top_k, min_p, top_p):
    """`sample_excluding` (speculative sampling's verify): the excluded draft's probability
    under the cut distribution, and the draw from the rest renormalized, as in float64."""
    rng = np.random.default_rng(top_k)
    robust = cases = 0
    for trial in range(8):
        logits = rng.normal(0.0, 2.0, 3000).astype(np.float32)
        x = cuts_reference(logits, 0.7, top_k, min_p, top_p)
        p = np.exp(x - x.max())
        p /= p.sum()
        kept = np.flatnonzero(p)
        draft = int(kept[trial % len(kept)]) if trial % 3 else int(np.argmin(p))  # maybe cut
        for u in rng.uniform(0.0, 1.0, 4).astype(np.float32):
            token, p_draft = mod.sample_excluding(mx.array(logits[None]), mx.array([float(u)]),
                                                  mx.array([draft], dtype=mx.int32), 0.7,
                                                  top_k, top_p, min_p)  # fmt: skip
            assert abs(p_draft.item() - p[draft]) <= 1e-5 * max(p[draft], 1e-3)
            w = np.where(np.arange(len(p)) == draft, 0.0, p)
            run = np.cumsum(w) / w.sum()
            near = np.abs(run - u).min() < NUDGE
            cases += 1
            if not near and (p_draft.item() == 0) == (p[draft] == 0):
                assert token.item() == int(np.argmax(run > u)) != draft
                robust += 1
    assert robust >= 0.9 * cases


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_native_logprobs_match_float64(mod, k):
    """`logprobs` (what `top_logprobs` reports): log_softmax at the token and the k largest,
    most likely first, against float64; on tie-heavy logits, and with k equal to V."""
    rng = np.random.default_rng(k)
    for trial, V in enumerate([5000, 5000, 300, k or 1]):
        x = rng.normal(0.0, 3.0, V).astype(np.float32)
        if trial == 1:
            x = np.round(x)  # ties: which of the tied ids is reported does not matter
        ref = x.astype(np.float64)
        ref = ref - (ref.max() + np.log(np.exp(ref - ref.max()).sum()))
        token = int(rng.integers(V))
        chosen, ids, values = mod.logprobs(mx.array(x), mx.array(token, dtype=mx.uint32), k)
        assert abs(chosen.item() - ref[token]) <= 1e-5 * max(1.0, abs(ref[token]))
        ids, values = np.array(ids), np.array(values, dtype=np.float64)
        assert ids.shape == values.shape == (k,) and len(set(ids.tolist())) == k
        np.testing.assert_allclose(values, np.sort(ref)[::-1][:k], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(values, ref[ids], rtol=1e-5, atol=1e-5)


def test_recorded_logprobs_agree_on_both_paths(monkeypatch):
    """`Sampler(top_logprobs=k)` records the same log-probabilities and top ids through the
    native pass as through MLX's ops (a GPU's path, or without the native module)."""
    import kernels.sampling

    logits = mx.random.normal((3, 4000), key=mx.random.key(5)) * 3

    def record(native: bool) -> list:
        if not native:
            monkeypatch.setattr(kernels.sampling, "_module", lambda logits: None)
        sampler = Sampler(SamplingParams(), top_logprobs=5)
        tokens = [sampler(logits[i], []).item() for i in range(3)]
        sampler.accept(tokens)
        monkeypatch.undo()
        return sampler.recorded

    native, ops = record(True), record(False)
    for a, b in zip(native, ops, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-5
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert np.allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native", "mlx-ops"])
@pytest.mark.parametrize("k", [0, 1, 7])
def test_token_logprobs_of_rows_match_float64(monkeypatch, native, k):
    """Rows `[T, V]` (a scored prompt): each row's log_softmax at its token and its k largest,
    through the native pass and through MLX's ops, against numpy in float64."""
    import kernels.sampling

    if not native:
        monkeypatch.setattr(kernels.sampling, "_module", lambda logits: None)
    rng = np.random.default_rng(k)
    logits = (rng.standard_normal((6, 3000)) * 3).astype(np.float32)
    tokens = rng.integers(0, 3000, 6)
    chosen, ids, values = token_logprobs(mx.array(logits), mx.array(tokens), k)
    x = logits.astype(np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.array(chosen), lp[np.arange(6), tokens], atol=1e-5)
    assert ids.shape == values.shape == (6, k)
    for row in range(6):
        assert sorted(np.array(ids[row]).tolist()) == sorted(np.argsort(-lp[row])[:k].tolist())
        np.testing.assert_allclose(np.array(values[row]), lp[row, np.array(ids[row])], atol=1e-5)


@pytest.mark.parametrize("top_k, min_p, top_p", CUTS)
def test_cuts_cut_each_row_of_a_batch_as_the_float64_reference(top_k, min_p, top_p):
    """`final_logits` over rows `[n, V]` (a batch's picks): each row keeps the tokens the
    float64 reference keeps for that row alone, ties and all."""
    rng = np.random.default_rng(top_k + 23)
    rows = np.round(rng.normal(0.0, 2.0, (4, 257)) * [[1], [2], [0.5], [3]], 1).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=top_k, min_p=min_p, top_p=top_p)
    got = np.array(Sampler(params).final_logits(mx.array(rows)), dtype=np.float64)
    for row, out in zip(rows, got):
        want = cuts_reference(row, 0.7, top_k, min_p, top_p)
        assert (np.isinf(out) == np.isinf(want)).all()
        assert np.allclose(out[~np.isinf(want)], want[~np.isinf(want)], rtol=1e-6)


@pytest.mark.parametrize("top_k, min_p, top_p", [*CUTS, (0, 0.0, 1.0)])
def test_mlx_draw_matches_the_float64_draw(top_k, min_p, top_p):
    """Off the native path (a GPU) rows are drawn by `draw`: the reference's token for each
    row's u wherever that token is robust (see `draw_reference`), 90% of cases at least."""
    rng = np.random.default_rng(top_k + 5)
    params = SamplingParams(temperature=0.7, top_k=top_k, min_p=min_p, top_p=top_p)
    robust = cases = 0
    for trial in range(4):
        rows = rng.normal(0.0, 2.0 + trial, (8, 3000)).astype(np.float32)
        if trial % 2:
            rows = np.round(rows, 0)
        us = rng.uniform(0.0, 1.0, 8).astype(np.float32)
        got = draw(Sampler(params).final_logits(mx.array(rows)), mx.array(us)).tolist()
        for row, u, token in zip(rows, us, got):
            want = draw_reference(row, float(u), 0.7, top_k, min_p, top_p)
            cases += 1
            if want is not None:
                assert token == want, (trial, float(u))
                robust += 1
    assert robust >= 0.9 * cases


def test_mlx_draw_edges():
    """A masked vocabulary, u at the ends, and a row with nothing left (every logit -inf:
    token 0, as the native pass answers)."""
    masked = np.full((3, 3000), -np.inf, dtype=np.float32)
    masked[:, [7, 900, 2999]] = [1.0, 3.0, 2.0]
    us = [0.0, 0.5, 0.99]
    got = draw(mx.array(masked), mx.array(us)).tolist()
    assert got == [draw_reference(masked[0], u, 1.0, 0, 0.0, 1.0) for u in us]
    assert draw(mx.full((2, 10), -mx.inf), mx.array([0.2, 0.7])).tolist() == [0, 0]


PICKS = [dict(), dict(temperature=0.8, top_k=20, top_p=0.95, seed=1),
         dict(temperature=0.8, top_k=20, top_p=0.95, seed=2, presence_penalty=1.5),
         dict(), dict(temperature=0.8, top_k=20, top_p=0.95, seed=3, repetition_penalty=1.2),
         dict(temperature=1.1, min_p=0.05, seed=4)]  # fmt: skip


@pytest.mark.parametrize("path", ["native", "mlx ops", "gpu"])
def test_rows_picked_together_pick_as_each_row_alone(monkeypatch, path):
    """`pick_rows` over six rows (greedy, sampled with the same cuts and seeds of their own,
    penalties, other cuts, logprobs): every row's tokens and logprobs, over eight steps, are
    those of its sampler called alone; rows sharing their cuts are picked in one call. On
    the native pass, through MLX's ops, and as on a GPU (the rows stacked, greedy ones too)."""
    import engine.runtime.sampling as sampling

    if path != "native":
        monkeypatch.setattr("kernels.sampling._module", lambda logits: None)
    if path == "gpu":
        monkeypatch.setattr(sampling, "device_kind", lambda: "gpu")
    calls = []
    real = sampling._picks
    monkeypatch.setattr(sampling, "_picks", lambda x, s: calls.append(len(x)) or real(x, s))
    V = 5000
    steps = mx.random.normal((8, len(PICKS), V), key=mx.random.key(9)) * 2

    def samplers():
        return [Sampler(SamplingParams(**o), top_logprobs=2 if i == 0 else None)
                for i, o in enumerate(PICKS)]  # fmt: skip

    together, alone = samplers(), samplers()
    histories = [[5, 6, 7] for _ in PICKS]
    got, want = [], []
    for logits in steps:
        got.append([t.item() for t in pick_rows(together, list(logits), histories)])
        want.append([s(logits[i], histories[i]).item() for i, s in enumerate(alone)])
        for history, token in zip(histories, got[-1]):
            history.append(token)
    assert got == want
    assert len({tuple(row) for row in np.array(got).T.tolist()}) == len(PICKS)  # rows differ
    together[0].accept([row[0] for row in got])
    alone[0].accept([row[0] for row in want])
    assert [(r.token, r.logprob) for r in together[0].recorded] == [
        (r.token, r.logprob) for r in alone[0].recorded]  # fmt: skip
    # Per step: greedy rows 0 and 3 in one argmax, rows 1, 2 and 4 (top_k 20, top_p 0.95 at
    # 0.8) in one draw, row 5 alone; then each row alone.
    assert calls == [2, 3, 1, *[1] * len(PICKS)] * 8


def test_a_failed_pick_of_rows_leaves_the_others_drawing_as_alone():
    """A batched step whose picks fail is retried row by row (`batch.Batch.step`), so a
    failed `pick_rows` must leave every sampler as it was. A row of a later group (other
    cuts) whose draw fails used to leave the seeded rows of earlier groups a key further on:
    retried alone, they drew other tokens than alone."""

    class Broken(Sampler):
        def uniform(self):
            raise RuntimeError("injected draw failure")

    V = 5000
    steps = mx.random.normal((8, 2, V), key=mx.random.key(9)) * 2
    seeded = dict(temperature=0.8, top_k=20, top_p=0.95, seed=1)
    row, alone = Sampler(SamplingParams(**seeded)), Sampler(SamplingParams(**seeded))
    broken = Broken(SamplingParams(temperature=1.1, min_p=0.05, seed=4))
    got, want = [], []
    for logits in steps:
        with pytest.raises(RuntimeError, match="injected draw failure"):
            pick_rows([row, broken], list(logits), [[5], [5]])
        got.append(pick_rows([row], [logits[0]], [[5]])[0].item())  # the retry, alone
        want.append(alone(logits[0], [5]).item())
    assert got == want


@pytest.mark.parametrize("top_k, min_p, top_p", [(20, 0.05, 0.95), (0, 0.0, 1.0)])
def test_residual_draws_agree_on_both_paths(monkeypatch, top_k, min_p, top_p):
    """`Sampler.residual` (speculative sampling's verify) with one key: the native pass and
    MLX's ops (a GPU's path) draw at the same uniforms by the same inverse CDF, so the draft
    probabilities agree within 1e-5 and the fallback tokens wherever a token is not within
    1e-5 of a boundary (at least 90% of the rows)."""
    import kernels.sampling

    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=0.8, top_k=top_k, min_p=min_p, top_p=top_p)
    agree = rows = 0
    for trial in range(6):
        processed = mx.array(rng.normal(0.0, 2.0, (5, 3000)).astype(np.float32))
        drafts = rng.integers(0, 3000, 4).tolist()
        drafts[trial % 4] = int(np.argmax(np.array(processed[trial % 4])))  # one kept draft
        key = mx.random.key(trial)
        native = Sampler(params).residual(processed, drafts, key)
        monkeypatch.setattr(kernels.sampling, "_module", lambda logits: None)
        ops = Sampler(params).residual(processed, drafts, key)
        monkeypatch.undo()
        np.testing.assert_allclose(np.array(native[0]), np.array(ops[0]), atol=1e-5)
        rows += 5
        agree += sum(a == b for a, b in zip(native[1].tolist(), ops[1].tolist()))
    assert agree >= 0.9 * rows


def test_a_logit_bias_past_the_vocabulary_fails_before_the_turn(tiny):
    s = tiny.session("sys")
    before = (list(s.history), list(s.seq.tokens))
    vocab = tiny.tokenizer.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias names token {vocab}, past the vocabulary"):
        s.send("hello", max_tokens=2, logit_bias={1: 1.0, vocab: -100})
    assert (s.history, s.seq.tokens) == before  # nothing was touched
    banned = s.send("hello", max_tokens=1).token_ids[0]  # the greedy first token, then banned
    s.reset()
    assert s.send("hello", max_tokens=1, logit_bias={banned: -100}).token_ids[0] != banned
