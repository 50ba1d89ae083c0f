"""A 4-bit checkpoint made by mlx-lm's converter from one built here: loads on the CPU."""

import mlx.core as mx
import mlx.nn as nn
import pytest

import engine


@pytest.fixture(scope="module")
def q4(tiny, tmp_path_factory):
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("q4") / "tiny-4bit"
    convert(str(tiny.path), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64)
    return out


def test_quantized_checkpoint_is_dequantized_on_the_cpu_and_matches_mlx_lm(tiny, q4):
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    ours = engine.load(str(q4))
    assert ours.checkpoint.quantization["bits"] == 4
    leaves = ours.model.leaf_modules()
    flat = [m for _, m in nn.utils.tree_flatten(leaves, is_leaf=nn.Module.is_module)]
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in flat)
    assert ours.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == mx.float32

    ref, tok = load(str(q4))  # mlx-lm's own quantized model
    ids = tiny.tokenizer.encode(
        "<|im_start|>user\nHello, 你好! How are you?<|im_end|>\n<|im_start|>assistant\n"
    )
    got = ours.model(mx.array([ids]), ours.model.make_caches())
    expected = ref(mx.array([ids]), cache=ref.make_cache())
    assert mx.abs(got - expected).max().item() < 1e-4
    # 4 bits move the logits far more than that: the comparison above is not vacuous.
    full = tiny.model(mx.array([ids]), tiny.model.make_caches())
    assert mx.abs(got - full).max().item() > 1e-2

    turn = ours.session(None).send("Hello, 你好! How are you?", max_tokens=6)
    mlx_tokens = [r.token for r in stream_generate(ref, tok, prompt=turn.prompt_ids, max_tokens=6,
                                                   sampler=make_sampler(temp=0.0))
                  if r.finish_reason != "stop"]  # fmt: skip
    assert turn.token_ids == mlx_tokens
