"""Checkpoints quantized by mlx-lm's converter from ones built here load and match mlx-lm.

The dense tiny at 4 and 8 bits, and the MoE tiny at 4 bits, which mlx-lm converts with mixed
precision: the router (`mlp.gate`) and `shared_expert_gate` at 8 bits, recorded per module
path in config.json. Loaded the ways an engine does: dense ones kept quantized on the CPU
(through kernels.native: the GEMV kernel for decode, dequantized BLAS for prefill; and with the
native kernels off, MLX's ops: tests/test_native.py), MoE ones dequantized on the CPU, and the GPU path (plain MLX
quantized layers) forced here on the CPU.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import mlx_lm_load, mlx_lm_model, mlx_lm_quantized

import engine
from engine.checkpoints.loader import inspect, load_weights, weights_nbytes
from engine.runtime.model import ModelOptions, Qwen35
from engine.runtime.quantized import CpuQuantizedLinear
from kernels import native

PROMPT = "<|im_start|>user\nHello, 你好! How are you?<|im_end|>\n<|im_start|>assistant\n"
TOL = 1e-4  # float32 activations on both sides; the quantized weights are the same numbers


@pytest.fixture(scope="module", params=["dense-4bit", "dense-8bit", "moe-4bit"])
def quantized(request, tiny, tiny_moe):
    kind, bits = request.param.split("-")
    source = tiny if kind == "dense" else tiny_moe
    return source, mlx_lm_quantized(source.path, int(bits[0]))


def nbytes(model) -> int:
    return sum(v.nbytes for _, v in nn.utils.tree_flatten(model.parameters()))


def leaves(model):
    return dict(nn.utils.tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))


def mlx_lm_logits(path, ids):
    ref = mlx_lm_model(path)
    return ref(mx.array([ids]), cache=ref.make_cache())


def prefill_and_steps(model, ids, steps=3):
    """Logits of a prefill of all but the last `steps` ids, then one-token decode steps."""
    caches = model.make_caches()
    first = model(mx.array([ids[:-steps]]), caches)
    return mx.concatenate([first] + [model(mx.array([[t]]), caches) for t in ids[-steps:]], 1)


def test_on_the_cpu_and_matches_mlx_lm(quantized):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    source, path = quantized
    ours = engine.load(str(path))
    assert native.info().active
    moe = source.entry.arch.is_moe
    qkv = ours.model.layers[0].linear_attn.in_proj_qkv
    if moe:  # dequantized: MLX's CPU gather_mm (the routed experts) is float32 only
        assert not any("Quantized" in type(m).__name__ for m in leaves(ours.model).values())
        assert qkv.weight.dtype == mx.float32
    else:  # kept compact
        assert type(qkv) is CpuQuantizedLinear and qkv.weight.dtype == mx.uint32
    # the size checked against the device before loading is the size loaded (8-bit routers
    # are estimated at the default bits: within 1%)
    estimate = weights_nbytes(ours.checkpoint, 4, dequantize_quantized=moe)
    assert abs(estimate - nbytes(ours.model)) <= 0.01 * nbytes(ours.model)

    ids = source.tokenizer.encode(PROMPT)
    got = ours.model(mx.array([ids]), ours.model.make_caches())
    assert mx.abs(got - mlx_lm_logits(path, ids)).max().item() < TOL
    # quantization moves the logits far more than that: the comparison above is not vacuous
    full = source.model(mx.array([ids]), source.model.make_caches())
    assert mx.abs(got - full).max().item() > 1e-3

    ref, tok = mlx_lm_load(path)
    turn = ours.session(None).send("Hello, 你好! How are you?", max_tokens=6)
    mlx_tokens = [r.token for r in stream_generate(ref, tok, prompt=turn.prompt_ids, max_tokens=6,
                                                   sampler=make_sampler(temp=0.0))
                  if r.finish_reason != "stop"]  # fmt: skip
    assert turn.token_ids == mlx_tokens
    # decode steps (one row: the GEMV kernel) agree with mlx-lm's too
    got = prefill_and_steps(ours.model, ids)
    assert mx.abs(got - mlx_lm_logits(path, ids)).max().item() < TOL


def test_kept_quantized_with_per_module_bits_as_recorded(quantized):
    source, path = quantized
    ckpt = inspect(path)
    net = Qwen35(ckpt.entry.arch, ModelOptions())
    load_weights(ckpt, net, mx.float32, dequantize_quantized=False)  # the GPU path
    estimate = weights_nbytes(ckpt, 4, dequantize_quantized=False)
    assert abs(estimate - nbytes(net)) <= 0.01 * nbytes(net)

    config = json.loads((path / "config.json").read_text())["quantization"]
    mods = leaves(net)
    quantized_mods = {p: m for p, m in mods.items() if hasattr(m, "bits")}
    assert quantized_mods
    per_path = {k.removeprefix("language_model.model."): v for k, v in config.items()
                if isinstance(v, dict)}  # fmt: skip
    for p, m in quantized_mods.items():
        expected = per_path.get(p, config)
        assert (m.bits, m.group_size) == (expected["bits"], expected["group_size"]), p
    if source.entry.arch.is_moe:  # mixed precision: the routers at 8 bits, experts at 4
        assert per_path and {quantized_mods[p].bits for p in per_path} == {8}
        assert quantized_mods["layers.0.mlp.switch_mlp.up_proj"].bits == 4

    ids = source.tokenizer.encode(PROMPT)
    got = net(mx.array([ids]), net.make_caches())
    assert mx.abs(got - mlx_lm_logits(path, ids)).max().item() < TOL


def test_dequantized_size_estimate_at_bits_that_straddle_words(tiny):
    # 6-bit values straddle uint32 words: each holds 5.33 of them, not 32 // 6 = 5 (the
    # estimate checked against the device was 6% short for a dequantized 6-bit checkpoint).
    ckpt = inspect(mlx_lm_quantized(tiny.path, 6))
    net = Qwen35(ckpt.entry.arch, ModelOptions())
    load_weights(ckpt, net, mx.float32, dequantize_quantized=True)
    estimate = weights_nbytes(ckpt, 4, dequantize_quantized=True)
    assert abs(estimate - nbytes(net)) <= 0.01 * nbytes(net)
