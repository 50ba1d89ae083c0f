"""engine.load on aliases, folders, transformers-saved checkpoints and broken folders."""

import json
import shutil

import mlx.core as mx
import pytest

import engine
from engine.checkpoints.loader import CheckpointError


@pytest.fixture
def copy_of_tiny(tiny, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny.path, dst)
    return dst


def test_alias_and_folder_load_the_same_model(tiny):
    again = engine.load(str(tiny.path))
    assert again.fingerprint == tiny.fingerprint
    assert again.entry.template == "qwen3.5-small"  # recognised from chat_template.jinja
    assert tiny.stop_ids == (248046, 248044)
    assert tiny.model.embed_tokens.weight.dtype == mx.float32


def test_missing_folder():
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        engine.load("./does/not/exist")


def test_a_path_object_is_a_folder_never_an_alias_or_hub_id(copy_of_tiny, monkeypatch):
    from pathlib import Path

    from engine.checkpoints.loader import resolve

    monkeypatch.chdir(copy_of_tiny.parent)
    copy_of_tiny.rename(copy_of_tiny.parent / "tiny")  # a folder named like the alias
    path, entry = resolve(Path("tiny"))  # was the embedded model
    assert (path.resolve(), entry) == (copy_of_tiny.parent / "tiny", None)
    assert resolve("tiny")[1].name == "tiny"  # a string still names the alias first
    with pytest.raises(CheckpointError, match="Qwen/Qwen3.5-0.8B: no such checkpoint folder"):
        resolve(Path("Qwen/Qwen3.5-0.8B"))  # not a Hub download


def test_an_embedded_model_is_built_under_a_lock(tmp_path, monkeypatch):
    # Processes starting together on a fresh CHATML_HOME (chat beside serve, a pipeline's
    # ranks) each built the model into the same `.building` folder, deleting each other's.
    import fcntl

    import engine.checkpoints.builder as builder
    from engine.checkpoints import registry
    from engine.checkpoints.loader import embedded_path, resolve

    monkeypatch.setenv("CHATML_HOME", str(tmp_path))
    path = embedded_path(registry.get("tiny"))
    builds = []

    def build(entry, out, **kwargs):  # a stand-in: is another process locked out? then done
        with open(path.with_name(path.name + ".lock"), "a") as other:
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                builds.append("unlocked")
            except BlockingIOError:
                builds.append("locked")
        (out / "config.json").parent.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(builder, "build", build)
    assert resolve("tiny")[0] == resolve("tiny")[0] == path
    assert builds == ["locked"]


def test_unknown_name():
    with pytest.raises(CheckpointError, match="neither a registry alias"):
        engine.load("no-such-model")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cache_bytes": "1GB"}, "cache_bytes must be a number of bytes"),
        ({"cache_bytes": -5}, "cache_bytes must be a number of bytes"),
        ({"cache_bytes": 1.5e9}, "cache_bytes must be a number of bytes"),
        ({"disk_cache_bytes": -1}, "disk_cache_bytes must be a number of bytes"),
        ({"model": ""}, "model must be a registry alias, a checkpoint folder or a Hub id"),
        ({"quantize": 4.0}, "quantize must be 8 or 4"),  # went on to a TypeError in MLX
        ({"quantize": True}, "quantize must be 8 or 4"),
        ({"quantize": 3}, "quantize must be 8 or 4"),
        ({"dtype": ""}, "dtype must be one of float32, bfloat16, float16 or None, got ''"),
        ({"dtype": ["float32"]}, "dtype must be one of"),  # was TypeError: unhashable type
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"max_batch": 0}, "max_batch must be an integer >= 1"),  # was checked after the load
        ({"pass_tokens": 2.5}, "pass_tokens must be an integer >= 1"),
    ],
)
def test_bad_load_arguments_are_refused_before_loading(monkeypatch, options, message):
    import engine.engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine.engine, "_load", no_load)
    with pytest.raises(ValueError, match=message):
        engine.load(**{"model": "tiny", **options})


def test_truncated_safetensors(copy_of_tiny):
    f = copy_of_tiny / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100_000])
    with pytest.raises(CheckpointError, match="model.safetensors: safetensors file is"):
        engine.load(str(copy_of_tiny))


def test_garbage_safetensors(copy_of_tiny):
    (copy_of_tiny / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"
    )
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        engine.load(str(copy_of_tiny))


@pytest.fixture
def sharded_tiny(tiny, tmp_path):
    """tiny split into two shards with their index, as the Hub stores bigger checkpoints."""
    dst = tmp_path / "sharded"
    shutil.copytree(tiny.path, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = sorted(mx.load(str(tiny.path / "model.safetensors")).items())
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [dict(weights[: len(weights) // 2]), dict(weights[len(weights) // 2 :])]
    for name, half in zip(names, halves):
        mx.save_safetensors(str(dst / name), half, metadata={"format": "pt"})
    index = {"weight_map": {k: n for n, half in zip(names, halves) for k in half}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_sharded_checkpoint_loads(tiny, sharded_tiny):
    ids = tiny.tokenizer.encode("<|im_start|>user\nhi there<|im_end|>\n")
    loaded = engine.load(str(sharded_tiny))
    expected = tiny.model(mx.array([ids]), tiny.model.make_caches())
    assert mx.array_equal(loaded.model(mx.array([ids]), loaded.model.make_caches()), expected)


def test_missing_shard_is_named(sharded_tiny):
    (sharded_tiny / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"index.json: shard model-00002-of-00002.safetensors is missing \(1 of 2",
    ):
        engine.load(str(sharded_tiny))


def test_a_tensor_in_two_files_is_refused(tiny, sharded_tiny):
    # A leftover single-file copy beside the shards: which one wins was the glob's order.
    shutil.copy(tiny.path / "model.safetensors", sharded_tiny)
    with pytest.raises(CheckpointError, match=r"tensor \S+ is in both model-0000[12]-of-00002"
                       r".safetensors and model.safetensors"):  # fmt: skip
        engine.load(str(sharded_tiny))


def test_unreadable_weight_files_are_named(copy_of_tiny):
    (copy_of_tiny / "extra.safetensors").symlink_to(copy_of_tiny / "gone.safetensors")
    with pytest.raises(CheckpointError, match=r"extra.safetensors: cannot read it"):
        engine.load(str(copy_of_tiny))
    (copy_of_tiny / "extra.safetensors").unlink()
    (copy_of_tiny / "extra.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")
    with pytest.raises(CheckpointError, match=r"extra.safetensors: corrupt safetensors header"):
        engine.load(str(copy_of_tiny))


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("tokenizer_config.json", "{oops", "tokenizer_config.json: not valid JSON"),
        ("tokenizer_config.json", "[]", "tokenizer_config.json: not a JSON object"),
        ("tokenizer.json", "{oops", "tokenizer.json: cannot be loaded"),
        ("config.json", b"\xff\xfe{}", "config.json: not valid JSON"),  # a UnicodeDecodeError
    ],
)
def test_broken_json_files_are_named(copy_of_tiny, name, text, message):
    f = copy_of_tiny / name
    f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text)
    with pytest.raises(CheckpointError, match=message):
        engine.load(str(copy_of_tiny))


def test_tokenizer_without_the_stop_token(copy_of_tiny):
    f = copy_of_tiny / "tokenizer.json"
    tok = json.loads(f.read_text(encoding="utf-8"))
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|im_end|>"]
    f.write_text(json.dumps(tok), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"tokenizer.json: no stop token '<\|im_end\|>'"):
        engine.load(str(copy_of_tiny))


def test_tokenizer_with_ids_past_the_embedding_table(tmp_path):
    # The real tokenizer on a model of 1000 rows: <|im_end|> (248046) would be gathered
    # from past the table's end (MLX checks no indices), not refused.
    import dataclasses

    from engine.checkpoints import registry
    from engine.checkpoints.builder import build

    tiny = registry.get("tiny")
    entry = dataclasses.replace(tiny, arch=dataclasses.replace(tiny.arch, vocab_size=1000))
    path = build(entry, tmp_path / "small-vocab")
    with pytest.raises(CheckpointError, match="token ids reach 248076, the model's vocab_size"):
        engine.load(str(path))


def test_a_chat_template_that_is_not_qwens_is_warned_about(copy_of_tiny):
    (copy_of_tiny / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}"
                                                      "{% endfor %}")  # fmt: skip
    with pytest.warns(UserWarning, match="chat_template.jinja: the chat template is none of"):
        eng = engine.load(str(copy_of_tiny))
    assert eng.entry.template == "qwen3.5-small"  # what it renders with, as the warning says


def test_other_architecture(copy_of_tiny):
    cfg = copy_of_tiny / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not a Qwen3.5 model"):
        engine.load(str(copy_of_tiny))


def test_config_that_does_not_match_the_weights(copy_of_tiny):
    cfg = json.loads((copy_of_tiny / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 96
    (copy_of_tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has shape"):
        engine.load(str(copy_of_tiny))


def _set(path: str, value):
    """Sets `path` (keys joined by '.') in a config.json document to `value`."""

    def edit(cfg):
        *keys, last = path.split(".")
        for key in keys:
            cfg = cfg[key]
        cfg[last] = value

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda cfg: [cfg], "config.json: not a JSON object"),
        (_set("text_config", [1]), "config.json: text_config must be a JSON object"),
        (_set("text_config.rope_parameters", "x"), "rope_parameters must be a JSON object"),
        (_set("text_config.hidden_size", "64"), "'hidden_size' must be int, got str"),
        (_set("text_config.num_hidden_layers", 8.0), "'num_hidden_layers' must be int, got float"),
        (_set("text_config.full_attention_interval", 0), "'full_attention_interval' must be pos"),
        (_set("text_config.num_key_value_heads", -2), "'num_key_value_heads' must be positive"),
        (_set("text_config.tie_word_embeddings", "false"), "'tie_word_embeddings' must be bool"),
        (_set("text_config.rms_norm_eps", None), "'rms_norm_eps' must be float, got NoneType"),
        (
            _set("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
            "quantization_config is 'fp8', not MLX's quantized format",
        ),
        (_set("quantization", {"group_size": 64}), "quantization bits must be a positive int"),
        (
            _set("quantization", {"group_size": 64, "bits": 4, "layers.0.mlp": {"bits": "8"}}),
            r"quantization\['layers.0.mlp'\] bits must be a positive integer, got '8'",
        ),
    ],
)
def test_config_with_wrong_types_or_values_names_the_field(copy_of_tiny, edit, message):
    cfg_file = copy_of_tiny / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg = edit(cfg) or cfg
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        engine.load(str(copy_of_tiny))


@pytest.mark.parametrize("dtype", [mx.uint32, mx.int32, mx.bool_])
def test_a_tensor_of_a_non_float_dtype_is_refused(copy_of_tiny, dtype):
    # It was cast to the compute dtype (int32, bool) or kept as is (uint32, taken for a
    # quantized layer's packed weight): a model answering from the wrong numbers.
    f = copy_of_tiny / "model.safetensors"
    weights = mx.load(str(f))
    key = "model.language_model.layers.3.self_attn.q_proj.weight"
    weights[key] = (weights[key] * 100).astype(dtype)
    mx.save_safetensors(str(f), weights, metadata={"format": "pt"})
    name = str(dtype).removeprefix("mlx.core.")
    with pytest.raises(
        CheckpointError, match=rf"layers.3.self_attn.q_proj.weight is {name}, expected a floating"
    ):
        engine.load(str(copy_of_tiny))


def test_transformers_saved_checkpoint_loads(tiny, tmp_path):
    torch = pytest.importorskip("torch", reason="saving with transformers needs torch==2.13.0")
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf

    cfg = json.loads((tiny.path / "config.json").read_text())["text_config"]
    config = hf.Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(0)
    model = hf.Qwen3_5ForCausalLM(config).eval()
    out = tmp_path / "hf"
    model.save_pretrained(out)
    shutil.copy(tiny.path / "tokenizer.json", out)
    loaded = engine.load(str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_text"
    ids = tiny.tokenizer.encode("<|im_start|>user\nhi there<|im_end|>\n")
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = loaded.model(mx.array([ids]), loaded.model.make_caches())[0]
    assert abs(mx.array(expected) - got).max().item() < 1e-4


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    # The Hub path goes through huggingface_hub; offline (as here) it must fail cleanly.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    for name in ("Qwen/Qwen3.5-0.8B", "qwen3.5-0.8b"):  # a Hub id, and the alias naming it
        with pytest.raises(
            CheckpointError, match="Qwen/Qwen3.5-0.8B: could not get it from the Hugging Face Hub"
        ):
            engine.load(name)
