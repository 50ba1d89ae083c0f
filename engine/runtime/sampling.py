"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps all
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None

    def __post_init__(self):
        problems = []
        # Written so that NaN fails every check (each comparison with NaN is false).
        if not self.temperature >= 0 or self.temperature == float("inf"):
            problems.append(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.top_k >= 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            problems.append(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        if problems:
            raise ValueError("; ".join(problems))


class Sampler:
    """Picks the next token from last-position logits `[V]`; owns its random key."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.key = mx.random.key(params.seed) if params.seed is not None else None

    @property
    def reads_history(self) -> bool:
        """Whether a pick depends on the tokens before it (then decoding cannot run ahead)."""
        return self.p.repetition_penalty != 1.0

    def __call__(self, logits: mx.array, recent: Sequence[int]) -> mx.array:
        p = self.p
        logits = logits.astype(mx.float32)
        if p.repetition_penalty != 1.0 and recent:
            idx = mx.array(list(set(recent[-p.repetition_window :])))
            picked = logits[idx]
            logits[idx] = mx.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
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
