"""Find, check and load a Qwen3.5 checkpoint: a registry alias, a local folder or a Hub id."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..paths import chatml_home
from . import registry
from .generation import read_generation_config
from .registry import Architecture, ModelEntry
from .tokenizer import Tokenizer

SUPPORTED_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
BUILD_VERSION = 3  # bump when the builder's output changes: rebuilds cached embedded models
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used; the message names the file and the problem."""


@dataclass
class Checkpoint:
    path: Path
    entry: ModelEntry
    fingerprint: str  # identifies the weights: config, tensor headers and file sizes
    quantization: dict | None
    generation: dict = field(default_factory=dict)  # generation_config.json ({} if none)
    mtp_tensors: int = 0  # how many `mtp.*` tensors the files hold (the MTP head; 0: none)


def embedded_path(entry: ModelEntry) -> Path:
    name = f"{entry.name}-seed{entry.seed}-v{BUILD_VERSION}"
    if entry.trained:  # new trained weights build a new folder
        from .trained import read

        name += f"-{read(entry.trained).digest[:12]}"
    return chatml_home() / "models" / name


def _build_once(entry: ModelEntry, path: Path) -> None:
    """Build an embedded model at `path` unless another process has: processes starting at
    once on a fresh CHATML_HOME (chat beside serve, a pipeline's ranks) take turns on a lock,
    so none deletes the `.building` folder another is writing."""
    import fcntl

    from .builder import build

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        if not (path / "config.json").exists():  # the one before us may have built it
            build(entry, path)


def resolve(model: str | os.PathLike) -> tuple[Path, ModelEntry | None]:
    """Map an alias, a folder or a Hub id to a local folder (building embedded models).
    A path object (`os.PathLike`) is always a folder: `Path("tiny")` is not the alias."""
    if isinstance(model, os.PathLike):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint folder")
        return path, None
    name = str(model)
    entries = registry.registry()
    if name in entries:
        entry = entries[name]
        if entry.embedded:
            path = embedded_path(entry)
            if not (path / "config.json").exists():
                _build_once(entry, path)
            return path, entry
        name = entry.hub
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or os.sep in name and name.count("/") != 1:
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint folder")
        return path, None
    if name.count("/") == 1:  # a Hub id: the ordinary Hub client, its cache, its network
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name)), entries.get(str(model))
        except Exception as e:  # offline, unknown repo, no access...
            raise CheckpointError(
                f"{name}: could not get it from the Hugging Face Hub ({e})"
            ) from e
    known = ", ".join(entries)
    raise CheckpointError(f"{name!r} is neither a registry alias ({known}), a folder nor a Hub id")


def _arch_from_config(text: dict, where: str) -> Architecture:
    """The Architecture config.json describes; a missing, mistyped or out-of-range field is a
    CheckpointError naming it (never a TypeError or ZeroDivisionError from deep inside)."""
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: text_config must be a JSON object")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope_parameters must be a JSON object")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim")  # fmt: skip
    if missing := [k for k in required if k not in text]:
        raise CheckpointError(f"{where}: missing field {missing[0]!r}")
    moe = bool(text.get("num_experts"))
    raw = {k: text[k] for k in required} | {
        "intermediate_size": 0 if moe else text.get("intermediate_size", 0),
        "linear_conv_kernel_dim": text.get("linear_conv_kernel_dim", 4),
        "full_attention_interval": text.get("full_attention_interval", 4),
        "max_position_embeddings": text.get("max_position_embeddings", 262144),
        "rope_theta": rope.get("rope_theta", text.get("rope_theta", 1e7)),
        "partial_rotary_factor": rope.get(
            "partial_rotary_factor", text.get("partial_rotary_factor", 0.25)
        ),
        "mrope_section": rope.get("mrope_section", [11, 11, 10]),
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "num_experts": text.get("num_experts", 0),
        "num_experts_per_tok": text.get("num_experts_per_tok", 0),
        "moe_intermediate_size": text.get("moe_intermediate_size", 0),
        "shared_expert_intermediate_size": text.get("shared_expert_intermediate_size", 0),
        "mtp_num_hidden_layers": text.get("mtp_num_hidden_layers", 0),
    }
    size, heads = raw["hidden_size"], raw["num_attention_heads"]
    derived = size // heads if type(size) is type(heads) is int and heads > 0 else 0
    try:  # a bad hidden_size or num_attention_heads is named before the head_dim it gives
        return registry.typed_arch(where, {**raw, "head_dim": text.get("head_dim") or derived})
    except registry.RegistryError as e:
        raise CheckpointError(str(e)) from None


def _json_object(file: Path) -> dict:
    """A JSON file that must hold an object (a CheckpointError naming it otherwise)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return value


def _template_variant(path: Path) -> str | None:
    """Which official template the folder ships (compared byte for byte), if any. A template
    that is none of them is warned about: prompts are rendered with an official one."""
    shipped = []
    if (jinja := path / "chat_template.jinja").exists():
        shipped.append((jinja, jinja.read_bytes()))
    if (cfg := path / "tokenizer_config.json").exists():
        text = _json_object(cfg).get("chat_template")
        if isinstance(text, str):
            shipped.append((cfg, text.encode("utf-8", errors="replace")))
    for _, text in shipped:
        for variant in registry.TEMPLATE_VARIANTS:
            if (TEMPLATE_DIR / f"{variant}.jinja").read_bytes() == text:
                return variant
    if shipped:
        warnings.warn(
            f"{shipped[0][0]}: the chat template is none of Qwen3.5's official ones "
            f"({', '.join(registry.TEMPLATE_VARIANTS)}); prompts are rendered with an official "
            "one, not with this template",
            stacklevel=2,
        )
    return None


INDEX = "model.safetensors.index.json"


def _weight_files(path: Path) -> list[Path]:
    """The folder's safetensors files; each shard its index names must be there."""
    files = sorted(f for f in path.glob("*.safetensors") if not f.is_dir())
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    if (index := path / INDEX).exists():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
        if missing := sorted(str(s) for s in shards if not (path / str(s)).is_file()):
            raise CheckpointError(
                f"{index}: shard {missing[0]} is missing ({len(missing)} of {len(shards)} "
                "shards missing: an interrupted download?)"
            )
    return files


def _safetensors_header(file: Path) -> bytes:
    """The JSON header of a safetensors file, checked for the damage we can see cheaply."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise CheckpointError(f"{file}: corrupt safetensors header (length {n})")
            raw = f.read(n)
    except OSError as e:  # a dangling symlink, no permission...
        raise CheckpointError(f"{file}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
        end = max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file}: corrupt safetensors header (not JSON)") from None
    except (AttributeError, KeyError, IndexError, TypeError):
        raise CheckpointError(f"{file}: corrupt safetensors header (no tensor table)") from None
    if 8 + n + end != size:
        raise CheckpointError(
            f"{file}: safetensors file is {size} bytes, its header describes {8 + n + end}"
        )
    return raw


def inspect(path: Path, entry: ModelEntry | None = None) -> Checkpoint:
    """Read and check config.json and the weight files' headers; no weights are loaded."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint folder)")
    config = _json_object(cfg_file)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{cfg_file}: model_type {model_type!r} is not a Qwen3.5 model "
            f"(expected one of {', '.join(SUPPORTED_TYPES)})"
        )
    text = config.get("text_config") or config
    arch = _arch_from_config(text, str(cfg_file))
    digest = hashlib.sha256(cfg_file.read_bytes())
    mtp = 0
    where: dict[str, str] = {}  # tensor name -> the file holding it
    for f in _weight_files(path):
        header = _safetensors_header(f)
        digest.update(f.name.encode() + header + str(f.stat().st_size).encode())
        names = [k for k in json.loads(header) if k != "__metadata__"]
        for k in names:  # loading would silently keep one of the two
            if (other := where.setdefault(k, f.name)) != f.name:
                raise CheckpointError(
                    f"{path}: tensor {k} is in both {other} and {f.name} (a leftover file?)"
                )
        mtp += sum(k.startswith(_MTP_PREFIXES) for k in names)
    if not (path / "tokenizer.json").exists():
        raise CheckpointError(f"{path}: no tokenizer.json")
    variant = _template_variant(path)
    if entry is None:
        big = arch.hidden_size >= 2560
        entry = ModelEntry(
            name=path.name,
            description=f"checkpoint at {path}",
            hub=None,
            mlx=(),
            template=variant or ("qwen3.5" if big else "qwen3.5-small"),
            thinking_default=variant != "qwen3.5-small" if variant else big,
            context_window=arch.max_position_embeddings,
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
            dtype=str(text.get("dtype") or text.get("torch_dtype") or "bfloat16"),
            compute_dtype={"cpu": "float32", "gpu": "bfloat16"},
            arch=arch,
        )
    else:
        entry = replace(entry, arch=arch, template=variant or entry.template)
    quant = config.get("quantization") or config.get("quantization_config")
    if quant is not None:
        _check_quantization(quant, cfg_file)
    return Checkpoint(path, entry, digest.hexdigest()[:16], quant, read_generation_config(path),
                      mtp)  # fmt: skip


_MTP_PREFIXES = ("mtp.", "model.mtp.")


def _check_quantization(q, cfg_file: Path) -> None:
    """config.json's quantization must be MLX's (mlx-lm's `quantization`: group_size, bits,
    mode, per-module overrides); other formats (FP8, GPTQ, AWQ...) are refused by name."""
    if not isinstance(q, dict):
        raise CheckpointError(f"{cfg_file}: quantization must be a JSON object")
    if "quant_method" in q:
        raise CheckpointError(
            f"{cfg_file}: quantization_config is {q['quant_method']!r}, not MLX's quantized "
            "format: load the unquantized checkpoint (quantize= quantizes it at load) or an "
            "MLX conversion"
        )
    for where, setting in [("quantization", q)] + [
        (f"quantization[{k!r}]", v) for k, v in q.items() if isinstance(v, dict)
    ]:
        for key in ("group_size", "bits"):
            value = setting.get(key)
            if (value is not None or setting is q) and (type(value) is not int or value <= 0):
                raise CheckpointError(
                    f"{cfg_file}: {where} {key} must be a positive integer, got {value!r}"
                )
        if not isinstance(setting.get("mode", ""), str):
            raise CheckpointError(f"{cfg_file}: {where} mode must be a string")


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1}


def weights_nbytes(ckpt: Checkpoint, itemsize: int, *, dequantize_quantized: bool,
                   mtp: bool = False, select=None) -> int:  # fmt: skip
    """Bytes the loaded weights will take (from the files' headers; nothing is loaded):
    floating tensors at `itemsize`, quantized ones as stored or, dequantized, at `itemsize`.
    The MTP head (`mtp.*`) counts only with `mtp` (it is loaded only for speculation);
    `select(name)` (in the model's naming) limits it to the tensors a pipeline rank loads."""
    from ..runtime.model import local_path

    bits = (ckpt.quantization or {}).get("bits", 4)
    total = 0
    for f in _weight_files(ckpt.path):
        for name, t in json.loads(_safetensors_header(f)).items():
            if name == "__metadata__" or (not mtp and name.startswith(_MTP_PREFIXES)):
                continue
            if select is not None and ((key := local_path(name)) is None or not select(key)):
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            if t["dtype"] == "U32" and ckpt.quantization:  # packed quantized weights
                # n words hold n * 32 / bits values (3, 5, 6 bits straddle words: not 32 // bits)
                total += n * 32 // bits * itemsize if dequantize_quantized else n * 4
            elif ckpt.quantization and name.endswith((".scales", ".biases")):
                total += 0 if dequantize_quantized else n * _ITEMSIZE.get(t["dtype"], 4)
            elif t["dtype"] in ("F64", "F32", "F16", "BF16") and not name.endswith("A_log"):
                total += n * itemsize
            else:
                total += n * _ITEMSIZE.get(t["dtype"], 4)
    return total


def load_weights(
    ckpt: Checkpoint, model, dtype, *, dequantize_quantized: bool, select=None
) -> None:
    """Load, sanitize and cast the weights into `model`.

    `select(name)` keeps only some tensors (a pipeline rank's layers): `mx.load` is lazy, so
    the others are never read from the files.

    Quantized checkpoints (mlx-lm's format) are dequantized when `dequantize_quantized`: on a
    CPU only float32 matmuls reach the fast BLAS, so 4-bit weights would be far slower there.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from ..runtime.model import local_path, sanitize

    mtp = getattr(model, "mtp", None) is not None  # the MTP head is kept only when it is built
    weights = {}
    for f in _weight_files(ckpt.path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    try:
        weights = sanitize(weights, ckpt.entry.arch, mtp=mtp)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.path}: {e}") from None
    if select is not None:
        weights = {k: v for k, v in weights.items() if select(k)}
    if ckpt.quantization:
        q = ckpt.quantization
        per_path = _per_path_quantization(q, lambda key: local_path(key, mtp=mtp))

        def quantized(path: str, module) -> bool | dict:
            # mlx-lm records per-module settings (e.g. the MoE router at 8 bits) beside the
            # defaults; a module without `.scales` in the files stays in floating point.
            setting = per_path.get(path, True)
            return setting if f"{path}.scales" in weights else False

        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=quantized,
        )
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"{ckpt.path}: weights do not match the config ({detail})")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise CheckpointError(
                f"{ckpt.path}: tensor {k} has shape {tuple(v.shape)}, config implies "
                f"{tuple(expected[k].shape)}"
            )
        packed = expected[k].dtype == mx.uint32  # a quantized layer's packed weight
        if packed != (v.dtype == mx.uint32) or not (packed or mx.issubdtype(v.dtype, mx.floating)):
            raise CheckpointError(
                f"{ckpt.path}: tensor {k} is {str(v.dtype).removeprefix('mlx.core.')}, expected "
                + ("packed uint32 (a quantized layer)" if packed else "a floating-point type")
            )
        keep = k.endswith(("A_log", ".scales", ".biases")) or packed
        if not keep:
            weights[k] = v.astype(dtype)
    model.load_weights(list(weights.items()), strict=True)
    if ckpt.quantization and dequantize_quantized:
        dequantize(model, dtype)
    mx.eval(model.parameters())


def _per_path_quantization(q: dict, local_path) -> dict[str, bool | dict]:
    """mlx-lm's per-module entries of a `quantization` config, keyed by our module paths."""
    out = {}
    for key, value in q.items():
        if isinstance(value, (dict, bool)) and (path := local_path(key)) is not None:
            if isinstance(value, dict):
                value = {
                    "group_size": value.get("group_size", q["group_size"]),
                    "bits": value.get("bits", q["bits"]),
                    "mode": value.get("mode", q.get("mode", "affine")),
                }
            out[path] = value
    return out


def dequantize(model, dtype) -> None:
    """Replace quantized layers by float ones: on the CPU only float32 matmuls use BLAS."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    def weight(m) -> mx.array:
        w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode)
        return w.astype(dtype)

    def swap(_path, m):
        if isinstance(m, (nn.QuantizedLinear, QuantizedSwitchLinear)):
            w = weight(m)  # [out, in], or [experts, out, in]
            if isinstance(m, nn.QuantizedLinear):
                lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            else:
                lin = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in m)
            lin.weight = w
            if "bias" in m:
                lin.bias = m.bias
            return lin
        if isinstance(m, nn.QuantizedEmbedding):
            w = weight(m)
            emb = nn.Embedding(w.shape[0], w.shape[1])
            emb.weight = w
            return emb
        return m

    from mlx.utils import tree_map_with_path

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)


def load_tokenizer(path: Path, entry: ModelEntry | None = None) -> Tokenizer:
    """The folder's tokenizer; with `entry`, checked against it: its stop tokens are in the
    vocabulary and no token id is past the model's embedding rows (MLX does not check a
    gather's indices: such an id would read memory past the table, not fail)."""
    if (cfg := path / "tokenizer_config.json").exists():
        _json_object(cfg)  # its special flags are read too: a broken file is named
    try:
        tok = Tokenizer.from_folder(path)
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise CheckpointError(f"{path / 'tokenizer.json'}: cannot be loaded ({e})") from None
    if entry is None:
        return tok
    for token in entry.stop_tokens:
        if tok.backend.token_to_id(token) is None:
            raise CheckpointError(
                f"{path / 'tokenizer.json'}: no stop token {token!r} (not a Qwen3.5 tokenizer?)"
            )
    top = max(tok.backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= entry.arch.vocab_size:
        raise CheckpointError(
            f"{path / 'tokenizer.json'}: token ids reach {top}, the model's vocab_size is "
            f"{entry.arch.vocab_size} (config.json): tokenizer and weights do not belong together"
        )
    return tok
