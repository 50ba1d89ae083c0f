"""Idle-time pre-prefill: after warm(), a turn computes only the user's new message."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import QUESTIONS, fresh_greedy

MAX_TOKENS = 5


def new_message_tokens(eng, session, text: str) -> int:
    """Tokens of "<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n" + think prefix."""
    prompt = session.render([{"role": "user", "content": text}], MAX_TOKENS)
    tail = prompt.text[prompt.text.rindex("<|im_start|>user\n") :]
    assert tail.startswith(f"<|im_start|>user\n{text.strip()}<|im_end|>\n<|im_start|>assistant\n")
    return len(eng.tokenizer.encode(tail))


@pytest.mark.parametrize("max_exchanges", [6, 2])  # 2: the later turns trim the window
def test_after_warm_a_turn_prefills_only_the_new_message(tiny, max_exchanges):
    warmed = tiny.session("You are a helpful assistant.", max_exchanges=max_exchanges)
    cold = tiny.session("You are a helpful assistant.", max_exchanges=max_exchanges)
    for i, q in enumerate(QUESTIONS[:6]):
        if i:
            assert warmed.warm() > 0
            assert warmed.warm() == 0  # warming twice does nothing the second time
        expected_prefill = new_message_tokens(tiny, warmed, q)
        turn = warmed.send(q, max_tokens=MAX_TOKENS)
        reference = cold.send(q, max_tokens=MAX_TOKENS)
        assert turn.prompt_ids == reference.prompt_ids
        assert turn.token_ids == reference.token_ids  # identical with or without warming
        assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]
        if i:
            assert turn.stats.prefilled_tokens == expected_prefill
            assert turn.stats.warm_tokens > 0
            assert turn.stats.dropped_exchanges == max(0, i - max_exchanges)
    assert max_exchanges == 6 or turn.stats.dropped_exchanges > 0


def test_send_during_warm_is_served_correctly_and_promptly(tiny):
    # The next turn trims the window, so warm() re-prefills a long history: many chunks.
    s = tiny.session("You are a helpful assistant.", max_exchanges=3)
    for q in QUESTIONS[:4]:
        s.send(q * 12, max_tokens=MAX_TOKENS)
    started, checks, result = threading.Event(), [], {}

    def cancelled() -> bool:
        # First check: hold the warm-up until the send has asked for the model, so the send
        # lands mid-warm however the two threads are scheduled.
        if not checks:
            started.set()
            deadline = time.monotonic() + 30
            while not tiny.background_should_yield() and time.monotonic() < deadline:
                time.sleep(0.005)
        checks.append(1)
        return False

    b = s.render([{"role": "user", "content": "x"}], MAX_TOKENS).boundaries
    warm_work = b.message_starts[-1] - b.system_end
    worker = threading.Thread(target=lambda: result.setdefault("n", s.warm(cancelled)))
    worker.start()
    assert started.wait(30)
    turn = s.send(QUESTIONS[5], max_tokens=MAX_TOKENS)  # arrives mid-warm
    worker.join(30)
    assert not worker.is_alive()
    assert result["n"] < warm_work  # it stopped early for the send
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]
    # The session is consistent: the next turn is exact and reuses the answered prefix.
    nxt = s.send(QUESTIONS[6], max_tokens=MAX_TOKENS)
    assert nxt.token_ids == fresh_greedy(tiny, nxt.prompt_ids, MAX_TOKENS)[0]
    assert nxt.stats.reused_tokens > 0


def test_cancelled_warm_keeps_what_it_finished(tiny):
    s = tiny.session("sys", max_exchanges=2)
    for q in QUESTIONS[:3]:
        s.send(q * 30, max_tokens=MAX_TOKENS)  # the next turn trims: a long warm-up
    calls = []
    done = s.warm(lambda: calls.append(1) or len(calls) > 2)  # stop after two chunks
    assert 0 < done <= 2 * 128
    rest = s.warm()
    assert rest > 0  # the rest of the prefix, from where the first call stopped
    expected = new_message_tokens(tiny, s, QUESTIONS[4])
    turn = s.send(QUESTIONS[4], max_tokens=MAX_TOKENS)
    assert turn.stats.prefilled_tokens == expected
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]


@pytest.mark.parametrize("shape", ["token-budget", "max-exchanges"])
def test_a_warm_up_never_makes_the_next_turn_prefill_more(tiny, shape):
    """warm() cannot know the next message's length, and near the window's token budget that
    length decides whether the window drops an exchange. A warm-up predicting a trim that the
    real (short) message does not make, or followed by a regenerate (whose window is the last
    turn's), must not have thrown the cached conversation away: each turn prefills no more
    than without the warm-up, and answers as a fresh engine given the same messages."""
    import engine
    from engine.session import _TYPICAL_MESSAGE

    if shape == "token-budget":
        options = {"context_window": 120, "max_tokens": 8, "max_exchanges": 6}
        questions = ["My name is Alice.", "What is two plus two?", "What is my name?", "Ok.",
                     "Tell me everything about foxes and their habits, " * 3, "Thanks!"]  # fmt: skip
    else:
        options = {"max_tokens": 8, "max_exchanges": 2}
        questions = QUESTIONS[:5]
    warmed, cold = (tiny.session("You are helpful.", **options) for _ in range(2))
    fresh = engine.load("tiny")
    mispredicted = 0

    def reject(turn):
        raise ValueError("rejected")

    for i, q in enumerate(questions + ["regenerate"]):
        if i:
            typical = warmed.render([{"role": "user", "content": _TYPICAL_MESSAGE}], 8)
            real = warmed.render([{"role": "user", "content": q}], 8)
            mispredicted += typical.dropped > real.dropped
            warmed.warm()
        if q == "regenerate":
            turn, ref = warmed.regenerate(), cold.regenerate()
        else:
            with pytest.raises(ValueError):  # a failed turn first: it keeps the warm-up too
                warmed.send(q, validate=reject)
            turn, ref = warmed.send(q), cold.send(q)
        assert turn.prompt_ids == ref.prompt_ids
        assert turn.stats.prefilled_tokens <= ref.stats.prefilled_tokens, (i, q)
        messages = [{"role": "system", "content": "You are helpful."}]
        messages += [m for ex in warmed.history[:-1] for m in ex] + [warmed.history[-1][0]]
        expected = fresh.chat(messages, warm=False, **options)
        assert (turn.prompt_ids, turn.token_ids) == (expected.prompt_ids, expected.token_ids)
    assert mispredicted or shape == "max-exchanges"  # the shape the test is about did occur
    assert turn.stats.dropped_exchanges > 0  # and the window did trim


def test_a_prediction_that_cannot_fit_the_window_is_skipped_not_raised(tiny):
    """warm() predicts the next prompt for two message lengths; one that cannot fit the token
    budget (the session's max_tokens fills the window, or a typical message does not fit
    beside a long system prompt) is not a turn anyone asked for: warm() skips it, does the
    predictions that fit, and the next turn answers as a fresh prefill does."""
    too_big = tiny.session("sys", context_window=300)  # the default max_tokens (512) > 300
    too_big.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    assert too_big.warm() == 0
    # The shortest message fits beside the system prompt; the typical one does not.
    s = tiny.session("word " * 180, context_window=300, max_tokens=50, max_exchanges=1)
    s.send(QUESTIONS[7], max_tokens=MAX_TOKENS)
    assert s.render([{"role": "user", "content": "x"}], 50).dropped == 0
    assert s.warm() > 0
    turn = s.send("ok", max_tokens=MAX_TOKENS)
    assert turn.stats.warm_tokens > 0
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]
