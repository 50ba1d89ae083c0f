"""The session-38 run behind BENCHMARKS "How wide a grid": `bench.fork`'s four questions on a
40-clause document on the 0.8B, with `pool.GRID` 256 (the default) and 128 alternating, three
rounds, each on a fresh engine and a system prompt of its own. `env -u OPENBLAS_CORETYPE -u
OPENBLAS_L2_SIZE python bench/results/grid-width-qwen3.5-0.8b-session38.py` from the
repository root."""

import argparse

from bench.common import model_path
from bench.fork import run_round
from engine.runtime import pool

args = argparse.Namespace(clauses=40, questions=4, max_tokens=1)
folder = str(model_path("qwen3.5-0.8b"))
for r in range(3):
    for grid in (256, 128) if r % 2 == 0 else (128, 256):
        pool.GRID = grid
        x = run_round(folder, args, salt=10 * r + grid, mode="grid")
        pairs = " ".join(f"{t:.2f}s/{n}" for t, n in zip(x["ttft_s"], x["reused_tokens"]))
        print(f"round {r} GRID {grid}: {x['prompt_tokens']} tokens, TTFT/reused {pairs} "
              f"| load {x['load_average']}", flush=True)  # fmt: skip
