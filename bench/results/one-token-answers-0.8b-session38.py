"""The session-38 run behind BENCHMARKS "answers of one token": eight classifier-style requests
(max_tokens=1) on the 0.8B, then what MLX holds against the budget's count, with the decode
loop's `own_buffers` as it is and as it was before session 38 (a new array object for every
state, on the same buffer). `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python
bench/results/one-token-answers-0.8b-session38.py` from the repository root."""

import gc

import engine
from bench.common import model_path
from engine.runtime import batch


def settled_memory() -> int:
    import mlx.core as mx  # after engine: its fast BLAS loads before MLX

    while gc.collect():
        pass
    mx.clear_cache()
    return mx.get_active_memory()


def rebinding(caches: list) -> None:  # own_buffers before session 38
    import mlx.core as mx

    for c in caches:
        if isinstance(c, batch.RecurrentCache) and isinstance(c.state, mx.array):
            c.state = mx.contiguous(c.state)
            if c.conv is not None:
                c.conv = mx.contiguous(c.conv)


M = 2**20
system = {"role": "system", "content": "Classify the review as positive or negative."}
for name, own in (("now", batch.own_buffers), ("before", rebinding)):
    batch.own_buffers = own
    eng = engine.load(str(model_path("qwen3.5-0.8b")))
    eng.chat([system, {"role": "user", "content": "Hi."}], max_tokens=2, warm=False)
    before, base = settled_memory(), eng.budget.used()
    for k in range(8):
        review = f"Review {k}: " + "the soup was cold and the waiter was rude. " * (30 + 5 * k)
        eng.chat([system, {"role": "user", "content": review}], max_tokens=1, warm=False)
    held, counted = settled_memory() - before, eng.budget.used() - base
    print(f"{name}: MLX held {held / M:.0f} MiB, counted {counted / M:.0f} MiB "
          f"({counted / held:.2f}x)")  # fmt: skip
    eng.close()
    del eng
