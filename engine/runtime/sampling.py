"""Token sampling: a chain of logits processors, then the pick.

A row's chain runs in one fixed order: the penalties (repetition), then the grammar mask
(constrained decoding), then the pick (greedy, or temperature with top-k, top-p, min-p and a
seeded key). Log-probabilities are read from the same processed logits, before temperature.
A processor that needs the tokens read on the host (a penalty over the history, a grammar
matcher that advances by accepted tokens) says so with `reads_history`: decoding cannot run a
step ahead of it (see `generate.decode`).
"""

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


class LogitsProcessor:
    """One link of the chain: float32 logits `[V]` in, processed logits `[V]` out."""

    reads_history = False  # True: needs the tokens read so far on the host

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        raise NotImplementedError

    def accept(self, tokens: Sequence[int]) -> None:
        """Tokens that stood (stateful processors, e.g. a grammar matcher, advance here)."""


class RepetitionPenalty(LogitsProcessor):
    """Divide positive (multiply negative) logits of the last `window` tokens by `penalty`."""

    reads_history = True

    def __init__(self, penalty: float, window: int):
        self.penalty, self.window = penalty, window

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        if not history:
            return logits
        idx = mx.array(list(set(history[-self.window :])))
        picked = logits[idx]
        logits[idx] = mx.where(picked > 0, picked / self.penalty, picked * self.penalty)
        return logits


def processors_for(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors `params` asks for, in the chain's order."""
    chain: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(params.repetition_penalty, params.repetition_window))
    return chain


class Sampler:
    """A row's chain: `processors` (default: those `params` asks for), then the pick.

    `sampler(logits, history)` returns the next token as a (lazy) scalar array; it owns the
    row's random key, so a seeded row draws the same tokens whatever else runs.
    """

    def __init__(self, params: SamplingParams, processors: list[LogitsProcessor] | None = None):
        self.p = params
        self.processors = processors_for(params) if processors is None else processors
        self.key = mx.random.key(params.seed) if params.seed is not None else None

    @property
    def reads_history(self) -> bool:
        """Whether a pick depends on the tokens before it (then decoding cannot run ahead)."""
        return any(p.reads_history for p in self.processors)

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        return self.pick(self.process(logits, history))

    def process(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        logits = logits.astype(mx.float32)
        for p in self.processors:
            logits = p(logits, history)
        return logits

    def logprobs(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        """Log-probabilities `[V]` of the processed logits (what the pick chooses from, before
        temperature and the top-k/top-p/min-p cuts)."""
        processed = self.process(logits, history)
        return processed - mx.logsumexp(processed)

    def accept(self, tokens: Sequence[int]) -> None:
        for p in self.processors:
            p.accept(tokens)

    def pick(self, logits: mx.array) -> mx.array:
        p = self.p
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
