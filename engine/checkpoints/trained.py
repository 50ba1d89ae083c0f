"""Trained tensors shipped in the repository for an embedded model (`trained:` in models.yaml).

One small safetensors file per model, in bfloat16 and in the Hub's names and layout: every
layer tensor whole, and of the tied embedding only the rows the training used
(`embed_tokens.weight` holds those rows, `chatml.embed_ids` their token ids). The builder
regenerates every other embedding row from the entry's seed at `untrained_std` (metadata), a
scale that keeps their logits near 0, far below the trained answers': see train/README.md.
Reading and writing need only numpy, so the file is the same bytes on every machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

DIR = Path(__file__).resolve().parent / "trained"
IDS = "chatml.embed_ids"
EMBED = "model.language_model.embed_tokens.weight"
_CODES = {"BF16": (np.dtype("<u2"), 2), "I32": (np.dtype("<i4"), 4), "F32": (np.dtype("<f4"), 4)}


@dataclass(frozen=True)
class Trained:
    path: Path
    tensors: dict[str, np.ndarray]  # float32, except IDS (int32)
    untrained_std: float
    digest: str  # sha256 of the file: part of the built model's cache path


def path_of(name: str) -> Path:
    return DIR / name


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as the builder writes them."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    return ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype("<u2")


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray], untrained_std: float) -> None:
    """Write `tensors` (float arrays as bfloat16, IDS as int32), names sorted."""
    header, blobs, offset = {"__metadata__": {"untrained_std": repr(float(untrained_std))}}, [], 0
    for name in sorted(tensors):
        x = np.asarray(tensors[name])
        if name == IDS:
            code, raw = "I32", x.astype("<i4").tobytes()
        else:
            code, raw = "BF16", bf16_round(x.astype(np.float32)).tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(x.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


@lru_cache(maxsize=4)
def _read(path: str, mtime_ns: int) -> Trained:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    base, tensors = 8 + n, {}
    for name, t in header.items():
        dtype, size = _CODES[t["dtype"]]
        start, end = t["data_offsets"]
        x = np.frombuffer(raw, dtype, (end - start) // size, base + start).reshape(t["shape"])
        if t["dtype"] == "BF16":
            x = (x.astype("<u4") << 16).view("<f4")
        tensors[name] = x
    if IDS not in tensors or EMBED not in tensors:
        raise ValueError(f"{path}: needs both {EMBED!r} and {IDS!r}")
    return Trained(
        Path(path),
        tensors,
        float(meta.get("untrained_std", "0")),
        hashlib.sha256(raw).hexdigest(),
    )


def read(name: str) -> Trained:
    """The trained tensors `name` (a file in engine/checkpoints/trained/)."""
    path = path_of(name)
    if not path.exists():
        raise FileNotFoundError(f"{path}: trained weights missing (see train/README.md)")
    return _read(str(path), path.stat().st_mtime_ns)
