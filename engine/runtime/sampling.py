"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, seed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. The defaults are plain greedy decoding (the Python API's default).

    `presence_penalty` and `frequency_penalty` follow OpenAI: a token already generated in
    this answer has its logit lowered by `presence_penalty` once plus `frequency_penalty`
    times its count (the prompt does not count). `repetition_penalty` (divide positive
    logits, multiply negative ones) looks at the last `repetition_window` tokens, prompt
    included.
    """

    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps all
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        problems = []
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")  # fmt: skip
        bad_type = [n for n in floats if not _is_number(getattr(self, n))]
        for name in bad_type:
            problems.append(f"{name} must be a number, got {getattr(self, name)!r}")
        ok = set(floats) - set(bad_type)
        # Written so that NaN fails every check (each comparison with NaN is false).
        t = self.temperature
        if "temperature" in ok and (not t >= 0 or t == float("inf")):
            problems.append(f"temperature must be >= 0 and finite, got {t}")
        if "top_p" in ok and not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if "min_p" in ok and not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1), got {self.min_p}")
        r = self.repetition_penalty
        if "repetition_penalty" in ok and not 0 < r < float("inf"):
            problems.append(f"repetition_penalty must be > 0 and finite, got {r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if name in ok and not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        w = self.repetition_window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            problems.append(f"repetition_window must be an integer >= 1, got {w!r}")
        s = self.seed
        if s is not None and (
            not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= MAX_SEED
        ):
            problems.append(f"seed must be an integer from 0 to 2**64-1, got {s!r}")
        if problems:
            raise ValueError("; ".join(problems))


class Sampler:
    """Picks the next token from last-position logits `[V]`; owns its random key.

    One Sampler serves one answer: the first call's `recent` is taken as the prompt, what is
    appended after it as the answer (what presence and frequency penalties count).
    """

    def __init__(self, params: SamplingParams):
        self.p = params
        self.key = mx.random.key(params.seed) if params.seed is not None else None
        self._prompt_len: int | None = None
        self._counted = 0
        self._counts: Counter[int] = Counter()

    @property
    def reads_history(self) -> bool:
        """Whether a pick depends on the tokens before it (then decoding cannot run ahead)."""
        p = self.p
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0

    def penalized(self, logits: mx.array, recent: Sequence[int]) -> mx.array:
        """`logits` (float32) after the repetition, presence and frequency penalties."""
        p = self.p
        logits = logits.astype(mx.float32)
        if self._prompt_len is None:
            self._prompt_len = self._counted = len(recent)
        if p.repetition_penalty != 1.0 and recent:
            idx = mx.array(list(set(recent[-p.repetition_window :])))
            picked = logits[idx]
            logits[idx] = mx.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
        if p.presence_penalty or p.frequency_penalty:
            self._counts.update(recent[self._counted :])  # only what was generated since
            self._counted = len(recent)
            if self._counts:
                ids = list(self._counts)
                cut = [p.presence_penalty + p.frequency_penalty * self._counts[t] for t in ids]
                idx = mx.array(ids)
                logits[idx] = logits[idx] - mx.array(cut, dtype=mx.float32)
        return logits

    def __call__(self, logits: mx.array, recent: Sequence[int]) -> mx.array:
        p = self.p
        logits = self.penalized(logits, recent)
        if p.temperature == 0:
            return mx.argmax(logits)
        logits = logits / p.temperature
        if p.top_k:
            kth = mx.sort(logits)[-min(p.top_k, logits.shape[0])]
            logits = mx.where(logits < kth, -mx.inf, logits)
        probs = mx.softmax(logits)
        if p.min_p:
            logits = mx.where(probs < p.min_p * probs.max(), -mx.inf, logits)
        if p.top_p < 1.0:
            order = mx.argsort(-probs)
            sorted_probs = probs[order]
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop_sorted = (mx.cumsum(sorted_probs) - sorted_probs) >= p.top_p
            drop = mx.zeros_like(drop_sorted)
            drop[order] = drop_sorted
            logits = mx.where(drop, -mx.inf, logits)
        if self.key is None:
            return mx.random.categorical(logits)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logits, key=sub)
