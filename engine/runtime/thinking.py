"""A thinking budget: past `budget` tokens of reasoning, `</think>` is forced.

A link of the sampler's chain for a turn that opens in a think block. The state lives on the
device (a count of picks and whether `</think>` came), so decoding still runs a step ahead:
while the block is open and the count has reached the budget, every logit but `</think>`'s
becomes -inf. After it the answer is free (or constrained by the grammar further on).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .sampling import LogitsProcessor

# OpenAI's reasoning_effort as thinking budgets (tokens of reasoning before `</think>`).
EFFORT_BUDGETS = {"low": 512, "medium": 2048, "high": 8192}


class ThinkingBudget(LogitsProcessor):
    """At most `budget` tokens inside the think block; then `</think>` (`think_end`)."""

    def __init__(self, budget: int, think_end: int):
        self.budget, self.think_end = budget, think_end
        self.count = mx.array(0)  # picks so far
        self.closed = mx.array(False)  # `</think>` was picked

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        force = mx.logical_and(mx.logical_not(self.closed), self.count >= self.budget)
        only = mx.arange(logits.shape[-1]) == self.think_end
        return mx.where(mx.logical_and(force, mx.logical_not(only)), -mx.inf, logits)

    def advance(self, token: mx.array) -> None:
        self.count = self.count + 1
        self.closed = mx.logical_or(self.closed, token.reshape(()) == self.think_end)
