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
    release()
    before = mx.get_active_memory()
    kept = fn()
    release()
    held = mx.get_active_memory() - before
    del kept
    return held


def release() -> None:
    """Free what is garbage: a collection can free cycles that only the next one finds (an
    engine closed by an earlier test held 3 MB until a second collection)."""
    while gc.collect():
        pass
    mx.clear_cache()


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


def test_the_pool_counts_each_shared_snapshot_once():
    # Requests that ask about the same pasted document fork from one another and share the
    # snapshots below the fork (the grid inside the document: pool.GRID): the budget counted
    # them once per holder, 17% over what MLX held after four requests here, and evicted
    # early by as much.
    import engine

    eng = engine.load("tiny")
    system = {"role": "system", "content": "Answer from the document."}
    document = " ".join(f"Clause {k}: the tenant keeps garden {k} tidy." for k in range(150))
    eng.chat([system, {"role": "user", "content": "Hi."}], max_tokens=2, warm=False)
    base = eng.budget.used()

    def ask():
        for question in ("What does clause 3 say?", "Who keeps the gardens?", "Is it tidy?",
                         "Which clause is last?"):  # fmt: skip
            messages = [system, {"role": "user", "content": f"{document}\n\n{question}"}]
            eng.chat(messages, max_tokens=4, warm=False)

    held = held_bytes(ask)
    counted = eng.budget.used() - base
    holders = {}
    for seq in eng.stateless.pool.sequences:
        for snap in seq.snapshots.values():
            holders[id(snap)] = holders.get(id(snap), 0) + 1
    assert max(holders.values()) >= 3  # the grid snapshots are shared by the forks
    assert abs(counted - held) <= 0.03 * held + (64 << 10), (counted, held)
    # Evicting one holder's reference to a shared snapshot frees nothing: the budget goes on
    # until what is still held fits.
    eng.budget.max_bytes = base + counted // 2
    eng.worker.call(eng.budget.enforce)
    assert eng.budget.used() <= eng.budget.max_bytes
    eng.close()


def test_answers_of_one_token_count_their_state_once():
    # A classifier-style request (max_tokens=1) feeds no token after its prompt: the decode
    # loop's own_buffers rebound the live state to a new array on the same buffer, so the
    # budget counted it beside the prompt-end snapshot holding the old one (15% over here).
    import engine

    eng = engine.load("tiny")
    system = {"role": "system", "content": "Classify the review as positive or negative."}
    eng.chat([system, {"role": "user", "content": "Hi."}], max_tokens=2, warm=False)
    base = eng.budget.used()

    def ask():
        for k in range(4):
            review = f"Review {k}: " + "the soup was cold and the waiter was rude. " * (20 + 7 * k)
            eng.chat([system, {"role": "user", "content": review}], max_tokens=1, warm=False)

    held = held_bytes(ask)
    counted = eng.budget.used() - base
    assert abs(counted - held) <= 0.03 * held + (64 << 10), (counted, held)
    eng.close()


def test_device_memory_decisions():
    from engine.runtime.memory import (
        MIN_BUDGET,
        DeviceMemory,
        GiB,
        clear_between_chunks,
        default_budget,
        fits,
        wired_limit,
    )

    cuda = DeviceMemory("cuda", limit=int(76 * GiB), total=80 * GiB)
    mac = DeviceMemory("metal", limit=int(48 * GiB), total=64 * GiB, recommended=int(44 * GiB))
    cpu = DeviceMemory("cpu", limit=20 * GiB)
    assert (cuda.usable, mac.usable, cpu.usable) == (76 * GiB, 44 * GiB, 20 * GiB)
    # the budget is a share of what the weights leave, never below the floor
    assert default_budget(16 * GiB, cuda) == 30 * GiB
    assert default_budget(4 * GiB, mac) == 20 * GiB
    assert default_budget(19 * GiB, cpu) == 512 * 2**20
    assert default_budget(30 * GiB, cpu) == MIN_BUDGET
    # weights that cannot fit are named with both sizes
    assert fits(40 * GiB, mac) is None
    assert fits(54 * GiB, mac) == (
        "the weights need 54.0 GiB, more than the 44.0 GiB MLX may use on this metal device; "
        "use a quantized checkpoint or a smaller model"
    )
    # the wired limit is a Metal matter, with mlx-lm's warning for models close to it
    assert wired_limit(8 * GiB, mac) == (44 * GiB, None)
    limit, warning = wired_limit(41 * GiB, mac)
    assert limit == 44 * GiB and "41.0 GiB" in warning
    assert wired_limit(8 * GiB, cuda) == (None, None) == wired_limit(8 * GiB, cpu)
    assert clear_between_chunks("cuda") and clear_between_chunks("metal")
    assert not clear_between_chunks("cpu")


def test_load_checks_the_device_and_sizes_the_budget(tiny, monkeypatch):
    from engine.checkpoints.loader import CheckpointError
    from engine.runtime import memory

    weights = 66533760  # tiny in float32
    fake = memory.DeviceMemory("cpu", limit=weights + (200 << 20))
    monkeypatch.setattr(memory, "device_memory", lambda: fake)
    eng = engine_load()
    assert eng.budget.max_bytes == 100 << 20  # half of what the weights leave
    assert engine_load(cache_bytes=12345).budget.max_bytes == 12345

    small = memory.DeviceMemory("cuda", limit=weights // 2, total=1 << 30)
    monkeypatch.setattr(memory, "device_memory", lambda: small)
    with pytest.raises(CheckpointError, match=r"need 0\.1 GiB, more than the 0\.0 GiB") as e:
        engine_load()
    assert "cuda device" in str(e.value)


def test_weights_size_is_known_before_loading(tiny, tiny_bf16):
    from mlx.utils import tree_flatten

    from engine.checkpoints.loader import weights_nbytes

    for eng in (tiny, tiny_bf16):  # one float32 checkpoint, loaded in two dtypes
        loaded = sum(v.nbytes for _, v in tree_flatten(eng.model.parameters()))
        assert weights_nbytes(eng.checkpoint, eng.dtype.size, dequantize_quantized=True) == loaded


def test_load_wires_the_recommended_working_set_on_metal(monkeypatch):
    from engine.runtime import memory

    mac = memory.DeviceMemory("metal", limit=48 << 30, total=64 << 30, recommended=44 << 30)
    monkeypatch.setattr(memory, "device_memory", lambda: mac)
    wired = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: wired.append(n) or 0)
    engine_load()
    assert wired == [44 << 30]


def test_prefill_clears_the_buffer_cache_between_chunks_on_a_gpu(tiny, monkeypatch):
    import engine.runtime.generate as generate

    cleared = []
    monkeypatch.setattr(generate.mx, "clear_cache", lambda: cleared.append(1))
    ids = tiny.tokenizer.encode(TEXT)[:200]
    for kind, expected in (("cpu", 0), ("cuda", 3)):
        cleared.clear()
        monkeypatch.setattr(generate, "device_kind", lambda k=kind: k)
        generate.prefill(tiny.model, tiny.model.make_caches(), ids, 0, chunk=64)  # 4 chunks
        assert len(cleared) == expected


def engine_load(**kwargs):
    import engine

    return engine.load("tiny", **kwargs)
