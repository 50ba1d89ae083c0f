"""generation_config.json: the sampling defaults a checkpoint's makers recommend.

The CLI and the server start from these (flags and request fields override them); the Python
API stays greedy unless told otherwise. Qwen warns that greedy decoding can loop endlessly
in thinking mode, which is why the command-line faces do not default to it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from ..runtime.sampling import SamplingParams
from .registry import ModelEntry

log = logging.getLogger("chatml.checkpoint")

FILE = "generation_config.json"
# generation_config.json keys that are SamplingParams fields, in the order they are shown.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")  # fmt: skip

# Qwen3.5 / Qwen3.6 ship generation_config.json with do_sample, temperature 1.0, top_k 20,
# top_p 0.95 and the two stop ids (the published file of the thinking-by-default sizes; the
# project's reference folder has no copy). The model cards recommend, per mode: thinking
# (general) temperature 1.0, top_p 0.95, top_k 20, min_p 0, presence_penalty 1.5; instruct
# / non-thinking (general) temperature 0.7, top_p 0.8, top_k 20, min_p 0, presence_penalty
# 1.5; repetition_penalty 1.0 in both. We write the card's values for each entry's default
# mode (the small sizes answer without thinking by default).
_IDS = {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044}
_THINKING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
             "presence_penalty": 1.5, "repetition_penalty": 1.0}  # fmt: skip
_INSTRUCT = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
             "presence_penalty": 1.5, "repetition_penalty": 1.0}  # fmt: skip


def qwen_generation_config(entry: ModelEntry) -> dict:
    """generation_config.json as the builder writes it for a registry entry.

    A model trained here (`trained:`, tiny-chat) was trained to give one exact answer: greedy,
    no penalties (a presence penalty would push a repeated digit of an order number out).
    """
    if entry.trained:
        return {**_IDS, "do_sample": False}
    sampling = _THINKING if entry.thinking_default else _INSTRUCT
    return {**_IDS, "do_sample": True, **sampling}


def read_generation_config(folder: Path) -> dict:
    """The folder's generation_config.json ({} if absent or unreadable, with a warning)."""
    path = Path(folder) / FILE
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s: ignored (%s)", path, e)
        return {}
    if not isinstance(config, dict):
        log.warning("%s: ignored (not a JSON object)", path)
        return {}
    return config


def sampling_defaults(config: Mapping) -> dict:
    """The SamplingParams fields a generation config sets; a bad value is skipped (warned).

    `do_sample: false` means greedy (as in transformers): temperature 0, penalties kept.
    """
    out = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as e:
            log.warning("%s: %s ignored (%s)", FILE, key, e)
            continue
        out[key] = value
    if config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def describe(defaults: Mapping) -> str:
    """`temperature 0.7, top_p 0.8, ...` in SAMPLING_KEYS order ('none' when empty)."""
    parts = [f"{k} {defaults[k]}" for k in SAMPLING_KEYS if k in defaults]
    return ", ".join(parts) if parts else "none"
