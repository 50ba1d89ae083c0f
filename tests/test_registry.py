import copy

import pytest
import yaml

from engine.checkpoints import registry
from engine.checkpoints.builder import parameter_count
from engine.checkpoints.registry import RegistryError, parse_registry

EXPECTED = {"tiny", "tiny-chat", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b",
            "qwen3.5-35b-a3b"}  # fmt: skip


@pytest.fixture
def doc():
    with open(registry.REGISTRY_PATH) as f:
        return yaml.safe_load(f)


def test_every_model_is_registered_with_its_numbers():
    entries = registry.registry()
    assert set(entries) == EXPECTED
    a = entries["qwen3.5-0.8b"].arch
    assert (a.hidden_size, a.num_hidden_layers, a.intermediate_size) == (1024, 24, 3584)
    assert a.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    # The reference README: 18 MiB of delta state (+ conv tails), 24 KiB of KV per token.
    assert a.kv_bytes_per_token() == 24 * 1024
    delta = 18 * 16 * 128 * 128 * 4
    assert a.recurrent_state_bytes() == delta + 18 * 3 * (2 * 16 * 128 + 16 * 128) * 4
    assert entries["qwen3.5-0.8b"].template == "qwen3.5-small"
    assert entries["qwen3.5-4b"].thinking_default is True
    assert entries["qwen3.5-35b-a3b"].arch.is_moe
    assert all(e.stop_tokens == ("<|im_end|>", "<|endoftext|>") for e in entries.values())


def test_tiny_has_the_real_layer_pattern():
    a = registry.get("tiny").arch
    assert a.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert a.vocab_size == 248320 and registry.get("tiny").template == "qwen3.5-small"
    chat = registry.get("tiny-chat")
    assert chat.arch.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert chat.arch.vocab_size == 248320 and chat.arch.tie_word_embeddings
    assert chat.trained == "tiny-chat.safetensors" and registry.get("tiny").trained is None


@pytest.mark.parametrize(
    "name, billions",
    [("qwen3.5-0.8b", 0.75), ("qwen3.5-2b", 1.9), ("qwen3.5-4b", 4.2), ("qwen3.5-9b", 8.9),
     ("qwen3.5-27b", 26.9), ("qwen3.5-35b-a3b", 34.7)],
)  # fmt: skip
def test_parameter_counts_match_the_model_names(name, billions):
    count = parameter_count(registry.get(name).arch) / 1e9
    assert abs(count - billions) / billions < 0.08, count


def test_unknown_field_names_entry_and_field(doc):
    bad = copy.deepcopy(doc)
    bad["models"]["qwen3.5-2b"]["hidden"] = 5
    with pytest.raises(RegistryError, match=r"'qwen3.5-2b'.*unknown field 'hidden'"):
        parse_registry(bad)
    bad = copy.deepcopy(doc)
    bad["models"]["tiny"]["arch"]["num_heads"] = 2
    with pytest.raises(RegistryError, match=r"'tiny' arch.*unknown field 'num_heads'"):
        parse_registry(bad)


def test_missing_field_names_entry_and_field(doc):
    bad = copy.deepcopy(doc)
    del bad["models"]["qwen3.5-4b"]["template"]
    with pytest.raises(RegistryError, match=r"'qwen3.5-4b'.*missing field 'template'"):
        parse_registry(bad)
    bad = copy.deepcopy(doc)
    del bad["models"]["tiny"]["arch"]["hidden_size"]
    with pytest.raises(RegistryError, match=r"'tiny' arch.*missing field 'hidden_size'"):
        parse_registry(bad)


def test_wrong_types_and_values_are_errors(doc):
    bad = copy.deepcopy(doc)
    bad["models"]["tiny"]["arch"]["hidden_size"] = "64"
    with pytest.raises(RegistryError, match="'hidden_size' must be int"):
        parse_registry(bad)
    bad = copy.deepcopy(doc)
    bad["models"]["tiny"]["template"] = "llama"
    with pytest.raises(RegistryError, match="'template' must be one of"):
        parse_registry(bad)
    bad = copy.deepcopy(doc)
    bad["models"]["tiny"]["arch"]["linear_num_value_heads"] = 5
    with pytest.raises(RegistryError, match="multiple of linear_num_key_heads"):
        parse_registry(bad)
    for field, value, message in [
        ("full_attention_interval", 0, "'full_attention_interval' must be positive, got 0"),
        ("num_hidden_layers", -8, "'num_hidden_layers' must be positive, got -8"),
        ("partial_rotary_factor", 1.5, "'partial_rotary_factor' must be in"),
        ("mtp_num_hidden_layers", -1, "'mtp_num_hidden_layers' must be >= 0"),
    ]:
        bad = copy.deepcopy(doc)
        bad["models"]["tiny"]["arch"][field] = value
        with pytest.raises(RegistryError, match=rf"'tiny' arch.*{message}"):
            parse_registry(bad)


@pytest.mark.parametrize(
    "field, value, message",
    [
        # A bare string was taken as a list of one-character stop tokens: '<' stopped a turn.
        ("stop_tokens", "<|im_end|>", "'stop_tokens' must be a list of strings"),
        ("stop_tokens", [], "'stop_tokens' must not be empty"),
        ("mlx", "mlx-community/x", "'mlx' must be a list of strings"),
        ("compute_dtype", "float32", "'compute_dtype' must map cpu and/or gpu"),
        ("compute_dtype", {"cpu": "float64"}, "'compute_dtype.cpu' must be one of float32"),
        ("dtype", "int8", "'dtype' must be one of float32, bfloat16, float16"),
        ("context_window", 0, "'context_window' must be positive"),
        ("seed", -1, "'seed' must be >= 0"),
        ("arch", [1], "expected a mapping"),
    ],
)
def test_entry_values_are_checked(doc, field, value, message):
    bad = copy.deepcopy(doc)
    bad["models"]["tiny"][field] = value
    with pytest.raises(RegistryError, match=rf"'tiny'.*{message}"):
        parse_registry(bad)


def test_defaults_must_be_a_mapping(doc):
    for defaults in ([1], {"arch": [1]}):  # were TypeErrors from the merge
        bad = {**doc, "defaults": defaults}
        with pytest.raises(RegistryError, match="'defaults' and its 'arch' must be mappings"):
            parse_registry(bad)
