"""The bfloat16 path (the dtype GPUs run), on this CPU, against mlx-lm in bfloat16.

Both load the same bfloat16 checkpoint. Tolerances, on logits of magnitude ~1 where one
bfloat16 step is 2**-7 = 0.0078 (tiny's random weights amplify every flipped rounding):
- SEQ_TOL: the sequential path rounds where mlx-lm rounds (the conv summed in float32,
  softplus in bfloat16, the decay kept in float32, y rounded once): measured identical (0).
  Before it did, the same comparison was off by 0.46 (and 0.02 mean error more than mlx-lm's
  against a float32 reference).
- CHUNKED_*: the chunked kernel sums in another order, so now and then y lands on the other
  side of a bfloat16 rounding: against mlx-lm measured max 0.021, mean 1.2e-3 (bound 0.05,
  2e-3); split or cached vs whole prefills measured max 0.115, mean 2.2e-3 (bound 0.25,
  5e-3). The float32 rule (1e-4) is unchanged.
Greedy tokens: tiny's random logits have near-ties (top-2 gaps of 0 to 0.06), where either
pick is right at this precision; so wherever mlx-lm's own top-2 margin exceeds GREEDY_MARGIN
the engine must pick mlx-lm's token, and such positions must exist.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import engine
from engine.checkpoints import registry
from engine.checkpoints.builder import build

SEQ_TOL = 1e-2
CHUNKED_MAX, CHUNKED_MEAN = 0.05, 2e-3  # against mlx-lm
SPLIT_MAX, SPLIT_MEAN = 0.25, 5e-3  # split or cached vs whole prefill
GREEDY_MARGIN = 0.05  # over twice the largest logit difference measured against mlx-lm
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHello, 你好! Tell me about the weather in 北京 today.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny saved in bfloat16, as Hub checkpoints are."""
    return build(registry.get("tiny"), tmp_path_factory.mktemp("bf16") / "tiny", dtype="bfloat16")


@pytest.fixture(scope="module")
def mlx_lm_model(checkpoint):
    from mlx_lm import load

    return load(str(checkpoint))


def logits(model, ids, *, ours=True):
    if ours:
        return model(mx.array([ids]), model.make_caches())[0].astype(mx.float32)
    return model(mx.array([ids]), cache=model.make_cache())[0].astype(mx.float32)


def mlx_lm_greedy(model, tok, ids, n):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    out = stream_generate(model, tok, prompt=ids, max_tokens=n, sampler=make_sampler(temp=0.0))
    return [r.token for r in out]


@pytest.mark.parametrize("chunked", [False, True])
def test_teacher_forced_logits_and_greedy_picks_match_mlx_lm(checkpoint, mlx_lm_model, chunked):
    eng = engine.load(str(checkpoint), dtype="bfloat16", chunked_delta=chunked)
    assert eng.dtype == mx.bfloat16
    assert eng.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == mx.bfloat16
    ref, tok = mlx_lm_model
    prompt = eng.tokenizer.encode(PROMPT * 3)
    answer = mlx_lm_greedy(ref, tok, prompt, 12)
    ids = prompt + answer  # the same ids fed to both: teacher forcing
    got, expected = logits(eng.model, ids), logits(ref, ids, ours=False)
    diff = mx.abs(got - expected)
    if chunked:
        assert diff.max().item() <= CHUNKED_MAX and diff.mean().item() <= CHUNKED_MEAN
    else:
        assert diff.max().item() <= SEQ_TOL
    # greedy picks along mlx-lm's answer, wherever mlx-lm's pick is not a near-tie
    top2 = mx.topk(expected, 2, axis=-1)  # the two largest, in no particular order
    clear = mx.abs(top2[:, 1] - top2[:, 0]) > GREEDY_MARGIN  # 29 of the 114 positions here
    picks_ours, picks_ref = mx.argmax(got, -1), mx.argmax(expected, -1)
    assert mx.all(mx.where(clear, picks_ours == picks_ref, True)).item()
    assert clear.sum().item() >= 10


def test_split_prefills_match_a_whole_prefill_within_the_half_precision_tolerance(checkpoint):
    eng = engine.load(str(checkpoint), dtype="bfloat16")  # the default: chunked for prefill
    ids = eng.tokenizer.encode(PROMPT * 4)
    whole = logits(eng.model, ids)
    for cuts in ([1], [37, 60], list(range(1, len(ids)))):
        caches, parts, bounds = eng.model.make_caches(), [], [0, *cuts, len(ids)]
        for a, b in zip(bounds, bounds[1:]):
            parts.append(eng.model(mx.array([ids[a:b]]), caches)[0].astype(mx.float32))
        diff = mx.abs(mx.concatenate(parts) - whole)
        assert diff.max().item() <= SPLIT_MAX and diff.mean().item() <= SPLIT_MEAN


def test_a_cached_session_turn_matches_a_fresh_prefill_in_bfloat16(checkpoint):
    eng = engine.load(str(checkpoint), dtype="bfloat16")
    chat = eng.session("You are a helpful assistant.")
    chat.send("Hello! My order number is 48213.", max_tokens=4)
    turn = chat.send("What is my order number?", max_tokens=4)
    assert turn.stats.reused_tokens > 0  # the second turn restored from the cache
    # feed the last answer token on the session's caches (snapshot restore, split prefill,
    # decode) and on a fresh full prefill of the same ids: teacher-forced logits agree
    held, last = list(chat.seq.tokens), turn.token_ids[-1]
    assert held == turn.prompt_ids + turn.token_ids[:-1]
    cached = eng.model(mx.array([[last]]), chat.seq.caches)[0, -1].astype(mx.float32)
    fresh = logits(eng.model, held + [last])[-1]
    diff = mx.abs(cached - fresh)
    assert diff.max().item() <= SPLIT_MAX and diff.mean().item() <= SPLIT_MEAN


def test_moe_in_half_precision_on_the_cpu_is_refused_clearly(tiny_moe):
    # MLX's CPU gather_mm (the routed experts) is float32 only: mlx-lm fails mid-forward
    # with "[GatherMM::eval] Currently only supports float32"; the engine says so at load.
    from engine.engine import backend

    if backend() != "cpu":
        pytest.skip("only the CPU backend lacks half-precision gather_mm")
    with pytest.raises(ValueError, match="float32"):
        engine.load(str(tiny_moe.path), dtype="bfloat16")


def test_chatml_dtype_sets_the_default_dtype_and_an_explicit_one_wins(checkpoint, monkeypatch):
    """CHATML_DTYPE stands in for the registry's per-device default (the suite sets float32, so
    a GPU runs the float32 exactness tests); `dtype=` overrides it; a bad value is named."""

    def dtype_of(eng):
        return eng.model.norm.weight.dtype

    monkeypatch.setenv("CHATML_DTYPE", "bfloat16")
    assert dtype_of(engine.load(str(checkpoint))) == mx.bfloat16
    assert dtype_of(engine.load(str(checkpoint), dtype="float32")) == mx.float32
    monkeypatch.setenv("CHATML_DTYPE", "fp8")
    with pytest.raises(ValueError, match="CHATML_DTYPE must be one of float32, bfloat16"):
        engine.load(str(checkpoint))
    with pytest.raises(ValueError, match="^dtype must be one of"):
        engine.load(str(checkpoint), dtype="fp8")
