"""Shared test helpers: questions for scripted chats, the fresh-prefill reference, the
server tests' client, mlx-lm references loaded once per run."""

from __future__ import annotations

import functools
from pathlib import Path

from bench.common import fresh_greedy  # noqa: F401  (the fresh-prefill reference)

# A tool, a call of it in an assistant message, and its result: a tool turn's history.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]  # fmt: skip
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
]}  # fmt: skip
RESULT = '{"temp_c": 21}'

SERVER_WINDOW = 4096  # the `server` fixture's context window (small: too-long checks are cheap)

QUESTIONS = [
    "Hello! My order number is 48213.", "你好，今天天气怎么样？", "Tell me a story about a fox.",
    "What is 17 times 23?", "Summarize the French revolution in one line. " * 3,
    "请用中文解释一下量子计算。", "Code word: PELICAN. Remember it.", "ok", "Why is the sky blue? 🌌",
    "List three prime numbers\nand explain.",
]  # fmt: skip


def openai_client(srv, key: str = "unused"):
    """The official OpenAI client on a BackgroundServer (no retries: a failure shows)."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def serve_app(monkeypatch, eng, argv: list[str]):
    """The app `chatml serve ARGV` would serve, built through the real parser and start-up on
    `eng` (engine.load stubbed), with uvicorn's server replaced by one that serves nothing."""
    import engine
    import engine.serving.server as server
    from engine.cli import build_parser

    apps = []

    class Served:  # stands in for uvicorn's server: keeps the app, serves nothing
        def __init__(self, config):
            apps.append(config.app)

        def run(self, sockets):
            pass

    monkeypatch.setattr(engine, "load", lambda *a, **k: eng)
    monkeypatch.setattr(server.uvicorn, "Server", Served)
    assert server.run(build_parser().parse_args(["serve", *argv, "--port", "0"])) == 0
    return apps[-1]


@functools.cache
def mlx_lm_model(path: str | Path):
    """mlx-lm's own model for a checkpoint folder, once per folder per run. Without the
    tokenizer: building that is nearly all of `mlx_lm.load`'s time (seconds, 20+ s loaded)."""
    from bench.common import mlx_lm_model as load_model

    return load_model(path)


@functools.cache
def mlx_lm_load(path: str | Path):
    """`mlx_lm.load(path)` (model, tokenizer), once per folder per run (the model is only
    called, never changed)."""
    from mlx_lm import load

    return load(str(path))


@functools.cache
def mlx_lm_quantized(source: str | Path, bits: int) -> Path:
    """`source` quantized by mlx-lm's converter (group size 64), once per run."""
    import tempfile

    from mlx_lm import convert

    from engine.paths import chatml_home

    home = chatml_home() / "test-mlx-lm-quantized"
    home.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(dir=home)) / f"{Path(source).name}-{bits}bit"
    convert(str(source), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64)
    return out
