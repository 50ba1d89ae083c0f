"""The model registry: models.yaml read into validated dataclasses.

Every entry names the real architecture numbers, the chat template variant and the stop
tokens. Validation is strict: an unknown key or a missing field is an error that names the
entry and the field, so a typo in models.yaml never silently becomes a default.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

# The repository's models.yaml (a checkout, an editable install); a wheel carries a copy beside
# this file (setup.py's build_py).
REGISTRY_PATH = Path(__file__).resolve().parents[2] / "models.yaml"
if not REGISTRY_PATH.is_file():
    REGISTRY_PATH = Path(__file__).resolve().with_name("models.yaml")
TEMPLATE_VARIANTS = ("qwen3.5-small", "qwen3.5", "qwen3.6")
# The embedded model a bare `engine.load()`, `chatml chat` and `chatml serve` run: trained here
# (train/) to remember what it is told; `tiny` (random weights) is the tests' model.
DEFAULT_MODEL = "tiny-chat"


class RegistryError(ValueError):
    """models.yaml is malformed: names the entry and the field."""


@dataclass(frozen=True)
class Architecture:
    """The text model's shape; the names are those of config.json's `text_config`."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    full_attention_interval: int
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Multi-token prediction layers the checkpoint carries (`mtp.*`; every Qwen3.5 has one).
    mtp_num_hidden_layers: int = 1

    @property
    def layer_types(self) -> list[str]:
        every = self.full_attention_interval
        return [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def linear_conv_dim(self) -> int:
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def recurrent_state_bytes(self, itemsize: int = 4) -> int:
        """Bytes of all Gated DeltaNet caches (conv tail + delta state) for one sequence."""
        conv = (self.linear_conv_kernel_dim - 1) * self.linear_conv_dim
        delta = self.linear_num_value_heads * self.linear_value_head_dim * self.linear_key_head_dim
        n_linear = self.layer_types.count("linear_attention")
        return n_linear * (conv + delta) * itemsize

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        n_full = self.layer_types.count("full_attention")
        return n_full * 2 * self.num_key_value_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    hub: str | None
    mlx: tuple[str, ...]
    template: str
    thinking_default: bool
    context_window: int
    stop_tokens: tuple[str, ...]
    dtype: str
    compute_dtype: dict[str, str]
    arch: Architecture
    seed: int = 0
    # Embedded models only: a file under engine/checkpoints/trained/ holding trained tensors
    # (engine/checkpoints/trained.py); the builder takes them in place of the seeded ones.
    trained: str | None = None

    @property
    def embedded(self) -> bool:
        """True for models built here from seeded weights (no Hub repository)."""
        return self.hub is None


def _check_keys(where: str, given: dict, cls: type, defaults_ok: bool) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise RegistryError(f"{where}: unknown field {unknown[0]!r}")
    for name, f in fields.items():
        has_default = f.default is not dataclasses.MISSING or (
            f.default_factory is not dataclasses.MISSING
        )
        if name not in given and not (has_default and defaults_ok):
            raise RegistryError(f"{where}: missing field {name!r}")


def _typed(where: str, name: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise RegistryError(
            f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _positive(where: str, name: str, value: Any, zero: bool = False) -> int:
    value = _typed(where, name, value, int)
    if value < 0 or value == 0 and not zero:
        raise RegistryError(f"{where}: field {name!r} must be {'>= 0' if zero else 'positive'}")
    return value


def _strings(where: str, name: str, value: Any, empty: bool = True) -> tuple[str, ...]:
    """A list of strings (a bare string would become a tuple of its characters)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RegistryError(f"{where}: field {name!r} must be a list of strings")
    if not value and not empty:
        raise RegistryError(f"{where}: field {name!r} must not be empty")
    return tuple(value)


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _dtype(where: str, name: str, value: Any) -> str:
    if value not in DTYPE_NAMES:  # also refuses non-strings
        raise RegistryError(f"{where}: field {name!r} must be one of {', '.join(DTYPE_NAMES)}")
    return value


def _compute_dtype(where: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not set(value) <= {"cpu", "gpu"}:
        raise RegistryError(f"{where}: field 'compute_dtype' must map cpu and/or gpu to a dtype")
    return {k: _dtype(where, f"compute_dtype.{k}", v) for k, v in value.items()}


_ARCH_TYPES = typing.get_type_hints(Architecture)


# Architecture fields that may be 0 (a dense model's MoE sizes, a MoE's intermediate_size, no
# MTP head); every other number must be positive.
_MAY_BE_ZERO = {"intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "mtp_num_hidden_layers"}  # fmt: skip


def typed_arch(where: str, raw: dict) -> Architecture:
    """An Architecture from `raw` (field name -> value), each value of its field's type and
    in range: a zero, negative or non-integer size is an error naming the field."""
    values = {}
    for name, value in raw.items():
        if name == "mrope_section":
            if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise RegistryError(f"{where}: field 'mrope_section' must be a list of ints")
            values[name] = tuple(value)
            continue
        values[name] = value = _typed(where, name, value, _ARCH_TYPES[name])
        if isinstance(value, bool):
            continue
        if name == "partial_rotary_factor":
            bad, what = not 0 < value <= 1, "in (0, 1]"
        elif name in _MAY_BE_ZERO:
            bad, what = value < 0, ">= 0"
        else:
            bad, what = value <= 0, "positive"
        if bad:
            raise RegistryError(f"{where}: field {name!r} must be {what}, got {value!r}")
    return Architecture(**values)


def _parse_arch(where: str, raw: dict) -> Architecture:
    _check_keys(where, raw, Architecture, defaults_ok=True)
    arch = typed_arch(where, raw)
    if arch.linear_num_value_heads % arch.linear_num_key_heads:
        raise RegistryError(
            f"{where}: linear_num_value_heads must be a multiple of linear_num_key_heads"
        )
    if arch.num_attention_heads % arch.num_key_value_heads:
        raise RegistryError(
            f"{where}: num_attention_heads must be a multiple of num_key_value_heads"
        )
    rotary = int(arch.head_dim * arch.partial_rotary_factor)
    if 2 * sum(arch.mrope_section) != rotary:
        raise RegistryError(
            f"{where}: mrope_section must sum to half the rotary dims ({rotary // 2})"
        )
    if arch.is_moe == (arch.intermediate_size > 0):
        raise RegistryError(f"{where}: set exactly one of intermediate_size and num_experts")
    return arch


def parse_registry(doc: dict, source: str = "models.yaml") -> dict[str, ModelEntry]:
    """Validate a parsed models.yaml document into entries keyed by name."""
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise RegistryError(f"{source}: expected a mapping with a 'models' mapping")
    unknown = sorted(set(doc) - {"defaults", "models"})
    if unknown:
        raise RegistryError(f"{source}: unknown top-level key {unknown[0]!r}")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict) or not isinstance(defaults.get("arch", {}), dict):
        raise RegistryError(f"{source}: 'defaults' and its 'arch' must be mappings")
    entries = {}
    for name, raw in doc["models"].items():
        where = f"{source}: model {name!r}"
        if not isinstance(raw, dict) or not isinstance(raw.get("arch") or {}, dict):
            raise RegistryError(f"{where}: expected a mapping (and its 'arch' one)")
        merged = {
            **defaults,
            **raw,
            "arch": {**defaults.get("arch", {}), **(raw.get("arch") or {})},
        }
        _check_keys(where, {**merged, "name": name}, ModelEntry, defaults_ok=True)
        if merged["template"] not in TEMPLATE_VARIANTS:
            raise RegistryError(
                f"{where}: field 'template' must be one of {', '.join(TEMPLATE_VARIANTS)}"
            )
        entries[name] = ModelEntry(
            name=name,
            description=_typed(where, "description", merged["description"], str),
            hub=merged["hub"]
            if merged["hub"] is None
            else _typed(where, "hub", merged["hub"], str),
            mlx=_strings(where, "mlx", merged["mlx"]),
            template=merged["template"],
            thinking_default=_typed(where, "thinking_default", merged["thinking_default"], bool),
            context_window=_positive(where, "context_window", merged["context_window"]),
            stop_tokens=_strings(where, "stop_tokens", merged["stop_tokens"], empty=False),
            dtype=_dtype(where, "dtype", merged["dtype"]),
            compute_dtype=_compute_dtype(where, merged["compute_dtype"]),
            arch=_parse_arch(f"{where} arch", merged["arch"]),
            seed=_positive(where, "seed", merged.get("seed", 0), zero=True),
            trained=None
            if merged.get("trained") is None
            else _typed(where, "trained", merged["trained"], str),
        )
    return entries


@lru_cache(maxsize=4)
def _load(path: str) -> dict[str, ModelEntry]:
    with open(path, encoding="utf-8") as f:
        return parse_registry(yaml.safe_load(f), source=os.path.basename(path))


def registry(path: str | os.PathLike | None = None) -> dict[str, ModelEntry]:
    """All entries of models.yaml (`CHATML_MODELS` overrides the path)."""
    return _load(str(path or os.environ.get("CHATML_MODELS") or REGISTRY_PATH))


def get(name: str) -> ModelEntry:
    entries = registry()
    if name not in entries:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(entries)}")
    return entries[name]
