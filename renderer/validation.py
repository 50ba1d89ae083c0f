"""Validation of what callers of the engine-facing API pass.

`render_messages` accepts exactly what the official template accepts; the engine is stricter
so that mistakes surface as clear errors instead of odd prompts: known roles only, system
only first, content a string or a list of parts, no empty user message, well-formed tool calls,
and exchanges in the order user, (assistant tool calls, tool results)*, assistant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .content import render_content
from .errors import RenderError

ROLES = ("system", "user", "assistant", "tool")


def _err(reason: str, where: str, index: int, field: str | None = None) -> RenderError:
    return RenderError(reason, index=index, field=field, where=where)


def _check_parts(content: Sequence, where: str, index: int, role: str) -> None:
    for j, part in enumerate(content):
        field = f"content[{j}]"
        if not isinstance(part, Mapping):
            raise _err(
                f"a content part must be a dict, got {type(part).__name__}", where, index, field
            )
        kind = part.get("type")
        if "image" in part or "image_url" in part or kind == "image":
            kind = "image"
        elif "video" in part or kind == "video":
            kind = "video"
        elif "text" in part:
            if not isinstance(part["text"], str):
                raise _err("text must be a string", where, index, field + ".text")
            continue
        else:
            raise _err(
                f"unknown content part type {kind!r} (expected text, image or video)",
                where,
                index,
                field,
            )
        if role == "system":
            raise _err(f"a system message cannot contain a {kind}", where, index, field)


def _normalize_tool_calls(calls: Any, where: str, index: int) -> list[dict]:
    if not isinstance(calls, (list, tuple)):
        raise _err("tool_calls must be a list", where, index, "tool_calls")
    out = []
    for j, call in enumerate(calls):
        field = f"tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise _err("a tool call must be a dict", where, index, field)
        function = call.get("function", call)
        if "function" in call:
            field += ".function"
        if not isinstance(function, Mapping):
            raise _err("function must be a dict with name and arguments", where, index, field)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _err(
                "the function name must be a non-empty string", where, index, field + ".name"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            # OpenAI clients send arguments as a JSON string; the template only takes a mapping.
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise _err(
                    f"arguments are not valid JSON: {e}", where, index, field + ".arguments"
                ) from None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise _err("arguments must be a JSON object", where, index, field + ".arguments")
        for key in arguments:
            if not isinstance(key, str):
                raise _err(
                    f"argument name {key!r} is not a string", where, index, field + ".arguments"
                )
        function = {**function, "arguments": dict(arguments)}
        out.append({**call, "function": function} if "function" in call else function)
    return out


def validate_message(
    message: Any, index: int, *, where: str | None = None, allow_system: bool = False
) -> dict:
    """Check one message; return a shallow copy with tool-call arguments parsed to dicts."""
    where = where or f"message {index}"
    if not isinstance(message, Mapping):
        raise _err(f"a message must be a dict, got {type(message).__name__}", where, index)
    role = message.get("role")
    if role not in ROLES:
        raise _err(f"role must be one of {', '.join(ROLES)}, got {role!r}", where, index, "role")
    if role == "system" and not allow_system:
        raise _err(
            "a system message is only allowed first (pass it as system=)", where, index, "role"
        )
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        _check_parts(content, where, index, role)
    elif content is not None and not isinstance(content, str):
        raise _err(
            f"content must be a string or a list of parts, got {type(content).__name__}",
            where,
            index,
            "content",
        )
    out = dict(message)
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _err("only assistant messages can carry tool_calls", where, index, "tool_calls")
        out["tool_calls"] = _normalize_tool_calls(calls, where, index)
    if role == "assistant":
        for key in ("reasoning_content", "thinking", "reasoning"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise _err("reasoning must be a string", where, index, key)
        if content is None and not calls:
            raise _err("an assistant message needs content or tool_calls", where, index, "content")
    if role == "user":
        text = render_content(content, index).strip()
        if not text:
            raise _err("a user message must not be empty", where, index, "content")
        if text.startswith("<tool_response>") and text.endswith("</tool_response>"):
            # The template would not count it as the user's query; send results as role "tool".
            raise _err(
                "user content wrapped in <tool_response> tags; use role 'tool'",
                where,
                index,
                "content",
            )
    if role == "tool" and content is None:
        raise _err("a tool message needs content", where, index, "content")
    return out


def validate_messages(messages: Sequence[Any]) -> list[dict]:
    """Validate a flat conversation (system allowed only first); return normalized copies."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise RenderError("messages must be a list of message dicts")
    if not messages:
        raise RenderError("No messages provided.")
    return [validate_message(m, i, allow_system=i == 0) for i, m in enumerate(messages)]


def validate_exchange(
    exchange: Any, *, complete: bool = True, where: str = "exchange"
) -> list[dict]:
    """Validate one exchange: user, then (assistant with tool_calls, tool+)*, then (if
    `complete`) a final assistant answer; an incomplete one (the current exchange) ends with
    the user message or a tool result."""
    if not isinstance(exchange, (list, tuple)) or not exchange:
        raise RenderError("an exchange must be a non-empty list of messages", where=where)
    out = [validate_message(m, i, where=f"{where} message {i}") for i, m in enumerate(exchange)]
    if out[0]["role"] != "user":
        raise _err("an exchange must start with a user message", f"{where} message 0", 0, "role")
    for i, message in enumerate(out[1:], 1):
        if message["role"] == "user":
            raise _err(
                "a user message starts a new exchange; split them",
                f"{where} message {i}",
                i,
                "role",
            )
    for i, message in enumerate(out[1:], 1):
        role, prev = message["role"], out[i - 1]
        at = f"{where} message {i}"
        if role == "tool" and not (prev["role"] == "tool" or prev.get("tool_calls")):
            raise _err(
                "a tool result must follow an assistant tool call or another result", at, i, "role"
            )
        if prev["role"] == "assistant" and prev.get("tool_calls") and role != "tool":
            raise _err("the results of the previous tool calls are missing", at, i, "role")
        if (
            role == "assistant"
            and not message.get("tool_calls")
            and (not complete or i != len(out) - 1)
        ):
            raise _err(
                "only the final answer may be an assistant message without tool_calls",
                at,
                i,
                "tool_calls",
            )
    last = len(out) - 1
    if complete and (out[-1]["role"] != "assistant" or out[-1].get("tool_calls")):
        raise _err(
            "a completed exchange must end with the assistant's final answer",
            f"{where} message {last}",
            last,
            "role",
        )
    if not complete and out[-1]["role"] == "assistant":
        raise _err(
            "the current exchange must end with the user message or a tool result",
            f"{where} message {last}",
            last,
            "role",
        )
    return out


def split_conversation(messages: Sequence[Any]) -> tuple[str | None, list[list[dict]], list[dict]]:
    """Split a flat OpenAI-style message list into (system, history, current) for build_prompt.

    Every user message opens an exchange; the last exchange is the current one.
    """
    flat = validate_messages(messages)
    system = None
    if flat[0]["role"] == "system":
        # Rendering then trimming is exactly what the template does with system content.
        system = render_content(flat[0].get("content"), 0, is_system=True).strip()
        flat = flat[1:]
    exchanges: list[list[dict]] = []
    for message in flat:
        if message["role"] == "user" or not exchanges:
            exchanges.append([])
        exchanges[-1].append(message)
    if not exchanges:
        raise RenderError("No user query found in messages.")
    return system, exchanges[:-1], exchanges[-1]
