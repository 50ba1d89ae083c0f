"""A separate draft model (`speculative="draft:NAME"`) against plain decoding and a fresh
prefill: the target's answers are unchanged, and the draft model's own hybrid cache holds
exactly the tokens that stood, across turns and rejections.

`tiny` drafting for itself accepts every draft (the acceptance path); `tiny` built with
another seed almost never agrees with it (the rejection path).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers import QUESTIONS, fresh_greedy

import engine
from engine.checkpoints import registry
from engine.checkpoints.builder import build
from engine.runtime.cache import KVCache
from engine.runtime.draft import DraftModel
from engine.runtime.generate import prefill
from engine.runtime.speculative import Speculation


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return build(registry.get("tiny"), tmp_path_factory.mktemp("d") / "tiny-seed1", seed=1)


def _engine(draft: str):
    eng = engine.load("tiny", speculative=f"draft:{draft}", num_draft=3)
    assert isinstance(eng.speculative.drafter, DraftModel)
    eng.speculative = Speculation(eng.speculative.drafter, 3, adaptive=False)
    return eng


def _script(eng, full=True):
    """Plain turns, a trimming turn, regenerate, an interrupted stream (the first three
    without `full`); every answer checked against a fresh prefill's greedy tokens."""
    s = eng.session("You are terse.", max_exchanges=1)
    turns = [s.send(q, max_tokens=8) for q in QUESTIONS[:3]]  # the third trims
    assert turns[-1].stats.dropped_exchanges == 1
    if not full:
        return _checked(eng, turns)
    turns.append(s.regenerate(max_tokens=8))
    stream = s.stream(QUESTIONS[4], max_tokens=8)
    next(stream)
    stream.close()
    turns.append(s.send(QUESTIONS[5], max_tokens=8))
    return _checked(eng, turns)


def _checked(eng, turns):
    for turn in turns:
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 8)[0]
        assert turn.stats.drafted_tokens > 0
    return turns


def _draft_caches_hold_their_tokens(draft: DraftModel):
    """Each draft sequence's caches equal a fresh prefill of its tokens (states to 1e-3
    after its chunked, stepped and rolled-back rounding)."""
    model = draft.engine.model
    for i, seq in enumerate(draft.sequences):
        fresh = model.make_caches()
        prefill(model, fresh, seq.tokens, 0)
        assert {c.offset for c in seq.caches} == {len(seq.tokens)}
        for layer, (a, b) in enumerate(zip(seq.caches, fresh)):
            pairs = zip(a.state, b.state) if isinstance(a, KVCache) else \
                [(a.conv, b.conv), (a.state, b.state)]  # fmt: skip
            for x, y in pairs:
                # (seen once in CI, not reproduced: sequence 0's first conv tail differed in
                # every value; the message says where, for the next time)
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-3, err_msg=(
                    f"draft sequence {i} of {len(draft.sequences)}, layer {layer}, "
                    f"{len(seq.tokens)} tokens {seq.tokens}"))  # fmt: skip


def test_a_draft_model_that_is_the_target_has_every_draft_stand():
    eng = _engine("tiny")
    turns = _script(eng)
    for turn in turns:
        assert turn.stats.accepted_tokens == turn.stats.drafted_tokens
    draft = eng.speculative.drafter
    # Reuse across turns: the draft model prefills about what the target does (it snapshots
    # right after each <|im_start|>, up to 2 tokens before the target's boundaries).
    target = sum(t.stats.prefilled_tokens for t in turns)
    assert draft.prefilled <= target + 2 * len(turns) < sum(len(t.prompt_ids) for t in turns)
    with draft.engine.lock:
        _draft_caches_hold_their_tokens(draft)


def test_a_draft_model_that_disagrees_keeps_the_answers_and_its_caches_exact(other):
    eng = _engine(str(other))
    turns = _script(eng, full=False)
    assert sum(t.stats.accepted_tokens for t in turns) < sum(t.stats.drafted_tokens for t in turns)
    with eng.speculative.drafter.engine.lock:
        _draft_caches_hold_their_tokens(eng.speculative.drafter)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny, tmp_path, capsys):
    folder = tmp_path / "other-tokenizer"
    shutil.copytree(tiny.path, folder)
    with open(folder / "tokenizer.json", "a") as f:
        f.write(" ")  # the same JSON, other bytes: not provably the same tokenizer
    with pytest.raises(ValueError, match="the draft model's tokenizer differs"):
        engine.load("tiny", speculative=f"draft:{folder}")
    from engine.cli import main

    with pytest.raises(SystemExit):
        main(["chat", "--speculative", "draft:", "-p", "hi"])
    assert "expected lookup, mtp or draft:NAME" in capsys.readouterr().err


def test_the_cli_says_a_draft_model_with_another_tokenizer_is_refused(tiny, tmp_path, capsys):
    """`chatml chat --speculative draft:NAME` with a draft model that cannot draft for the
    target: one line naming the problem and exit status 1, as for a bad model name, not a
    traceback."""
    folder = tmp_path / "other-tokenizer"
    shutil.copytree(tiny.path, folder)
    with open(folder / "tokenizer.json", "a") as f:
        f.write(" ")
    from engine.cli import main

    assert main(["chat", "--model", "tiny", "--speculative", f"draft:{folder}", "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert "chatml chat: speculative='draft:" in err and "tokenizer differs" in err


def test_two_answers_drafting_at_once_keep_a_draft_sequence_each():
    """Two answers drafting at once (two conversations on the model thread, their steps
    interleaved): each drafter keeps the draft sequence it took. They shared one (both prompts
    start alike: the best match for each), so each proposal prefilled its own conversation
    over the other's, from the last snapshot, at every step."""
    eng = _engine("tiny")
    draft = eng.speculative.drafter
    histories = [eng.session("You are terse.").render([{"role": "user", "content": q}], 8).ids
                 + [198] for q in QUESTIONS[:2]]  # fmt: skip
    drafters = [draft(), draft()]
    with draft.engine.lock:
        for step in range(3):
            for d, history in zip(drafters, histories):
                history += [*d.propose(history, 3), 198]  # the drafts stand, and one more
            if step == 0:
                prefilled = draft.prefilled
        assert draft.prefilled == prefilled  # after the first proposals: steps only
        assert drafters[0].seq is not drafters[1].seq
        _draft_caches_hold_their_tokens(draft)
