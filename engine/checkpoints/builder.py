"""Build a Qwen3.5 checkpoint folder in the Hub layout from registry numbers and a seed.

The folder is what a real Qwen3.5 download looks like (config.json with a `text_config`,
safetensors with the official tensor names, tokenizer.json, tokenizer_config.json,
chat_template.jinja), so the loading code we test is the code real weights go through.

Weights are seeded per tensor name, so the bytes are identical on every machine and each
tensor can be generated and written on its own: a 27B model streams to disk without ever
being held in memory whole. An entry with `trained:` (tiny-chat) takes its tensors from that
file instead (engine/checkpoints/trained.py), and only the embedding rows the file does not
hold come from the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .generation import FILE as GENERATION_CONFIG
from .generation import qwen_generation_config
from .registry import Architecture, ModelEntry
from .tokenizer import dump_json, tokenizer_config, tokenizer_json
from .trained import EMBED, IDS, Trained
from .trained import read as read_trained

TEMPLATES = Path(__file__).resolve().parent / "templates"
SHARD_BYTES = 4 << 30  # like the Hub's sharded checkpoints
INIT_RANGE = 0.02
_DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # normal | zero_norm | one_norm | a_log | dt_bias
    std: float = 0.0

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


def tensor_plan(arch: Architecture) -> list[TensorSpec]:
    """Every tensor of the text model and its MTP head, with the official names and shapes."""
    h, p = arch.hidden_size, "model.language_model."
    out_std = (2 * arch.num_hidden_layers) ** -0.5  # residual branches start small
    # Embeddings (and the LM head) use the config's initializer_range, as transformers does.
    specs = [TensorSpec(p + "embed_tokens.weight", (arch.vocab_size, h), "normal", INIT_RANGE)]
    for i, kind in enumerate(arch.layer_types):
        specs += _layer_plan(arch, f"{p}layers.{i}.", kind, out_std)
    specs.append(TensorSpec(p + "norm.weight", (h,), "zero_norm"))
    if not arch.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (arch.vocab_size, h), "normal", INIT_RANGE))
    # The multi-token prediction head, named as Qwen3.5 checkpoints name it: the target's
    # hidden state and the next token's embedding, each normed, through `fc` (embedding
    # first) into full-attention decoder layers, then `mtp.norm` and the shared LM head.
    if arch.mtp_num_hidden_layers:
        specs += [
            _linear("mtp.fc.weight", h, 2 * h),
            TensorSpec("mtp.pre_fc_norm_embedding.weight", (h,), "zero_norm"),
            TensorSpec("mtp.pre_fc_norm_hidden.weight", (h,), "zero_norm"),
        ]
        for i in range(arch.mtp_num_hidden_layers):
            specs += _layer_plan(
                arch, f"mtp.layers.{i}.", "full_attention", out_std, per_expert=True
            )
        specs.append(TensorSpec("mtp.norm.weight", (h,), "zero_norm"))
    return specs


def _linear(name: str, n_out: int, n_in: int, scale: float = 1.0) -> TensorSpec:
    return TensorSpec(name, (n_out, n_in), "normal", scale * n_in**-0.5)


def _layer_plan(arch: Architecture, lp: str, kind: str, out_std: float, per_expert: bool = False
                ) -> list[TensorSpec]:  # fmt: skip
    """One decoder layer's tensors under the prefix `lp`. Routed experts are fused
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) as in Qwen3.5-35B-A3B's
    decoder layers, or with `per_expert` one tensor per expert and projection, as its MTP
    layer stores them (`experts.{e}.gate_proj.weight` ...)."""
    h, linear = arch.hidden_size, _linear
    if kind == "linear_attention":
        a = lp + "linear_attn."
        hv, dv = arch.linear_num_value_heads, arch.linear_value_head_dim
        k = arch.linear_conv_kernel_dim
        specs = [
            linear(a + "in_proj_qkv.weight", arch.linear_conv_dim, h),
            linear(a + "in_proj_z.weight", hv * dv, h),
            linear(a + "in_proj_b.weight", hv, h),
            linear(a + "in_proj_a.weight", hv, h),
            TensorSpec(a + "conv1d.weight", (arch.linear_conv_dim, 1, k), "normal", k**-0.5),
            TensorSpec(a + "dt_bias", (hv,), "dt_bias"),
            TensorSpec(a + "A_log", (hv,), "a_log"),
            TensorSpec(a + "norm.weight", (dv,), "one_norm"),
            linear(a + "out_proj.weight", h, hv * dv, out_std),
        ]
    else:
        a = lp + "self_attn."
        nq, nkv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        specs = [
            linear(a + "q_proj.weight", 2 * nq * d, h),  # query and output gate
            linear(a + "k_proj.weight", nkv * d, h),
            linear(a + "v_proj.weight", nkv * d, h),
            linear(a + "o_proj.weight", h, nq * d, out_std),
            TensorSpec(a + "q_norm.weight", (d,), "zero_norm"),
            TensorSpec(a + "k_norm.weight", (d,), "zero_norm"),
        ]
    m = lp + "mlp."
    if arch.is_moe:
        e, inter, shared = (
            arch.num_experts,
            arch.moe_intermediate_size,
            arch.shared_expert_intermediate_size,
        )
        specs.append(linear(m + "gate.weight", e, h))
        if per_expert:
            for j in range(e):
                x = f"{m}experts.{j}."
                specs += [
                    TensorSpec(x + "gate_proj.weight", (inter, h), "normal", h**-0.5),
                    TensorSpec(x + "up_proj.weight", (inter, h), "normal", h**-0.5),
                    TensorSpec(x + "down_proj.weight", (h, inter), "normal", out_std * inter**-0.5),
                ]
        else:
            specs += [
                TensorSpec(m + "experts.gate_up_proj", (e, 2 * inter, h), "normal", h**-0.5),
                TensorSpec(m + "experts.down_proj", (e, h, inter), "normal", out_std * inter**-0.5),
            ]
        specs += [
            linear(m + "shared_expert.gate_proj.weight", shared, h),
            linear(m + "shared_expert.up_proj.weight", shared, h),
            linear(m + "shared_expert.down_proj.weight", h, shared, out_std),
            linear(m + "shared_expert_gate.weight", 1, h),
        ]
    else:
        inter = arch.intermediate_size
        specs += [
            linear(m + "gate_proj.weight", inter, h),
            linear(m + "up_proj.weight", inter, h),
            linear(m + "down_proj.weight", h, inter, out_std),
        ]
    return specs + [
        TensorSpec(lp + "input_layernorm.weight", (h,), "zero_norm"),
        TensorSpec(lp + "post_attention_layernorm.weight", (h,), "zero_norm"),
    ]


def parameter_count(arch: Architecture) -> int:
    return sum(s.numel for s in tensor_plan(arch))


def _generate(spec: TensorSpec, seed: int) -> np.ndarray:
    """The tensor's values in float32, from a generator seeded by (seed, name)."""
    name_key = int.from_bytes(hashlib.sha256(spec.name.encode()).digest()[:8], "little")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, name_key])))
    if spec.init == "normal":
        x = rng.standard_normal(spec.shape, dtype=np.float32)
        x *= np.float32(spec.std)
        return x
    if spec.init == "zero_norm":  # stored as an offset from 1 (the model computes x * (1 + w))
        return rng.normal(0.0, 0.1, spec.shape).astype(np.float32)
    if spec.init == "one_norm":
        return rng.normal(1.0, 0.1, spec.shape).astype(np.float32)
    if spec.init == "a_log":  # decays exp(-A * softplus(.)) spread from ~0.05 to ~0.95
        return np.log(rng.uniform(0.05, 2.0, spec.shape)).astype(np.float32)
    if spec.init == "dt_bias":
        return rng.normal(1.0, 0.1, spec.shape).astype(np.float32)
    raise ValueError(f"unknown init {spec.init!r}")


def _values(spec: TensorSpec, seed: int, trained: Trained | None) -> np.ndarray:
    """The tensor's float32 values: seeded, or from the trained file (embedding: its rows over
    seeded rows at the file's `untrained_std`; the untrained MTP head seeded)."""
    if trained is None:
        return _generate(spec, seed)
    if spec.name == EMBED:
        rows, ids = trained.tensors[EMBED], trained.tensors[IDS]
        x = _generate(replace(spec, std=trained.untrained_std), seed)
        if rows.shape[1:] != spec.shape[1:] or ids.max(initial=0) >= spec.shape[0]:
            raise ValueError(f"{trained.path}: {EMBED} rows do not fit {spec.shape}")
        x[ids] = rows
        return x
    x = trained.tensors.get(spec.name)
    if x is None and spec.name.startswith("mtp."):  # the MTP head is not trained: seeded
        return _generate(spec, seed)
    if x is None or tuple(x.shape) != spec.shape:
        got = "missing" if x is None else f"shape {tuple(x.shape)}"
        raise ValueError(f"{trained.path}: tensor {spec.name} {got}, the entry needs {spec.shape}")
    return np.array(x, dtype=np.float32)


def _to_dtype_bytes(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "float32":
        return x.astype("<f4", copy=False).tobytes()
    if dtype == "float16":
        return x.astype("<f2").tobytes()
    # bfloat16: round to nearest even on the top 16 bits of the float32 pattern
    u = x.astype("<f4", copy=False).view("<u4")
    u = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    return u.astype("<u2").tobytes()


def _write_shard(
    path: Path, specs: list[TensorSpec], dtype: str, seed: int, meta: dict, on_tensor, trained
):
    """Stream one safetensors file: header first (all sizes are known), then each tensor."""
    code, itemsize = _DTYPES[dtype]
    header, offset = {"__metadata__": meta}, 0
    for s in specs:
        header[s.name] = {
            "dtype": code,
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.numel * itemsize],
        }
        offset += s.numel * itemsize
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for s in specs:
            f.write(_to_dtype_bytes(_values(s, seed, trained), dtype))
            on_tensor(s)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hf_config(entry: ModelEntry, dtype: str) -> dict:
    """config.json as Qwen3.5 ships it: `qwen3_5` (or `qwen3_5_moe`) with a `text_config`."""
    a = entry.arch
    moe = "_moe" if a.is_moe else ""
    text = {
        "model_type": f"qwen3_5{moe}_text",
        "hidden_size": a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab_size,
        "linear_num_key_heads": a.linear_num_key_heads,
        "linear_num_value_heads": a.linear_num_value_heads,
        "linear_key_head_dim": a.linear_key_head_dim,
        "linear_value_head_dim": a.linear_value_head_dim,
        "linear_conv_kernel_dim": a.linear_conv_kernel_dim,
        "full_attention_interval": a.full_attention_interval,
        "layer_types": a.layer_types,
        "max_position_embeddings": a.max_position_embeddings,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": a.rope_theta,
            "partial_rotary_factor": a.partial_rotary_factor,
            "mrope_section": list(a.mrope_section),
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": a.tie_word_embeddings,
        "mtp_num_hidden_layers": a.mtp_num_hidden_layers,
        "mtp_use_dedicated_embeddings": False,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": INIT_RANGE,
        "eos_token_id": 248044,
        "use_cache": True,
        "dtype": dtype,
    }
    if a.is_moe:
        text |= {
            "num_experts": a.num_experts,
            "num_experts_per_tok": a.num_experts_per_tok,
            "moe_intermediate_size": a.moe_intermediate_size,
            "shared_expert_intermediate_size": a.shared_expert_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    else:
        text["intermediate_size"] = a.intermediate_size
    return {
        "architectures": [f"Qwen3_5{'Moe' if a.is_moe else ''}ForConditionalGeneration"],
        "model_type": f"qwen3_5{moe}",
        "text_config": text,
        "tie_word_embeddings": a.tie_word_embeddings,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
    }


def _replaceable(folder: Path) -> bool:
    """An empty folder, or one whose weight files this builder wrote (their metadata say so)."""
    from .loader import CheckpointError, _safetensors_header

    if not folder.is_dir() or folder.is_symlink():
        return False
    if not any(folder.iterdir()):
        return True
    try:
        headers = [json.loads(_safetensors_header(f)) for f in folder.glob("*.safetensors")]
    except CheckpointError:
        return False
    return bool(headers) and all("chatml_model" in h.get("__metadata__", {}) for h in headers)


def build(
    entry: ModelEntry,
    out: str | os.PathLike,
    *,
    seed: int | None = None,
    dtype: str | None = None,
    progress: bool = False,
) -> Path:
    """Write `entry` as a checkpoint folder at `out`; returns the path. An existing `out` is
    replaced only if it is empty or a checkpoint built here (CheckpointError otherwise)."""
    seed = entry.seed if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:  # numpy's seeds
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    dtype = dtype or entry.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    out = Path(out).absolute()  # "." has no name to put ".building" beside
    if out.exists() and not _replaceable(out):
        from .loader import CheckpointError

        raise CheckpointError(
            f"{out}: exists and is not a checkpoint built here; not replacing it (choose a new "
            "or empty folder)"
        )
    work = out.with_name(out.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    specs, itemsize = tensor_plan(entry.arch), _DTYPES[dtype][1]
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.numel * itemsize > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.numel * itemsize

    total, done, start = sum(s.numel for s in specs), 0, time.monotonic()
    # A terminal's line is redrawn at every whole percent; a log gets a line every 10%.
    tty, shown = progress and sys.stderr.isatty(), -1

    def on_tensor(s: TensorSpec) -> None:
        nonlocal done, shown
        done += s.numel
        pct = 100 * done / total
        step = int(pct) if tty else int(pct) // 10 * 10
        if progress and step > shown:
            shown = step
            line = f"building {entry.name}: {pct:5.1f}% ({time.monotonic() - start:.0f} s)"
            sys.stderr.write(f"\r{line}" if tty else f"{line}\n")
            sys.stderr.flush()

    trained = read_trained(entry.trained) if entry.trained else None
    meta = {"format": "pt", "chatml_model": entry.name, "chatml_seed": str(seed)}
    if trained is not None:
        meta["chatml_trained"] = trained.digest
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    for name, shard in zip(names, shards):
        _write_shard(work / name, shard, dtype, seed, meta, on_tensor, trained)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total * itemsize},
            "weight_map": {s.name: n for n, sh in zip(names, shards) for s in sh},
        }
        (work / "model.safetensors.index.json").write_bytes(dump_json(index))
    if tty:
        sys.stderr.write("\n")

    (work / "config.json").write_bytes(dump_json(hf_config(entry, dtype)))
    (work / GENERATION_CONFIG).write_bytes(dump_json(qwen_generation_config(entry)))
    (work / "tokenizer_config.json").write_bytes(dump_json(tokenizer_config(entry.context_window)))
    shutil.copyfile(tokenizer_json(), work / "tokenizer.json")
    shutil.copyfile(TEMPLATES / f"{entry.template}.jinja", work / "chat_template.jinja")

    shutil.rmtree(out, ignore_errors=True)
    os.replace(work, out)
    return out
