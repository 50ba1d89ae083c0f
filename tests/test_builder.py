"""The checkpoint builder: Hub layout, official names, determinism, dtypes."""

import hashlib
import json

import numpy as np
import pytest
from safetensors import safe_open

from engine.checkpoints import registry
from engine.checkpoints.builder import build, tensor_plan


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_build_is_deterministic_and_seed_dependent(tmp_path):
    tiny = registry.get("tiny")
    a = _digest(build(tiny, tmp_path / "a"))
    b = _digest(build(tiny, tmp_path / "b"))
    c = _digest(build(tiny, tmp_path / "c", seed=1))
    assert a == b
    assert set(a) == {"config.json", "generation_config.json", "model.safetensors",
                      "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}  # fmt: skip
    assert c["model.safetensors"] != a["model.safetensors"] and c["config.json"] == a["config.json"]


def test_progress_in_a_log_is_a_line_every_ten_percent(tmp_path, capsys):
    build(registry.get("tiny"), tmp_path / "a", progress=True)  # stderr is not a terminal here
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines) and 2 <= len(lines) <= 11, lines
    percents = [float(line.split(": ")[1].split("%")[0]) for line in lines]
    assert percents == sorted(percents) and percents[-1] == 100.0, lines


def test_hub_layout_and_official_names(tmp_path):
    entry = registry.get("tiny")
    path = build(entry, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["text_config"]["model_type"] == "qwen3_5_text"
    assert cfg["text_config"]["layer_types"] == entry.arch.layer_types
    with safe_open(str(path / "model.safetensors"), "np") as f:
        names = set(f.keys())
        conv = f.get_tensor("model.language_model.layers.0.linear_attn.conv1d.weight")
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in names
    assert "model.language_model.layers.0.linear_attn.A_log" in names
    assert names == {s.name for s in tensor_plan(entry.arch)}
    assert conv.shape == (entry.arch.linear_conv_dim, 1, 4)  # the Hub's [C, 1, K]
    template = (
        registry.REGISTRY_PATH.parent / "engine/checkpoints/templates/qwen3.5-small.jinja"
    ).read_text()
    assert (path / "chat_template.jinja").read_text() == template


def test_bfloat16_rounds_like_mlx(tmp_path):
    import mlx.core as mx

    entry = registry.get("tiny")
    f32 = mx.load(str(build(entry, tmp_path / "f32", dtype="float32") / "model.safetensors"))
    bf16 = mx.load(str(build(entry, tmp_path / "bf16", dtype="bfloat16") / "model.safetensors"))
    for name in ("model.language_model.embed_tokens.weight", "model.language_model.norm.weight"):
        assert bf16[name].dtype == mx.bfloat16
        assert mx.array_equal(f32[name].astype(mx.bfloat16), bf16[name])


def test_unknown_dtype_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        build(registry.get("tiny"), tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        build(registry.get("tiny"), tmp_path / "x", seed=-1)  # failed in numpy, mid-build
    assert not list(tmp_path.iterdir())  # refused before anything is written


def test_only_an_empty_folder_or_an_earlier_build_is_replaced(tmp_path, monkeypatch):
    from engine.checkpoints.loader import CheckpointError

    entry = registry.get("tiny")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")  # `chatml models build tiny --out mine` erased it
    with pytest.raises(CheckpointError, match="mine: exists and is not a checkpoint built here"):
        build(entry, mine)
    assert (mine / "notes.txt").read_text() == "keep me"
    monkeypatch.chdir(mine)
    with pytest.raises(CheckpointError, match="is not a checkpoint built here"):
        build(entry, ".")  # was a ValueError from Path('.').with_name
    (tmp_path / "empty").mkdir()
    first = build(entry, tmp_path / "empty")
    assert build(entry, first, seed=1) == first  # an earlier build is rebuilt in place


@pytest.mark.parametrize("name", sorted(registry.registry()))
def test_every_entry_has_a_consistent_plan(name):
    arch = registry.get(name).arch
    plan = tensor_plan(arch)
    names = [s.name for s in plan]
    assert len(names) == len(set(names))
    assert ("lm_head.weight" in names) != arch.tie_word_embeddings
    n_attn = sum(".self_attn.o_proj." in n for n in names if not n.startswith("mtp."))
    assert n_attn == arch.layer_types.count("full_attention")
    heads = {n.split(".")[2] for n in names if n.startswith("mtp.layers.")}
    assert heads == {str(i) for i in range(arch.mtp_num_hidden_layers)} == {"0"}
    assert "mtp.fc.weight" in names and "mtp.norm.weight" in names
    assert all(np.prod(s.shape) > 0 for s in plan)


# Qwen's published sampling recommendations (Qwen3.5 model cards), by default mode.
QWEN_THINKING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                 "presence_penalty": 1.5, "repetition_penalty": 1.0}  # fmt: skip
QWEN_INSTRUCT = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                 "presence_penalty": 1.5, "repetition_penalty": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    "name, sampling",
    [("tiny", QWEN_INSTRUCT), ("qwen3.5-0.8b", QWEN_INSTRUCT), ("qwen3.5-9b", QWEN_THINKING),
     ("qwen3.5-35b-a3b", QWEN_THINKING)],
)  # fmt: skip
def test_generation_config_carries_qwens_sampling(name, sampling):
    from engine.checkpoints.generation import qwen_generation_config, sampling_defaults

    config = qwen_generation_config(registry.get(name))
    assert config["do_sample"] is True and config["eos_token_id"] == [248046, 248044]
    assert {k: config[k] for k in sampling} == sampling
    assert sampling_defaults(config) == sampling


def test_the_loader_reads_the_written_generation_config(tmp_path):
    from engine.checkpoints.loader import inspect

    path = build(registry.get("tiny"), tmp_path / "m")
    assert json.loads((path / "generation_config.json").read_text())["presence_penalty"] == 1.5
    assert inspect(path).generation["temperature"] == 0.7
    (path / "generation_config.json").write_text("{broken")
    assert inspect(path).generation == {}  # unreadable: no defaults, not a failed load
    (path / "generation_config.json").unlink()
    assert inspect(path).generation == {}


def test_bad_generation_config_values_are_skipped(caplog):
    from engine.checkpoints.generation import sampling_defaults

    config = {"temperature": "hot", "top_k": 1.5, "top_p": 0.9, "presence_penalty": 9,
              "min_p": None}  # fmt: skip
    assert sampling_defaults(config) == {"top_p": 0.9}
    assert "temperature" in caplog.text and "top_k" in caplog.text
    assert sampling_defaults({"do_sample": False, "temperature": 0.6, "top_k": 20}) == {
        "temperature": 0.0, "top_k": 20,
    }  # fmt: skip
