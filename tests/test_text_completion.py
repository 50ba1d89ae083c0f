"""/v1/completions (legacy, raw prompts) on `tiny`, through the official `openai` client.

References: greedy decoding after one full prefill of the raw prompt ids (`fresh_greedy`),
and for prompt logprobs one forward pass of the model over the whole prompt, with the
log-softmax taken in float64 by numpy.
"""

from __future__ import annotations

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from helpers import SERVER_WINDOW, fresh_greedy
from helpers import openai_client as client

from engine.runtime.batch import WAIT
from engine.runtime.pool import BRANCH_MIN, GRID
from engine.serving.text_completion import LOGPROB_CHUNK, prompt_logprobs

WINDOW = SERVER_WINDOW
GREEDY = {"temperature": 0, "presence_penalty": 0}


def complete(c: openai.OpenAI, prompt, **kw):
    return c.completions.create(model="tiny", prompt=prompt, **{"max_tokens": 5, **GREEDY, **kw})


def test_raw_prompt_no_template_greedy_exact(tiny, server):
    c = client(server)
    prompt = "The fox and the crow, a fable."
    ids = tiny.tokenizer.encode(prompt)
    r = complete(c, prompt)
    expected, _ = fresh_greedy(tiny, ids, 5)
    assert r.choices[0].text == tiny.tokenizer.decode(expected)
    assert r.usage.prompt_tokens == len(ids)  # no template around it
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # Token ids are the same prompt; echo puts the prompt before the answer.
    by_ids = complete(c, ids, echo=True)
    assert by_ids.choices[0].text == prompt + r.choices[0].text
    chunks = list(complete(c, prompt, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_logit_bias_on_a_raw_prompt(tiny, server):
    c = client(server)
    prompt = "The fox and the crow, biased."
    ids = tiny.tokenizer.encode(prompt)
    plain, _ = fresh_greedy(tiny, ids, 5)
    bias = {plain[0]: -100, plain[1]: -100}
    want, _ = fresh_greedy(tiny, ids, 5, bias=bias)
    r = complete(c, prompt, logit_bias={str(k): v for k, v in bias.items()})
    assert r.choices[0].text == tiny.tokenizer.decode(want) != tiny.tokenizer.decode(plain)
    with pytest.raises(openai.BadRequestError) as e:
        complete(c, prompt, logit_bias={str(tiny.tokenizer.vocab_size): 1})
    assert e.value.body["param"] == "logit_bias"


def test_extended_prompt_reuses_the_cached_prefix(tiny, server):
    c = client(server)
    ids = tiny.tokenizer.encode("Few-shot: 1 -> one, 2 -> two,")
    first = complete(c, ids)
    generated, _ = fresh_greedy(tiny, ids, 5)
    assert first.choices[0].text == tiny.tokenizer.decode(generated)
    longer = ids + generated + tiny.tokenizer.encode(" 3 -> three,")
    second = complete(c, longer)
    # The sequence holds the prompt and every generated token but the last (never fed).
    assert second.usage.prompt_tokens_details.cached_tokens == len(ids) + len(generated) - 1
    expected, _ = fresh_greedy(tiny, longer, 5)
    assert second.choices[0].text == tiny.tokenizer.decode(expected)


def test_stop_strings_cut_the_text(server):
    c = client(server)
    full = complete(c, "A long sentence:", max_tokens=12).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = complete(c, "A long sentence:", max_tokens=12, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_echo_prompt_logprobs_equal_a_fresh_forward_pass(tiny, server):
    c = client(server)
    prompt = "Scoring this sentence, token by token."
    ids = tiny.tokenizer.encode(prompt)
    r = complete(c, prompt, max_tokens=0, echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    with tiny.lock:
        logits = tiny.model(mx.array([ids]), tiny.model.make_caches())[0]
        logits = np.array(logits.astype(mx.float32), dtype=np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    lp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # log_softmax
    expected = [lp[t - 1, ids[t]] for t in range(1, len(ids))]
    got = choice.logprobs
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    np.testing.assert_allclose(got.token_logprobs[1:], expected, atol=1e-4)
    for t in range(1, len(ids)):
        best = np.argsort(-lp[t - 1])[:3]
        alternatives = got.top_logprobs[t]
        assert list(alternatives) == [tiny.tokenizer.decode([int(i)]) for i in best]
        np.testing.assert_allclose(list(alternatives.values()), lp[t - 1, best], atol=1e-4)
    assert "".join(got.tokens) == prompt
    assert got.text_offset == [len(tiny.tokenizer.decode(ids[:t])) for t in range(len(ids))]


def _log_softmax(tiny, ids) -> np.ndarray:
    """float64 log-softmax of one forward pass over `ids` on fresh caches."""
    with tiny.lock:
        logits = tiny.model(mx.array([ids]), tiny.model.make_caches())[0]
        logits = np.array(logits.astype(mx.float32), dtype=np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_scoring_runs_in_chunks_that_yield_and_equal_one_pass(tiny):
    """A long prompt is scored chunk by chunk, yielding WAIT between chunks (the other
    requests' rows step there, and a cancelled job stops there), with the values of one
    forward pass over the whole prompt."""
    ids = [int(i) for i in np.random.default_rng(3).integers(100, 5000, 2 * LOGPROB_CHUNK + 45)]
    gen = prompt_logprobs(tiny, ids, 4)
    waits = 0
    while True:
        try:
            item = tiny.worker.call(next, gen)
        except StopIteration as stop:
            scored = stop.value
            break
        assert item is WAIT
        waits += 1
    assert waits == 2  # three chunks
    lp = _log_softmax(tiny, ids)
    np.testing.assert_allclose([v for v, _ in scored],
                               [lp[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4)  # fmt: skip
    for t, (_, top) in enumerate(scored, start=1):
        assert [i for i, _ in top] == list(np.argsort(-lp[t - 1], kind="stable")[:4])
        np.testing.assert_allclose([v for _, v in top], np.sort(lp[t - 1])[::-1][:4], atol=1e-4)


def test_the_same_prompt_again_reuses_all_but_its_last_token(tiny, server):
    c = client(server)
    ids = [int(i) for i in np.random.default_rng(4).integers(100, 5000, 40)]
    first = complete(c, ids)
    again = complete(c, ids)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    expected, _ = fresh_greedy(tiny, ids, 5)
    assert first.choices[0].text == again.choices[0].text == tiny.tokenizer.decode(expected)


def test_few_shot_prompts_resume_at_their_fork_from_the_third_on(tiny, server):
    """Raw prompts that share a long prefix (few-shot examples) and differ after it: the second
    leaves a snapshot at the fork, the third and later resume there (`pool.BRANCH_MIN`)."""
    c = client(server)
    rng = np.random.default_rng(7)
    shots = [int(i) for i in rng.integers(100, 5000, BRANCH_MIN + 20)]
    cached = []
    for _ in range(4):
        ids = shots + [int(i) for i in rng.integers(5000, 9000, 6)]  # a question of its own
        r = complete(c, ids)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        expected, _ = fresh_greedy(tiny, ids, 5)
        assert r.choices[0].text == tiny.tokenizer.decode(expected)
    assert cached[:2] == [0, 0] and cached[2:] == [len(shots), len(shots)]


def test_a_long_raw_prompt_snapshots_on_the_grid_and_the_second_resumes_on_it(tiny, server):
    """A raw prompt has no boundaries past position 0: one longer than the grid (`pool.GRID`)
    snapshots every GRID tokens from there, so the second prompt that shares most of it
    resumes at the grid point below the fork, not from scratch."""
    c = client(server)
    rng = np.random.default_rng(11)
    shared = [int(i) for i in rng.integers(100, 5000, 2 * GRID + 40)]
    for _ in range(2):  # two prompts, each with a question of its own
        ids = shared + [int(i) for i in rng.integers(5000, 9000, 6)]
        r = complete(c, ids)
        expected, _ = fresh_greedy(tiny, ids, 5)
        assert r.choices[0].text == tiny.tokenizer.decode(expected)
    assert r.usage.prompt_tokens_details.cached_tokens == 2 * GRID


def test_a_string_prompt_that_cannot_fit_is_refused_before_tokenizing(tiny, server, monkeypatch):
    calls = []
    encode = tiny.tokenizer.encode
    monkeypatch.setattr(
        tiny.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k)
    )
    huge = "word " * (WINDOW * 60)  # more bytes than WINDOW tokens can hold
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": huge},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in r.json()["error"]["message"] and not calls


def test_a_prompt_and_completion_past_the_window_speak_of_the_prompt(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": [100] * (WINDOW - 10), "max_tokens": 20})  # fmt: skip
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert (
        error["param"] == "max_tokens" and "in the prompt, 20 in the completion" in error["message"]
    )
    assert "messages" not in error["message"]


def test_generated_logprobs_equal_a_teacher_forced_forward_pass(tiny, server):
    c = client(server)
    prompt = "Counting: one, two,"
    ids = tiny.tokenizer.encode(prompt)
    r = complete(c, prompt, max_tokens=5, logprobs=2)
    got = r.choices[0].logprobs
    generated, _ = fresh_greedy(tiny, ids, 5)
    assert got.tokens == [tiny.tokenizer.decode([t]) for t in generated]
    with tiny.lock:  # the prompt and the answer fed at once: the logits before each answer token
        logits = tiny.model(mx.array([ids + generated]), tiny.model.make_caches())[0]
        logits = np.array(logits.astype(mx.float32), dtype=np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    lp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # log_softmax
    rows = [len(ids) - 1 + i for i in range(len(generated))]
    expected = [lp[row, t] for row, t in zip(rows, generated)]
    np.testing.assert_allclose(got.token_logprobs, expected, atol=1e-4)
    for row, alternatives in zip(rows, got.top_logprobs):
        best = np.argsort(-lp[row])[:2]
        assert list(alternatives) == [tiny.tokenizer.decode([int(i)]) for i in best]
    assert got.text_offset == [len(tiny.tokenizer.decode(generated[:i])) for i in range(5)]


def _joined(chunks) -> dict:
    """The streamed chunks' legacy logprobs lists, concatenated."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs is not None:
            for k in out:
                out[k] += getattr(ch.choices[0].logprobs, k) or []
    return out


@pytest.mark.parametrize("kw", [{"max_tokens": 6, "logprobs": 2},
                                {"max_tokens": 0, "echo": True, "logprobs": 1}])  # fmt: skip
def test_streamed_logprobs_concatenate_to_the_whole_answers(tiny, server, kw):
    c = client(server)
    prompt = "Streaming: alpha, beta,"
    whole = complete(c, prompt, **kw).choices[0]
    chunks = list(complete(c, prompt, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.text
    got, ref = _joined(chunks), whole.logprobs
    assert got["tokens"] == ref.tokens and got["text_offset"] == ref.text_offset
    assert len(got["token_logprobs"]) == len(ref.token_logprobs) > 0
    for a, b in zip(got["token_logprobs"], ref.token_logprobs):  # the second call reuses the cache
        assert (a is None and b is None) or abs(a - b) < 1e-4
    assert [list(t or {}) for t in got["top_logprobs"]] == [list(t or {}) for t in ref.top_logprobs]


def test_n_choices_each_with_its_echo_finish_and_seed(tiny, server):
    c = client(server)
    prompt = "Choices: one prompt, two answers,"
    ids = tiny.tokenizer.encode(prompt)
    expected = tiny.tokenizer.decode(fresh_greedy(tiny, ids, 5)[0])
    r = complete(c, prompt, n=2, echo=True)
    assert [(ch.index, ch.text, ch.finish_reason) for ch in r.choices] == [
        (i, prompt + expected, "length") for i in range(2)
    ]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)
    # Sampled: choice i is the answer of the same request with n=1 and seed + i.
    sampled = {"temperature": 1.0, "seed": 7}
    r = complete(c, prompt, n=2, **sampled)
    singles = [complete(c, prompt, **{**sampled, "seed": 7 + i}).choices[0].text for i in range(2)]
    assert [ch.text for ch in r.choices] == singles and singles[0] != singles[1]
    texts, finish, tokens = {}, {}, {}
    for chunk in complete(c, prompt, n=2, stream=True, logprobs=1,
                          stream_options={"include_usage": True}, **sampled):  # fmt: skip
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
            tokens[ch.index] = tokens.get(ch.index, 0) + len(ch.logprobs.tokens)
    assert texts == {0: singles[0], 1: singles[1]}
    assert finish == {0: "length", 1: "length"} and tokens == {0: 5, 1: 5}
    assert chunk.usage.completion_tokens == 10
    # Only the prompt (max_tokens 0, echo): n copies of it, streamed too.
    r = complete(c, prompt, n=2, echo=True, max_tokens=0)
    assert [ch.text for ch in r.choices] == [prompt, prompt]
    chunks = list(complete(c, prompt, n=2, echo=True, max_tokens=0, stream=True))
    assert sorted((ch.index, ch.text) for k in chunks for ch in k.choices if ch.text) == [
        (0, prompt), (1, prompt)]  # fmt: skip


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "logprobs": 2, "echo": True, "max_tokens": 3}, "logprobs"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 10**9]}, "prompt[1]"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": "hi", "max_tokens": WINDOW}, "max_tokens"),
        ({"prompt": "hi", "temperature": 5}, "temperature"),
        ({"prompt": "hi", "max_tokens": False, "echo": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0.0, "echo": True}, "max_tokens"),
        ({"prompt": "hi", "n": 9}, "n"),
    ],
)
def test_bad_requests_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
