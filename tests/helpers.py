"""Shared test helpers: questions for scripted chats, the fresh-prefill reference, the
server tests' client."""

from __future__ import annotations

import mlx.core as mx

SERVER_WINDOW = 4096  # the `server` fixture's context window (small: too-long checks are cheap)

QUESTIONS = [
    "Hello! My order number is 48213.", "你好，今天天气怎么样？", "Tell me a story about a fox.",
    "What is 17 times 23?", "Summarize the French revolution in one line. " * 3,
    "请用中文解释一下量子计算。", "Code word: PELICAN. Remember it.", "ok", "Why is the sky blue? 🌌",
    "List three prime numbers\nand explain.",
]  # fmt: skip


def fresh_greedy(eng, ids, max_tokens=5):
    """Greedy decode after one full prefill on fresh caches: no session, no snapshots."""
    caches = eng.model.make_caches()
    logits = first = eng.model(mx.array([ids]), caches)[0, -1]
    out = []
    while len(out) < max_tokens:
        token = mx.argmax(logits).item()
        if token in eng.stop_ids:
            break
        out.append(token)
        if len(out) < max_tokens:
            logits = eng.model(mx.array([[token]]), caches)[0, -1]
    return out, first


def openai_client(srv, key: str = "unused"):
    """The official OpenAI client on a BackgroundServer (no retries: a failure shows)."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
