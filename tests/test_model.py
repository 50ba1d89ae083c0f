"""The MLX model against independent references: mlx-lm, transformers, a full prefill."""

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import mlx_lm_model

PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHello, 你好! Tell me about the weather in 北京 today. 🎉<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def _logits(engine, ids, split=None):
    caches = engine.model.make_caches()
    if split is None:
        return engine.model(mx.array([ids]), caches)[0]
    parts = [engine.model(mx.array([ids[a:b]]), caches)[0] for a, b in split]
    return mx.concatenate(parts, axis=0)


def test_matches_mlx_lm(tiny_sequential):
    ref = mlx_lm_model(tiny_sequential.path)
    ids = tiny_sequential.tokenizer.encode(PROMPT * 3)
    expected = ref(mx.array([ids]), cache=ref.make_cache())[0]
    got = _logits(tiny_sequential, ids)
    assert mx.abs(got - expected).max().item() < 1e-4


def test_chunked_kernel_matches_sequential_path(tiny, tiny_sequential):
    ids = tiny.tokenizer.encode(PROMPT * 6)  # > 64 tokens: several chunks
    diff = mx.abs(_logits(tiny, ids) - _logits(tiny_sequential, ids)).max().item()
    assert diff < 1e-4
    assert mx.array_equal(
        mx.argmax(_logits(tiny, ids), -1), mx.argmax(_logits(tiny_sequential, ids), -1)
    )


@pytest.mark.parametrize("split", [[(0, 1), (1, None)], [(0, 37), (37, 60), (60, None)]])
def test_split_prefill_equals_full_prefill(tiny, split):
    ids = tiny.tokenizer.encode(PROMPT * 2)
    split = [(a, b or len(ids)) for a, b in split]
    full = _logits(tiny, ids)
    parts = _logits(tiny, ids, split)
    assert mx.abs(full - parts).max().item() < 1e-4


def test_token_by_token_decode_equals_full_prefill(tiny):
    ids = tiny.tokenizer.encode(PROMPT)[:40]
    full = _logits(tiny, ids)
    steps = _logits(tiny, ids, [(i, i + 1) for i in range(len(ids))])
    assert mx.abs(full - steps).max().item() < 1e-4


def _transformers_logits(eng, ids):
    torch = pytest.importorskip(
        "torch", reason="transformers parity needs torch: pip install torch==2.13.0"
    )
    from safetensors.numpy import load_file

    cfg = json.loads((eng.path / "config.json").read_text())["text_config"]
    if cfg["model_type"] == "qwen3_5_moe_text":
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as hf

        config = hf.Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        model = hf.Qwen3_5MoeForCausalLM(config).eval()
    else:
        import transformers.models.qwen3_5.modeling_qwen3_5 as hf

        config = hf.Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        model = hf.Qwen3_5ForCausalLM(config).eval()
    weights = load_file(str(eng.path / "model.safetensors"))
    state = {  # transformers has no MTP head: `mtp.*` is ours to test (tests/test_mtp.py)
        k.replace("model.language_model.", "model."): torch.from_numpy(v)
        for k, v in weights.items()
        if not k.startswith("mtp.")
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embeddings
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("path", ["sequential", "chunked"])
def test_matches_transformers(tiny, tiny_sequential, path):
    eng = tiny if path == "chunked" else tiny_sequential
    ids = eng.tokenizer.encode(PROMPT * 3)  # > 64 tokens: the chunked kernel spans chunks
    expected = _transformers_logits(eng, ids)
    got = np.array(_logits(eng, ids))
    assert np.abs(got - expected).max() < 1e-4


def test_moe_matches_mlx_lm_and_transformers(tiny_moe):
    ids = tiny_moe.tokenizer.encode(PROMPT)
    got = _logits(tiny_moe, ids)
    ref = mlx_lm_model(tiny_moe.path)
    assert mx.abs(got - ref(mx.array([ids]), cache=ref.make_cache())[0]).max().item() < 1e-4
    expected = _transformers_logits(tiny_moe, ids)
    assert np.abs(np.array(got) - expected).max() < 1e-4
