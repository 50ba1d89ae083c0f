"""The session-37 run behind BENCHMARKS "the budget counted a shared snapshot once per sequence":
six questions on one pasted document on the 0.8B, then what MLX holds against the budget's count
now and the old per-holder count. `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python
bench/results/budget-shared-snapshots-0.8b-session37.py` from the repository root."""

import gc

import engine
from bench.common import model_path
from bench.fork import QUESTIONS, document


def settled_memory() -> int:
    import mlx.core as mx  # after engine: its fast BLAS loads before MLX

    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def per_holder_count() -> int:  # the count before session 37: a shared snapshot once a holder
    return sum(s.cache_bytes for s in eng.budget._all())


eng = engine.load(str(model_path("qwen3.5-0.8b")))
system = {"role": "system", "content": "Answer from the document."}
eng.chat([system, {"role": "user", "content": "Hi."}], max_tokens=2, warm=False)
before, base, base_old = settled_memory(), eng.budget.used(), per_holder_count()
for q in QUESTIONS:
    messages = [system, {"role": "user", "content": document(40) + "\n\n" + q}]
    eng.chat(messages, max_tokens=8, warm=False)
M = 2**20
print(f"MLX held {(settled_memory() - before) / M:.0f} MiB; counted now "
      f"{(eng.budget.used() - base) / M:.0f} MiB; counted before "
      f"{(per_holder_count() - base_old) / M:.0f} MiB")  # fmt: skip
