"""The session-37 run behind BENCHMARKS "A long system block gets the grid too" (kept as run):
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/results/system-grid-qwen3.5-0.8b-session37.py`
from the repository root. Three conversations whose 1300-token system prompt differs only in
its last line, with the system block's grid off (`stateless.grid_points` patched to skip
position 0) and on, alternating on one engine; prints time to first token / tokens reused."""

import engine
from bench.common import model_path
from engine import stateless

eng = engine.load(str(model_path("qwen3.5-0.8b")))
rules = " ".join(
    f"Rule {k}: answer politely, cite clause {k}, and keep garden {k} tidy." for k in range(60)
)
real = stateless.grid_points
for r in range(2):
    for on in (False, True):
        stateless.grid_points = (
            real if on else (lambda first, end: real(first, end) if first else set())
        )
        out = []
        for day in (1, 2, 3):
            m = [
                {"role": "system", "content": f"Round {r} {on}. {rules}\nToday is December {day}."},
                {"role": "user", "content": "Hi, who are you?"},
            ]
            t = eng.chat(m, max_tokens=1, warm=False)
            out.append(f"{t.stats.ttft_s:.2f}s/{t.stats.reused_tokens}")
        print(
            r,
            "system grid" if on else "before     ",
            len(t.prompt_ids),
            "tokens:",
            " ".join(out),
            flush=True,
        )
