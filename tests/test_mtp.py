"""The MTP head and its drafter against independent references: a float64 numpy forward of
the head written from the checkpoint file (Hub layout), a fresh prefill of the same tokens,
and plain decoding.

Random weights make the head's drafts almost always wrong, which exercises rejection; the
acceptance paths run with an injected drafter on the same engine, so the MTP cache rides
through every rollback position too.
"""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import QUESTIONS, fresh_greedy
from safetensors.numpy import load_file, save_file

import engine
from engine.checkpoints import registry
from engine.checkpoints.builder import build, tensor_plan
from engine.checkpoints.loader import CheckpointError
from engine.runtime.cache import KVCache, MTPCache
from engine.runtime.generate import decode, prefill
from engine.runtime.mtp import MTPDrafter
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.speculative import (
    DraftLength,
    InjectedDrafter,
    Speculation,
    SpeculationStats,
    speculative_decode,
)
from engine.runtime.step import Row, forward

PROMPT = [9707, 11, 1879, 0, 3555, 525, 498, 30, 151645, 198, 151644, 77091, 198] * 2
N = 12


@pytest.fixture(scope="module")
def mtp():
    return engine.load("tiny", speculative="mtp", num_draft=3)


def _plain(model, ids, n, params=None):
    caches = model.make_caches()
    logits, _ = prefill(model, caches, ids, 0)
    return list(decode(model, caches, logits, Sampler(params or SamplingParams()), max_tokens=n,
                       stop_ids=(), history=list(ids)))  # fmt: skip


def _arrays(caches) -> list[np.ndarray]:
    out = []
    for c in caches:
        if isinstance(c, MTPCache):
            out += [*(c.rows or ()), c.state]
        elif isinstance(c, KVCache):
            out += list(c.state)
        else:
            out += [c.conv, c.state]
    return [np.array(a) for a in out]


def _assert_holds(model, caches, tokens, next_token, atol=1e-4):
    """`caches` (the MTP head's included) equal a fresh prefill of `tokens`, and so do the
    logits after `next_token`."""
    fresh = model.make_caches()
    prefill(model, fresh, tokens, 0)
    assert isinstance(caches[-1], MTPCache) and {c.offset for c in caches} == {len(tokens)}
    assert caches[-1].kv.offset == len(tokens) - 1
    ours, theirs = _arrays(caches), _arrays(fresh)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, atol=atol)
    ((a, _),) = forward(model, [Row(caches, [next_token])])
    ((b, _),) = forward(model, [Row(fresh, [next_token])])
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


# ----- the checkpoint ------------------------------------------------------------------------


def test_builder_writes_the_mtp_head_as_qwen_checkpoints_do(tmp_path, mtp):
    entry = registry.get("tiny")
    h = entry.arch.hidden_size
    path = mtp.path
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["mtp_use_dedicated_embeddings"] is False
    w = load_file(str(path / "model.safetensors"))
    assert w["mtp.fc.weight"].shape == (h, 2 * h)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert w[f"mtp.{name}.weight"].shape == (h,)
    main_layer = "model.language_model.layers.3."  # a full-attention layer: same tensors
    main = {k[len(main_layer) :]: v.shape for k, v in w.items() if k.startswith(main_layer)}
    head = {k[len("mtp.layers.0.") :]: v.shape for k, v in w.items()
            if k.startswith("mtp.layers.0.")}  # fmt: skip
    assert head == main
    assert not any(k.startswith("mtp.layers.1.") for k in w)
    # The head has its own seed stream: the target's tensors are those of a build without it.
    bare = dataclasses.replace(entry, arch=dataclasses.replace(entry.arch, mtp_num_hidden_layers=0))
    assert not any(s.name.startswith("mtp.") for s in tensor_plan(bare.arch))
    without = load_file(str(build(bare, tmp_path / "bare") / "model.safetensors"))
    assert set(without) == {k for k in w if not k.startswith("mtp.")}
    assert all(np.array_equal(without[k], w[k]) for k in without)


def test_a_checkpoint_without_the_head_is_refused_clearly(tiny, tmp_path, capsys):
    """As an mlx-community conversion: the config keeps mtp_num_hidden_layers, the weights
    are gone. Plain loading still works; speculative='mtp' says why not, before loading."""
    import shutil

    folder = tmp_path / "no-mtp"
    shutil.copytree(tiny.path, folder)
    w = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in w.items() if not k.startswith("mtp.")},
              str(folder / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    assert engine.load(str(folder)).checkpoint.mtp_tensors == 0
    with pytest.raises(CheckpointError, match=r"no-mtp: speculative='mtp' needs the checkpoint's "
                       r"MTP head.*mlx-community.*speculative='lookup'"):  # fmt: skip
        engine.load(str(folder), speculative="mtp")
    from engine.cli import main

    assert main(["chat", "--model", str(folder), "--speculative", "mtp", "-p", "hi"]) == 1
    assert "needs the checkpoint's MTP head" in capsys.readouterr().err


def test_plain_loading_skips_the_head_and_counts_it_only_when_kept(tiny, mtp):
    from mlx.utils import tree_flatten

    from engine.checkpoints.loader import weights_nbytes

    assert "mtp" not in tiny.model and len(tiny.model.make_caches()) == len(tiny.model.layers)
    for eng, keep in ((tiny, False), (mtp, True)):
        loaded = sum(v.nbytes for _, v in tree_flatten(eng.model.parameters()))
        assert weights_nbytes(eng.checkpoint, 4, dequantize_quantized=True, mtp=keep) == loaded


# ----- the head's forward --------------------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _reference_head(w, arch, hidden, tokens):
    """float64 logits `[T, V]` of the MTP head over rows j = 0..T-1 pairing `hidden[j]` (the
    target's normed hidden state at j, or the head's own output for a chained draft) with
    `tokens[j]` (the token at j+1), at RoPE position j; from the Hub tensors."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    eps, d = arch.rms_norm_eps, arch.head_dim
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads

    def one(name):  # Hub norms are stored as offsets from 1
        return 1.0 + f[name]

    emb = f["model.language_model.embed_tokens.weight"]
    e = _rms(emb[tokens], one("mtp.pre_fc_norm_embedding.weight"), eps)
    hn = _rms(hidden, one("mtp.pre_fc_norm_hidden.weight"), eps)
    x = np.concatenate([e, hn], axis=-1) @ f["mtp.fc.weight"].T  # embedding first
    p = "mtp.layers.0."
    a = _rms(x, one(p + "input_layernorm.weight"), eps)
    T = len(tokens)
    qg = (a @ f[p + "self_attn.q_proj.weight"].T).reshape(T, nq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(T, nq * d)
    k = (a @ f[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, d)
    v = (a @ f[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, d)
    q, k = (
        _rms(q, one(p + "self_attn.q_norm.weight"), eps),
        _rms(k, one(p + "self_attn.k_norm.weight"), eps),
    )
    rot = int(d * arch.partial_rotary_factor)
    inv = arch.rope_theta ** (-np.arange(0, rot, 2) / rot)
    ang = np.arange(T)[:, None] * inv[None]  # [T, rot/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(t):
        t1, t2 = t[..., : rot // 2], t[..., rot // 2 : rot]
        return np.concatenate([t1 * cos - t2 * sin, t1 * sin + t2 * cos, t[..., rot:]], -1)

    q, k = rope(q), rope(k)
    rep = nq // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * d**-0.5
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    y = np.einsum("hts,shd->thd", s, v).reshape(T, nq * d) / (1 + np.exp(-gate))
    x = x + y @ f[p + "self_attn.o_proj.weight"].T
    m = _rms(x, one(p + "post_attention_layernorm.weight"), eps)
    g, u = m @ f[p + "mlp.gate_proj.weight"].T, m @ f[p + "mlp.up_proj.weight"].T
    x = x + (g / (1 + np.exp(-g)) * u) @ f[p + "mlp.down_proj.weight"].T
    out = _rms(x, one("mtp.norm.weight"), eps)
    return out, out @ emb.T  # tied LM head


def test_drafts_match_a_float64_forward_of_the_head(mtp):
    """After a prefill the head's cache holds the rows (h_j, x_{j+1}); the first draft adds
    the row of the pending token, the second chains the head's own output."""
    model, arch = mtp.model, mtp.entry.arch
    w = load_file(str(mtp.path / "model.safetensors"))
    ids, pending = PROMPT[:-1], PROMPT[-1]
    plain = model.make_caches()[:-1]  # the target alone
    h = np.array(model.hidden(mx.array([ids]), plain)[0], dtype=np.float64)
    out, logits = _reference_head(w, arch, h, ids[1:] + [pending])
    d1 = int(np.argmax(logits[-1]))
    _, chained = _reference_head(w, arch, np.concatenate([h, out[-1:]]), ids[1:] + [pending, d1])
    d2 = int(np.argmax(chained[-1]))

    caches = model.make_caches()
    prefill(model, caches, ids, 0)
    cache = caches[-1]
    assert cache.offset == len(ids) and cache.kv.offset == len(ids) - 1
    np.testing.assert_allclose(np.array(cache.state[0, 0]), h[-1], atol=1e-5)
    assert model.mtp.draft(model, cache, pending, 2) == [d1, d2]
    assert cache.kv.offset == len(ids) - 1  # the draft rows are trimmed
    o = model.mtp(model.embed_tokens(mx.array([[pending]])), cache.state, cache.kv)
    np.testing.assert_allclose(np.array(model.logits(o)[0, -1]), logits[-1], atol=1e-4)
    o2 = model.mtp(model.embed_tokens(mx.array([[d1]])), o, cache.kv)
    np.testing.assert_allclose(np.array(model.logits(o2)[0, -1]), chained[-1], atol=1e-4)


# ----- speculation: identity and rollback ----------------------------------------------------


@pytest.fixture(scope="module")
def truth(mtp):
    return _plain(mtp.model, PROMPT, N + 4)


def _speculate(model, drafter, k, n=N, params=None):
    caches = model.make_caches()
    logits, _ = prefill(model, caches, PROMPT, 0)
    stats = SpeculationStats()
    steps = speculative_decode(
        model, caches, logits, Sampler(params or SamplingParams()), max_tokens=n, stop_ids=(),
        history=list(PROMPT), drafter=drafter, policy=DraftLength(k, adaptive=False), stats=stats,
    )  # fmt: skip
    return caches, steps, stats


def test_mtp_drafting_equals_plain_decoding_and_a_fresh_prefill(mtp, truth):
    model = mtp.model
    caches, steps, stats = _speculate(model, MTPDrafter(), 3)
    out = list(steps)
    assert out == truth[:N]
    assert stats.drafted > 0 and stats.verifies > 0
    _assert_holds(model, caches, PROMPT + out[:-1], out[-1])


@pytest.mark.parametrize(("k", "rate"), [(1, 0.5), (4, 0.0), (4, 0.4), (3, 1.0)])
def test_after_any_rejection_the_mtp_cache_equals_a_fresh_prefill(mtp, truth, k, rate):
    """Every acceptance length happens (injected drafts); the head's rows and hidden state
    are rolled back with the target's caches."""
    model = mtp.model
    caches, steps, _ = _speculate(model, InjectedDrafter(truth, len(PROMPT), rate), k)
    out = list(steps)
    assert out == truth[:N]
    _assert_holds(model, caches, PROMPT + out[:-1], out[-1])


@pytest.mark.parametrize("stop_at", [2, 5])
def test_a_consumer_that_stops_mid_run_leaves_the_mtp_cache_exact(mtp, truth, stop_at):
    model = mtp.model
    caches, steps, _ = _speculate(model, InjectedDrafter(truth, len(PROMPT), 0.0), 4)
    read = [t for _, t in zip(range(stop_at), steps)]
    steps.close()
    _assert_holds(model, caches, PROMPT + read[:-1], read[-1])


def test_session_scripts_with_the_mtp_drafter_answer_as_a_fresh_prefill(mtp):
    """Plain and trimming turns, regenerate, an interrupted stream: answers equal a fresh
    prefill's, and at the end the sequence's caches (the head's too) equal a fresh prefill
    of its tokens."""
    eng = mtp
    eng.speculative = Speculation(MTPDrafter, 3, adaptive=False)
    s = eng.session("You are terse.", max_exchanges=2)
    turns = [s.send(q, max_tokens=8) for q in QUESTIONS[:4]]  # turns 3, 4 trim
    assert turns[-1].stats.dropped_exchanges == 1
    turns.append(s.regenerate(max_tokens=8))
    history = [list(e) for e in s.history]
    stream = s.stream(QUESTIONS[4], max_tokens=8)
    next(stream)
    stream.close()
    assert s.history == history
    turns.append(s.send(QUESTIONS[5], max_tokens=8))
    for turn in turns:
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 8)[0]
        assert turn.stats.drafted_tokens > 0
    with eng.lock:  # ~200 tokens of chunked, decoded and verified rounding: states to 1e-3
        _assert_holds(eng.model, s.seq.caches, s.seq.tokens, 198, atol=1e-3)


def test_the_mtp_cache_survives_a_state_file_and_a_pool_fork(mtp):
    from engine.runtime.pool import fork
    from engine.runtime.sequence import CachedSequence
    from engine.storage.state_file import capture_state, decode_state, state_key

    eng = mtp
    eng.speculative = Speculation(MTPDrafter, 3, adaptive=False)
    s = eng.session("You are terse.")
    s.send(QUESTIONS[0], max_tokens=6)
    seq = s.seq
    with eng.lock:
        data = capture_state(seq, eng).encode()
        tokens, caches, snaps = decode_state(data, eng, state_key(seq.tokens))
        assert tokens == seq.tokens and isinstance(caches[-1], MTPCache) and snaps
        for a, b in zip(_arrays(caches), _arrays(seq.caches)):
            np.testing.assert_array_equal(a, b)
        pos = max(p for p in seq.snapshots if p < len(seq.tokens))
        dst = CachedSequence(eng)
        fork(seq, pos, dst)
        _assert_holds(eng.model, dst.caches, seq.tokens[:pos], seq.tokens[pos], atol=1e-3)


def test_the_pool_serves_mtp_requests_as_a_fresh_prefill_does(mtp):
    """Stateless requests: a new conversation, its continuation (the same sequence) and a
    branch off its system prompt (a forked copy, the head's rows included)."""
    eng = mtp
    eng.speculative = Speculation(MTPDrafter, 3, adaptive=False)
    base = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": QUESTIONS[0]}]  # fmt: skip
    t1 = eng.chat(base, max_tokens=6, warm=False)
    more = [{"role": "assistant", "content": t1.text}, {"role": "user", "content": QUESTIONS[1]}]
    t2 = eng.chat(base + more, max_tokens=6, warm=False)
    t3 = eng.chat([base[0], {"role": "user", "content": QUESTIONS[2]}], max_tokens=6, warm=False)
    for t in (t1, t2, t3):
        assert t.token_ids == fresh_greedy(eng, t.prompt_ids, 6)[0]
        assert t.stats.drafted_tokens > 0
    assert t2.stats.reused_tokens > 0 and t3.stats.reused_tokens > 0
