"""The trained model -> the compact file the builder reads (engine/checkpoints/trained.py).

Our model's layout back to the Hub's: names under `model.language_model.`, the depthwise conv
as `[C, 1, K]`, the (1 + w) norms as offsets from 1. The inverse of `engine.runtime.model.sanitize`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from engine.checkpoints import trained
from engine.runtime.model import _NORM_SUFFIXES

# Rows the data never uses: small enough that their logits stay near 0 at inference
# (|h| of the final norm is ~10-30 here, so a logit's spread is ~0.01-0.03).
UNTRAINED_STD = 1e-3


def path(entry) -> Path:
    return trained.path_of(entry.trained)


def hub_tensors(model, vocab: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree_flatten(model.parameters()):
        x = np.array(value, dtype=np.float32)
        if key.endswith("conv_weight"):
            key, x = key.replace("conv_weight", "conv1d.weight"), x[:, None, :]
        elif key.endswith(_NORM_SUFFIXES) or key == "norm.weight":
            x = x - 1.0
        out["model.language_model." + key] = x
    out[trained.IDS] = np.asarray(vocab, np.int32)
    return out


def load(path: Path, entry, vocab: np.ndarray, fresh) -> dict:
    """A weights file back in our model's layout, the embedding over `vocab`'s rows (rows the
    file lacks from `fresh`, the new model's own initial rows)."""
    import dataclasses

    import mlx.core as mx

    from engine.runtime.model import sanitize

    t = trained._read(str(path), path.stat().st_mtime_ns)
    old = {int(i): r for r, i in enumerate(t.tensors[trained.IDS])}
    rows = np.array(fresh, dtype=np.float32)
    for r, i in enumerate(vocab.tolist()):
        if i in old:
            rows[r] = t.tensors[trained.EMBED][old[i]]
    arch = dataclasses.replace(entry.arch, vocab_size=len(vocab))
    hub = {k: mx.array(v) for k, v in t.tensors.items() if k not in (trained.IDS, trained.EMBED)}
    hub[trained.EMBED] = mx.array(rows)
    return sanitize(hub, arch)


def save(out: Path, model, entry, vocab: np.ndarray) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    trained.write(out, hub_tensors(model, vocab), UNTRAINED_STD)
