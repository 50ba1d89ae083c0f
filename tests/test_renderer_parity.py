"""Byte parity with the official templates on generated conversations, and raise parity."""

from __future__ import annotations

import copy
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_renderer_support import (  # noqa: E402
    REPO,
    SHARED,
    SHARED_NAMES,
    VARIANT_NAMES,
    rand_conversation,
    reference_render,
)

from renderer import VARIANTS, RenderError, render_messages  # noqa: E402

N_CONVERSATIONS = 1000
N_MUTATIONS = 400


def _both(messages: Any, variant: str, kwargs: dict) -> tuple[Any, Any]:
    try:
        ref = reference_render(messages, variant, **kwargs)
    except Exception as e:  # jinja TemplateError, TypeError, UndefinedError, ValueError...
        ref = e
    try:
        ours = render_messages(messages, variant=variant, **kwargs)
    except RenderError as e:
        ours = e
    return ref, ours


def _check(ref: Any, ours: Any, where: str) -> None:
    if isinstance(ref, Exception) or isinstance(ours, Exception):
        assert isinstance(ref, Exception) and isinstance(ours, RenderError), (
            f"{where}: template -> {ref!r}, ours -> {ours!r}"
        )
        return
    if ours != ref:
        i = next(
            (i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b),
            min(len(ours), len(ref)),
        )
        pytest.fail(
            f"{where}: first difference at {i}\nref:  {ref[i - 60 : i + 60]!r}\n"
            f"ours: {ours[i - 60 : i + 60]!r}"
        )


def test_variants_known() -> None:
    assert set(VARIANTS) == set(VARIANT_NAMES)
    with pytest.raises(ValueError):
        render_messages([{"role": "user", "content": "hi"}], variant="qwen9")


def test_template_copies_identical() -> None:
    for variant, name in SHARED_NAMES.items():
        ours = REPO / "engine" / "checkpoints" / "templates" / VARIANTS[variant].template
        if (SHARED / name).exists() and ours.exists():
            assert ours.read_bytes() == (SHARED / name).read_bytes(), variant


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_generated_parity(variant: str) -> None:
    rng = random.Random(f"parity-{variant}")
    seen: Counter = Counter()
    for n in range(N_CONVERSATIONS):
        messages, kwargs = rand_conversation(rng)
        ref, ours = _both(messages, variant, kwargs)
        _check(ref, ours, f"{variant} #{n}")
        seen["ok" if isinstance(ref, str) else "raised"] += 1
        roles = [m.get("role") for m in messages]
        seen["system"] += roles[0] == "system"
        seen["tools"] += bool(kwargs["tools"])
        seen["tool_run"] += any(a == b == "tool" for a, b in zip(roles, roles[1:], strict=False))
        seen["no_gen"] += not kwargs["add_generation_prompt"]
        for m in messages:
            c = m.get("content")
            seen["parts"] += isinstance(c, list)
            seen["image"] += isinstance(c, list) and any("image" in str(p) for p in c)
            seen["video"] += isinstance(c, list) and any("video" in str(p) for p in c)
            seen["inline_think"] += isinstance(c, str) and "</think>" in c
            seen["reasoning"] += "reasoning_content" in m
            seen["tool_calls"] += bool(m.get("tool_calls"))
    # The generator really covers what the issue lists.
    for key in (
        "system",
        "tools",
        "tool_run",
        "no_gen",
        "parts",
        "image",
        "video",
        "inline_think",
        "reasoning",
        "tool_calls",
    ):
        assert seen[key] >= 50, (key, seen)
    assert seen["ok"] >= 0.9 * N_CONVERSATIONS, seen


WEIRD: list[Any] = [
    None,
    5,
    1.5,
    True,
    "",
    "text",
    "image",
    "a video",
    [],
    ["image"],
    ["text"],
    {},
    {"text": 5},
    {"text": None},
    {"type": "text"},
    {"type": "image"},
    {"type": "audio"},
    {"image_url": None},
    ("tuple",),
    {"function": None},
    {"function": "x"},
    {"name": 5},
    {"name": "f", "arguments": '{"a": 1}'},
    {"name": "f", "arguments": None},
    {"name": "f", "arguments": {1: 2}},
    {"name": "f"},
    "abc",
    [{"text": "x"}, 3],
    [{"text": "hi"}, "context"],
    [None],
    {"role": "user"},
    "system",
    "tool",
    "user",
    {"function": {"name": "g", "arguments": {"k": [1, {"z": None}], "t": (1, 2)}}},
]


def _mutate(rng: random.Random, messages: list[dict]) -> list[dict]:
    messages = copy.deepcopy(messages)
    i = rng.randrange(len(messages))
    k = rng.random()
    if k < 0.2:
        messages[i]["content"] = rng.choice(WEIRD)
    elif k < 0.3:
        messages[i]["role"] = rng.choice(WEIRD)
    elif k < 0.45:
        messages[i]["tool_calls"] = rng.choice(
            [rng.choice(WEIRD), [rng.choice(WEIRD)], [rng.choice(WEIRD), rng.choice(WEIRD)]]
        )
    elif k < 0.5:
        messages[i]["reasoning_content"] = rng.choice(WEIRD)
    elif k < 0.6:
        messages.insert(
            rng.randrange(len(messages) + 1),
            {"role": "system", "content": rng.choice(["s", [{"type": "image"}], None])},
        )
    elif k < 0.65:
        messages = [m for m in messages if m.get("role") != "user"]
    elif k < 0.7:
        messages.insert(
            rng.randrange(len(messages) + 1), {"role": "tool", "content": rng.choice(WEIRD)}
        )
    elif k < 0.75:
        messages[i] = rng.choice([{}, {"role": "tool"}, {"content": "x"}])
    elif k < 0.8:
        messages = []
    elif k < 0.9:
        messages.insert(0, {"role": "tool", "content": "first"})
    else:
        messages[i].pop("content", None)
    return messages


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_mutated_parity(variant: str) -> None:
    """Odd and invalid inputs: same text, or both raise (ours a RenderError)."""
    rng = random.Random(f"mutate-{variant}")
    raised = 0
    for n in range(N_MUTATIONS):
        messages, kwargs = rand_conversation(rng)
        messages = _mutate(rng, messages)
        if rng.random() < 0.1:
            kwargs["tools"] = rng.choice([{}, {"a": 1}, "", [1], ["x"], ({"a": "b"},)])
        ref, ours = _both(messages, variant, kwargs)
        _check(ref, ours, f"{variant} mutation #{n}")
        raised += isinstance(ref, Exception)
    assert 0.25 * N_MUTATIONS < raised < 0.9 * N_MUTATIONS


U = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "messages, index, reason",
    [
        ([], None, "No messages provided"),
        ([U, {"role": "system", "content": "s"}], 1, "System message must be at the beginning"),
        ([{"role": "assistant", "content": "a"}], None, "No user query found"),
        ([U, {"role": "bot", "content": "a"}], 1, "Unexpected message role"),
        ([U, {"role": "user", "content": 3}], 1, "Unexpected content type"),
        ([U, {"role": "user", "content": [{"type": "audio"}]}], 1, "Unexpected item type"),
        ([{"role": "system", "content": [{"type": "image"}]}, U], 0, "cannot contain images"),
        ([U, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], 1, "name"),
        (
            [U, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{}"}]}],
            1,
            "arguments must be a mapping",
        ),
    ],
)
def test_errors_name_index_and_reason(messages: list, index: int | None, reason: str) -> None:
    with pytest.raises(RenderError) as info:
        render_messages(messages)
    assert info.value.index == index
    assert reason in str(info.value)
    if index is not None:
        assert f"message {index}" in str(info.value)
    with pytest.raises(Exception):  # noqa: B017 - and the template raises too
        reference_render(messages, "qwen3.5")


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("where", ["arguments", "tools"])
def test_nesting_past_the_recursion_limit_raises_render_error(where: str) -> None:
    """JSON too deep for json.dumps: the template raises (RecursionError in its tojson), and
    so must we, as a RenderError naming the field, not a bare RecursionError."""
    deep = _nested(sys.getrecursionlimit() + 100)
    messages: list[dict] = [U]
    tools = None
    if where == "arguments":
        call = {"function": {"name": "f", "arguments": {"x": deep}}}
        messages = [U, {"role": "assistant", "content": "", "tool_calls": [call]}]
    else:
        tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    for variant in VARIANT_NAMES:
        ref, ours = _both(messages, variant, {"tools": tools})
        _check(ref, ours, f"{variant} deep {where}")


@pytest.mark.parametrize("value", [b"ab", {1, 2}, 1 + 2j, range(3), [b"x"]],
                         ids=["bytes", "set", "complex", "range", "list-of-bytes"])  # fmt: skip
@pytest.mark.parametrize("where", ["argument", "text-part"])
def test_values_that_are_not_json_are_refused_not_printed_another_way(value, where) -> None:
    """transformers hands the template JSON data only (anything else becomes a "<type>"
    placeholder string first), so a Python object the caller passes renders as, e.g.,
    "<bytes>" there. We refuse such values (a RenderError, as for non-JSON content), never
    print them another way (`str(value)`: "b'ab'")."""
    if where == "argument":
        call = {"function": {"name": "f", "arguments": {"x": value}}}
        messages = [U, {"role": "assistant", "content": "", "tool_calls": [call]}]
    else:
        messages = [{"role": "user", "content": [{"type": "text", "text": value}]}]
    for variant in VARIANT_NAMES:
        reference = reference_render(messages, variant)
        assert f"<{type(value).__name__}>" in reference or "<bytes>" in reference
        with pytest.raises(RenderError, match="not JSON"):
            render_messages(messages, variant=variant)
