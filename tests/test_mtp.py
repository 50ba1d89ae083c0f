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
from engine.runtime import snapshot
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
from engine.runtime.step import Row, forward, rollback

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


def _raw(caches) -> list[np.ndarray]:
    """Every array the caches hold, as they hold it (an MTP cache's rows, pending ids and
    hidden states)."""
    out = []
    for c in caches:
        if isinstance(c, MTPCache):
            out += [*(c.rows or ()), *([] if c.ids is None else [c.ids]), c.state]
        elif isinstance(c, KVCache):
            out += list(c.state)
        else:
            out += [c.conv, c.state]
    return [np.array(a) for a in out]


def _caught_up(model, c: MTPCache) -> MTPCache:
    """A copy of `c` with every pending row computed; `c` itself is left as it is."""
    copy = MTPCache()
    copy.load_state(*(c.rows or (None, None)), c.ids, c.state, c.offset)
    model.mtp.catch_up(copy, model.embed_tokens)
    return copy


def _arrays(model, caches) -> list[np.ndarray]:
    """What the caches stand for: an MTP cache's once caught up (rows and hidden state)."""
    return _raw([_caught_up(model, c) if isinstance(c, MTPCache) else c for c in caches])


def _check_pending(cache: MTPCache, tokens) -> None:
    """The MTP cache's layout: rows plus pending hidden states cover every position, and its
    pending ids are the tokens after the last row's position."""
    r = cache.kv.offset
    assert cache.offset == len(tokens) and cache.state.shape[1] == len(tokens) - r >= 1
    assert cache.lag == len(tokens) - r - 1
    pending = [] if cache.ids is None else np.array(cache.ids[0]).tolist()
    assert pending == list(tokens[r + 1 :])


def _assert_states_close(ours: list, theirs: list, atol: float = 1e-4) -> None:
    """Cache arrays equal within `atol` of each array's largest magnitude (at least 1), as
    bench.spec_scripts.cache_error measures: keys of magnitude ~4 differ by ~1e-4 between
    OpenBLAS's one- and two-thread sgemm alone."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, atol=atol * max(1.0, float(np.abs(b).max())))


def _assert_holds(model, caches, tokens, next_token, atol=1e-4):
    """`caches` (the MTP head's included, once caught up) equal a fresh prefill of `tokens`
    (within `atol` of each state's scale), and so do the logits after `next_token`."""
    fresh = model.make_caches()
    prefill(model, fresh, tokens, 0)
    assert isinstance(caches[-1], MTPCache) and {c.offset for c in caches} == {len(tokens)}
    _check_pending(caches[-1], tokens)
    ours, theirs = _arrays(model, caches), _arrays(model, fresh)
    _assert_states_close(ours, theirs, atol)
    ((a, _),) = forward(model, [Row(caches, [next_token])])
    ((b, _),) = forward(model, [Row(fresh, [next_token])])
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def _eager(model) -> list:
    """Caches whose MTP head advances with every pass (what it did before it went lazy)."""
    caches = model.make_caches()
    caches[-1].max_lag = 0
    return caches


def _draft_logits(model, cache: MTPCache, token: int, k: int) -> np.ndarray:
    """The head's logits `[k, V]` at each of k chained greedy draft steps after `token`, as
    `MTPHead.draft` computes them; `cache` catches up and is otherwise left as it was."""
    model.mtp.catch_up(cache, model.embed_tokens)
    kv, start = cache.kv, cache.kv.offset
    hidden, ids, out = cache.state, mx.array([[token]]), []
    for _ in range(k):
        hidden = model.mtp(model.embed_tokens(ids), hidden, kv)
        out.append(model.logits(hidden)[0, -1])
        ids = mx.argmax(out[-1])[None, None]
    logits = mx.stack(out)
    mx.eval(logits)
    kv.restore(start)
    return np.array(logits)


@pytest.fixture
def head_calls(monkeypatch):
    """Counts the head's work: `rows` (batched passes computing pending rows) and `steps`
    (draft steps through the whole head)."""
    from engine.runtime.mtp import MTPHead

    calls = {"rows": 0, "steps": 0}
    rows, step = MTPHead._rows, MTPHead.__call__

    def counted_rows(self, *args):
        calls["rows"] += 1
        return rows(self, *args)

    def counted_step(self, *args):
        calls["steps"] += 1
        return step(self, *args)

    monkeypatch.setattr(MTPHead, "_rows", counted_rows)
    monkeypatch.setattr(MTPHead, "__call__", counted_step)
    return calls


class _Scripted(DraftLength):
    """A policy that drafts k from `script` in turn (0: decode `plain` tokens plainly)."""

    def __init__(self, script, plain=3):
        super().__init__(max(max(script), 1), adaptive=True)
        self.script, self.plain, self.i = list(script), plain, 0

    def next(self) -> int:
        self.i += 1
        return self.script[(self.i - 1) % len(self.script)]

    def plain_tokens(self) -> int:
        return self.plain


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


EXPERT = "mtp.layers.0.mlp.experts."
PROJS = ("gate_proj", "up_proj", "down_proj")


def test_a_moe_head_stored_per_expert_loads_as_its_fused_twin_and_drafts_exactly(
    tiny_moe, tmp_path
):
    """Qwen3.5-35B-A3B stores its decoder layers' routed experts fused and its MTP layer's
    one tensor per expert (`mtp.layers.0.mlp.experts.{e}.gate_proj.weight` ...). The builder
    writes that; the loader stacks them in expert order, the same head written fused loads
    to the same weights, and drafting with it answers as plain decoding does."""
    import shutil

    from mlx.utils import tree_flatten

    n = tiny_moe.model.layers[0].mlp.switch_mlp.gate_proj.weight.shape[0]  # experts
    w = load_file(str(tiny_moe.path / "model.safetensors"))
    assert "model.language_model.layers.3.mlp.experts.gate_up_proj" in w  # decoder: fused
    assert {k for k in w if k.startswith(EXPERT)} == {
        f"{EXPERT}{e}.{p}.weight" for e in range(n) for p in PROJS
    }
    fused = {k: v for k, v in w.items() if not k.startswith(EXPERT)}
    fused[EXPERT + "gate_up_proj"] = np.stack(
        [np.concatenate([w[f"{EXPERT}{e}.gate_proj.weight"], w[f"{EXPERT}{e}.up_proj.weight"]])
         for e in range(n)]
    )  # fmt: skip
    fused[EXPERT + "down_proj"] = np.stack([w[f"{EXPERT}{e}.down_proj.weight"] for e in range(n)])
    twin = tmp_path / "fused"
    shutil.copytree(tiny_moe.path, twin)
    save_file(fused, str(twin / "model.safetensors"), metadata={"format": "pt"})

    eng = engine.load(str(tiny_moe.path), speculative="mtp", num_draft=3)
    switch = eng.model.mtp.layers[0].mlp.switch_mlp
    for p in PROJS:  # expert e is row e of the stack, against the file read by numpy
        want = np.stack([w[f"{EXPERT}{e}.{p}.weight"] for e in range(n)])
        np.testing.assert_array_equal(np.array(getattr(switch, p).weight), want)
    ours = dict(tree_flatten(eng.model.parameters()))
    theirs = dict(tree_flatten(engine.load(str(twin), speculative="mtp").model.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)

    eng.speculative = Speculation(MTPDrafter, 3, adaptive=False)
    s = eng.session("You are terse.", max_exchanges=1)
    turns = [s.send(q, max_tokens=8) for q in QUESTIONS[:3]]  # the third trims
    for turn in turns:
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 8)[0]
        assert turn.stats.drafted_tokens > 0

    del w[f"{EXPERT}{n - 1}.up_proj.weight"]  # one expert short: refused, naming the set
    save_file(w, str(twin / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"fused: mtp.layers.0.mlp.experts.N.up_proj.weight: "
                       rf"need one tensor for each of the {n} experts, found {n - 1}"):  # fmt: skip
        engine.load(str(twin), speculative="mtp")


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
    cache = caches[-1]  # the prefill ran no head: its inputs are pending
    assert cache.offset == len(ids) and cache.kv.offset == 0 and cache.lag == len(ids) - 1
    _check_pending(cache, ids)
    np.testing.assert_allclose(np.array(cache.state[0]), h, atol=1e-5)
    assert model.mtp.draft(model, cache, pending, 2) == [d1, d2]
    assert cache.kv.offset == len(ids) - 1 and cache.lag == 0  # caught up; drafts trimmed
    np.testing.assert_allclose(np.array(cache.state[0, 0]), h[-1], atol=1e-5)
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


# ----- the lazy head: paused while drafting is off, caught up when it resumes ----------------


def test_plain_decoding_never_runs_the_head_and_drafts_after_the_pause_are_exact(
    mtp, truth, head_calls
):
    """Prefill and plain decoding leave the head's inputs pending and never run it; the
    draft that follows catches up in one batched pass and proposes what a head that
    advanced with every pass proposes (logits to 1e-4, same tokens), and the rows then
    equal such a head's after a fresh prefill of the same tokens."""
    model = mtp.model
    lazy, eager = model.make_caches(), _eager(model)
    for caches in (lazy, eager):
        logits, _ = prefill(model, caches, PROMPT, 0)
        out = list(decode(model, caches, logits, Sampler(SamplingParams()), max_tokens=N,
                          stop_ids=(), history=list(PROMPT)))  # fmt: skip
        assert out == truth[:N]
        if caches is lazy:
            assert head_calls == {"rows": 0, "steps": 0}
    assert head_calls["rows"] >= N  # the eager head: once per pass
    tokens = PROMPT + out[:-1]
    assert lazy[-1].kv.offset == 0 and lazy[-1].lag == len(tokens) - 1
    _check_pending(lazy[-1], tokens)
    assert eager[-1].kv.offset == len(tokens) - 1 and eager[-1].lag == 0

    head_calls.update(rows=0, steps=0)
    ours = _draft_logits(model, lazy[-1], out[-1], 3)
    assert head_calls == {"rows": 1, "steps": 3}  # one pass for all it missed, then 3 drafts
    theirs = _draft_logits(model, eager[-1], out[-1], 3)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert lazy[-1].kv.offset == len(tokens) - 1 and lazy[-1].lag == 0
    head_calls.update(rows=0, steps=0)
    drafts = model.mtp.draft(model, lazy[-1], out[-1], 3)
    assert drafts == ours.argmax(-1).tolist() == model.mtp.draft(model, eager[-1], out[-1], 3)
    assert head_calls["rows"] == 0  # nothing was pending any more

    fresh = _eager(model)  # the head over the same tokens, from scratch, advancing each pass
    prefill(model, fresh, tokens, 0)
    _assert_states_close(_raw(lazy), _raw(fresh))


def test_the_lag_is_bounded_and_caught_up_inside_a_pass(mtp, truth, head_calls):
    """With `max_lag` m, a pass that would leave more than m rows pending computes them all
    at once: plain decoding runs the head once every m + 1 tokens, never per token."""
    model = mtp.model
    caches = model.make_caches()
    caches[-1].max_lag = 4
    logits, _ = prefill(model, caches, PROMPT, 0)
    assert head_calls["rows"] == 1 and caches[-1].lag == 0  # the prompt: 25 rows, one pass
    lags = []
    steps = decode(model, caches, logits, Sampler(SamplingParams()), max_tokens=N + 4,
                   stop_ids=(), history=list(PROMPT))  # fmt: skip
    for _ in steps:
        lags.append(caches[-1].lag)
    assert max(lags) <= 4 and head_calls["rows"] == 1 + (N + 3) // 5
    _assert_holds(model, caches, PROMPT + truth[: N + 3], truth[N + 3])


@pytest.mark.parametrize("max_lag", [None, 4], ids=["lazy", "bounded"])
def test_a_session_switching_drafting_off_and_on_answers_as_plain_decoding(
    mtp, head_calls, monkeypatch, max_lag
):
    """A turn with drafting off runs no head at all (its prompt neither); turns that switch
    drafting off and on mid-answer (plain runs, then probes that catch up), trimming,
    regenerate and an interrupted stream all answer as a fresh prefill, and the sequence's
    caches end equal to a fresh prefill of its tokens."""
    from engine.runtime import cache as cache_module

    if max_lag is not None:
        monkeypatch.setattr(cache_module, "MAX_LAG", max_lag)
    eng = mtp
    eng.speculative = Speculation(MTPDrafter, 3, adaptive=False)
    s = eng.session("You are terse.", max_exchanges=2)
    eng.speculative.policy = _Scripted([0], plain=16)
    head_calls.update(rows=0, steps=0)
    turns = [s.send(QUESTIONS[0], max_tokens=8)]
    assert turns[0].stats.drafted_tokens == 0
    if max_lag is None:
        assert head_calls == {"rows": 0, "steps": 0}
        assert s.seq.caches[-1].kv.offset == 0  # the whole conversation is pending
    eng.speculative.policy = _Scripted([0, 2, 0, 0, 3, 1], plain=2)
    turns += [s.send(q, max_tokens=10) for q in QUESTIONS[1:4]]  # turns 3, 4 trim
    assert turns[-1].stats.dropped_exchanges == 1
    turns.append(s.regenerate(max_tokens=10))
    history = [list(e) for e in s.history]
    stream = s.stream(QUESTIONS[4], max_tokens=10)
    next(stream)
    stream.close()
    assert s.history == history
    turns.append(s.send(QUESTIONS[5], max_tokens=10))
    for i, turn in enumerate(turns):
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, 10 if i else 8)[0]
        assert i == 0 or turn.stats.drafted_tokens > 0
    assert head_calls["steps"] > 0
    with eng.lock:
        _assert_holds(eng.model, s.seq.caches, s.seq.tokens, 198, atol=1e-3)


@pytest.mark.parametrize("max_lag", [None, 4], ids=["lazy", "bounded"])
def test_snapshots_and_kept_states_taken_while_the_head_lags_restore_exactly(mtp, truth, max_lag):
    """Snapshots inside a prefill chunk and at its end, and the states a step keeps inside
    itself, taken while rows are pending (or, bounded, just computed inside the pass):
    restored after the head caught up and drafted past them, they equal a fresh prefill."""
    model = mtp.model
    caches = model.make_caches()
    if max_lag is not None:
        caches[-1].max_lag = max_lag
    snaps = {}

    def on_stop(pos, layers):
        snaps[pos] = snapshot.take(caches, pos, layers)

    n = len(PROMPT)
    prefill(model, caches, PROMPT, 0, stops=[3, 10, n], on_stop=on_stop)
    head = caches[-1]
    assert head.lag == (n - 1 if max_lag is None else 0)
    assert snaps[10].layers[-1][1].shape[1] == (10 if max_lag is None else 1)
    assert snaps[10].nbytes >= snaps[10].layers[-1][1].nbytes > 0  # the pending inputs count
    # A step that keeps states inside itself while the head lags: roll back into it.
    ((_, mark),) = forward(model, [Row(caches, truth[:4], logits=0, keep=[1, 2, 3])])
    rollback(caches, mark, n + 2)
    _assert_holds(model, caches, PROMPT + truth[:2], truth[2])  # feeds truth[2]
    # The head catches up and drafts past every snapshot, twice; then restore, deepest first.
    model.mtp.draft(model, head, truth[3], 3)
    forward(model, [Row(caches, truth[3:6], logits=0)])
    model.mtp.draft(model, head, truth[6], 2)
    assert head.kv.offset == n + 5 and head.lag == 0
    _assert_holds(model, caches, PROMPT + truth[:6], truth[6])
    for pos, next_token in ((n, truth[0]), (10, PROMPT[10]), (3, PROMPT[3])):
        snapshot.restore(caches, snaps[pos])
        _assert_holds(model, caches, PROMPT[:pos], next_token)


@pytest.mark.parametrize("max_lag", [None, 1], ids=["lazy", "bounded"])
def test_batched_rows_keep_each_head_exact(mtp, truth, max_lag):
    """`decode_rows` (several sequences in one step) follows each row's head lazily (or,
    bounded, catches a row up inside the batched step): each row ends as it would alone."""
    model = mtp.model
    prompts = [PROMPT, PROMPT[5:]]
    rows, tokens = [], []
    for ids in prompts:
        caches = model.make_caches()
        if max_lag is not None:
            caches[-1].max_lag = max_lag
        logits, _ = prefill(model, caches, ids, 0)
        rows.append(caches)
        tokens.append([mx.argmax(logits).item()])
    for _ in range(5):
        out = forward(model, [Row(c, [t[-1]]) for c, t in zip(rows, tokens)])
        for t, (logits, _) in zip(tokens, out):
            t.append(mx.argmax(logits[-1]).item())
    assert tokens[0] == truth[:6]
    for ids, caches, t in zip(prompts, rows, tokens):
        assert caches[-1].lag <= (max_lag if max_lag is not None else len(ids) + 4)
        _assert_holds(model, caches, ids + t[:-1], t[-1])


def test_state_files_of_version_1_are_read_and_unknown_versions_refused(mtp):
    """Version 1 files predate the lag (their MTP caches never lag): read as they are. A
    file from a later version is refused, not half understood."""
    from safetensors.numpy import save

    from engine.storage.state_file import (
        VERSION,
        StateError,
        _digest,
        capture_state,
        decode_state,
        state_key,
    )

    eng = mtp
    s = eng.session("You are terse.")
    eng.speculative = Speculation(MTPDrafter, 3, adaptive=False)
    s.send(QUESTIONS[0], max_tokens=4)
    with eng.lock:
        eng.model.mtp.catch_up(s.seq.caches[-1], eng.model.embed_tokens)  # as v1 wrote them
        s.seq.snapshots.clear()
        captured = capture_state(s.seq, eng)
        key = state_key(s.seq.tokens)
        for version, ok in (("1", True), (str(VERSION + 1), False)):
            # as version 1 wrote them: the checksum covers the tensors only
            meta = {**captured.meta, "version": version}
            data = save(captured.tensors, {**meta, "sha256": _digest(captured.tensors, None)})
            if ok:
                tokens, caches, _ = decode_state(data, eng, key)
                _assert_holds(eng.model, caches, tokens, 198, atol=1e-3)
            else:
                with pytest.raises(StateError, match="version"):
                    decode_state(data, eng, key)


@pytest.mark.parametrize("script", [[3], [0]], ids=["drafting", "lagging"])
def test_the_mtp_cache_survives_a_state_file_and_a_pool_fork(mtp, script):
    """Saved, read back and forked as it is: caught up after drafting, or lagging a whole
    conversation behind (drafting off: the head never ran), snapshots included."""
    from engine.runtime.pool import fork
    from engine.runtime.sequence import CachedSequence
    from engine.storage.state_file import capture_state, decode_state, state_key

    eng = mtp
    eng.speculative = Speculation(MTPDrafter, 3, adaptive=False)
    eng.speculative.policy = _Scripted(script, plain=6)
    s = eng.session("You are terse.")
    s.send(QUESTIONS[0], max_tokens=6)
    s.send(QUESTIONS[1], max_tokens=6)
    seq = s.seq
    with eng.lock:
        head = seq.caches[-1]
        assert head.lag == len(seq.tokens) - 1 if script == [0] else head.lag < 4
        data = capture_state(seq, eng).encode()
        tokens, caches, snaps = decode_state(data, eng, state_key(seq.tokens))
        assert tokens == seq.tokens and isinstance(caches[-1], MTPCache) and snaps
        for a, b in zip(_raw(caches), _raw(seq.caches), strict=True):
            np.testing.assert_array_equal(a, b)
        _assert_holds(eng.model, caches, tokens, 198, atol=1e-3)
        for p in sorted(snaps, reverse=True)[1:3]:  # deepest first: each rewinds below the last
            snapshot.restore(caches, snaps[p])
            _assert_holds(eng.model, caches, tokens[:p], tokens[p], atol=1e-3)
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
