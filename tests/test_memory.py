"""Memory: what the byte budget counts is what MLX holds, and the defaults follow the device."""

from __future__ import annotations

import dataclasses
import gc

import mlx.core as mx
import pytest

from engine.runtime.sequence import CachedSequence
from engine.runtime.snapshot import CacheBudget

TEXT = "<|im_start|>user\n" + "Hello there, 你好! How are you doing today? " * 60


def held_bytes(fn) -> int:
    """Active MLX memory that `fn()`'s result keeps alive, with transient buffers released."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    kept = fn()
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    del kept
    return held


@pytest.mark.parametrize("budget", [None, 3 << 20])
def test_snapshots_hold_no_more_than_their_nbytes(tiny, budget):
    # Many snapshots recorded inside 64-token chunks: a conv tail kept as a slice of its
    # chunk's [1, K-1+64, C] window pinned the whole window (1.6x the counted bytes here).
    eng = tiny if budget is None else dataclasses.replace(tiny, budget=CacheBudget(budget))
    ids = eng.tokenizer.encode(TEXT)
    seq = CachedSequence(eng)

    def fill():
        seq.extend(ids, stops=range(10, len(ids), 16), chunk=64)
        return seq

    held = held_bytes(fill)
    assert len(seq.snapshots) > (10 if budget is None else 2)
    assert held <= 1.02 * seq.cache_bytes + (64 << 10)
    if budget is not None:
        assert eng.budget.evictions > 0
        assert held <= 1.02 * budget + (64 << 10)
