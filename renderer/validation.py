"""Validation of what callers of the engine-facing API pass.

`render_messages` accepts exactly what the official template accepts; the engine is stricter
so that mistakes surface as clear errors instead of odd prompts: known roles only, system
only first, content a string or a list of parts, no empty user message, well-formed tool calls,
and exchanges in the order user, (assistant tool calls, tool results)*, assistant.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .content import render_content
from .errors import RenderError

ROLES = ("system", "user", "assistant", "tool")
MAX_JSON_DEPTH = 64  # far deeper than any real schema or arguments; keeps every walk shallow
MAX_INT_DIGITS = 1000  # below Python's int/str conversion limit (4300), so no step can fail
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # str holds them; UTF-8 (and tokenizers) not


class JSONLimitError(ValueError):
    """JSON text that parses in principle but exceeds what the engine takes (depth, digits)."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONLimitError(f"an integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def loads_json(text: str | bytes) -> Any:
    """`json.loads` that fails with a ValueError, never RecursionError, on hostile input.

    json.JSONDecodeError for bad syntax, UnicodeDecodeError for bytes that are not UTF-8/16/32,
    JSONLimitError for integers over MAX_INT_DIGITS digits or nesting past the recursion limit.
    The result still needs `json_problem` (depth, lone surrogates).
    """
    try:
        return json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise JSONLimitError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None


def _children(value: Any) -> Iterator[tuple[Any, Any]]:
    return iter(value.items()) if isinstance(value, Mapping) else enumerate(value)


def _leaf_problem(value: Any) -> str | None:
    if isinstance(value, str):
        if _LONE_SURROGATE.search(value):
            return "contains a lone surrogate code point (not valid Unicode)"
    elif isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_DIGITS * 3.33:  # log2(10) bits per digit
            return f"an integer with more than {MAX_INT_DIGITS} digits"
    return None


def json_path(prefix: str, keys: Sequence[Any]) -> str:
    """``prefix`` followed by ``.key`` / ``[i]`` for each key: ``messages[0].content``."""
    out = prefix
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else f".{k}"
    return out.lstrip(".")


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> tuple[list, str] | None:
    """The first part of a JSON-like value the engine cannot take, as (keys to it, reason).

    Lone surrogates (in strings or keys) cannot be encoded as UTF-8, so no tokenizer takes
    them; nesting deeper than `max_depth` or integers of more than MAX_INT_DIGITS digits make
    recursive code (json, the template) fail. Iterative, so any depth is safe to check.
    """
    problem = _leaf_problem(value)
    if problem:
        return [], problem
    if not isinstance(value, (Mapping, list, tuple)):
        return None
    stack: list[tuple[Iterator, list]] = [(_children(value), [])]
    while stack:
        children, keys = stack[-1]
        item = next(children, None)
        if item is None:
            stack.pop()
            continue
        key, child = item
        if isinstance(key, str) and _LONE_SURROGATE.search(key):  # named by its parent
            return keys, "a key contains a lone surrogate code point (not valid Unicode)"
        where = [*keys, key]
        problem = _leaf_problem(child)
        if problem:
            return where, problem
        if isinstance(child, (Mapping, list, tuple)):
            if len(stack) >= max_depth:
                return where, f"nested deeper than {max_depth} levels"
            stack.append((_children(child), where))
    return None


def _err(reason: str, where: str, index: int, field: str | None = None) -> RenderError:
    return RenderError(reason, index=index, field=field, where=where)


def part_kind(part: Mapping) -> Any:
    """What the template makes of a content part: "image", "video", "text" (a part with a
    "text" key, whatever its type), else None (the template raises)."""
    kind = part.get("type")
    if "image" in part or "image_url" in part or kind == "image":
        return "image"
    if "video" in part or kind == "video":
        return "video"
    if "text" in part:
        return "text"
    return None


def _check_parts(content: Sequence, where: str, index: int, role: str) -> None:
    for j, part in enumerate(content):
        field = f"content[{j}]"
        if not isinstance(part, Mapping):
            raise _err(
                f"a content part must be a dict, got {type(part).__name__}", where, index, field
            )
        kind = part_kind(part)
        if kind == "text":
            if not isinstance(part["text"], str):
                raise _err("text must be a string", where, index, field + ".text")
            continue
        if kind is None and part.get("type") == "text":
            raise _err("a text part needs its 'text' (a string)", where, index, field + ".text")
        if kind is None:
            raise _err(
                f"unknown content part type {part.get('type')!r} (expected text, image or video)",
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
                arguments = loads_json(arguments) if arguments.strip() else {}
            except ValueError as e:  # bad syntax, or too deep / too many digits
                raise _err(
                    f"arguments are not valid JSON: {e}", where, index, field + ".arguments"
                ) from None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise _err("arguments must be a JSON object", where, index, field + ".arguments")
        problem = json_problem(arguments)
        if problem:
            at = json_path(field + ".arguments", problem[0])
            raise _err(f"{at}: {problem[1]}", where, index, field + ".arguments")
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


def check_text_only(messages: Sequence[Mapping]) -> None:
    """Refuse image and video parts: the engine runs the text model only (no vision tower),
    so the placeholders would reach the model with nothing behind them."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, (list, tuple)):
            continue
        for j, part in enumerate(content):
            kind = part_kind(part)
            if kind in ("image", "video"):
                raise _err(
                    f"{kind} input is not supported: this engine runs the text model only",
                    f"message {i}",
                    i,
                    f"content[{j}]",
                )


def check_tool_results(messages: Sequence[Mapping]) -> None:
    """Every assistant tool call gets exactly one `tool` result right after it.

    A result's `tool_call_id`, when given, must name one of those calls (each once): a result
    that answers no call, or a call left without a result, would make the model read the
    wrong answer or none. Run on validated messages (`validate_messages`).
    """
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if not calls:
            continue
        results = i + 1
        while results < len(messages) and messages[results].get("role") == "tool":
            results += 1
        count = results - i - 1
        if count > len(calls):
            k = i + 1 + len(calls)
            raise _err(
                f"{count} tool results follow {len(calls)} tool calls (one result per call)",
                f"message {k}", k, "role",
            )  # fmt: skip
        if count < len(calls):
            raise _err(
                f"{len(calls)} tool calls but {count} results (one result per call)",
                f"message {i}", i, "tool_calls",
            )  # fmt: skip
        ids = [c.get("id") for c in calls if isinstance(c, Mapping)]
        answered: set = set()
        for k in range(i + 1, results):
            given = messages[k].get("tool_call_id")
            if given is None:
                continue
            if not isinstance(given, str) or given not in ids:
                known = ", ".join(repr(x) for x in ids if x is not None) or "none"
                raise _err(
                    f"tool_call_id {given!r} matches no tool call of message {i} (ids: {known})",
                    f"message {k}", k, "tool_call_id",
                )  # fmt: skip
            if given in answered:
                raise _err(
                    f"tool_call_id {given!r} is answered twice", f"message {k}", k, "tool_call_id"
                )
            answered.add(given)


def validate_tools(tools: Any) -> list[dict]:
    """Check function tool definitions (OpenAI form, or a bare function); returns them.

    Raises RenderError with `field` naming the bad part (``tools[1].function.parameters``).
    """
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise RenderError("tools must be a list of tool definitions", field="tools", where="tools")
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"

        def bad(reason: str, field: str = "", at: str = at) -> RenderError:
            return RenderError(reason, field=at + field, where="tools")

        if not isinstance(tool, Mapping):
            raise bad(f"a tool must be an object, got {type(tool).__name__}")
        kind = tool.get("type")
        if kind is not None and kind != "function":
            raise bad(f"unknown tool type {kind!r} (only 'function' tools exist)", ".type")
        function, field = tool, ""
        if kind is not None or "function" in tool:
            function, field = tool.get("function"), ".function"
            if not isinstance(function, Mapping):
                raise bad("'function' must be an object with a name", field)
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise bad("the function name must be a non-empty string", field + ".name")
        if _unreadable_in_markup(name):
            raise bad(f"the function name {name!r} {_MARKUP}", field + ".name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad("the description must be a string", field + ".description")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad(
                f"parameters must be a JSON Schema object, got {type(parameters).__name__}",
                field + ".parameters",
            )
        properties = (parameters or {}).get("properties")
        for key in properties if isinstance(properties, Mapping) else ():
            if isinstance(key, str) and _unreadable_in_markup(key):
                raise bad(f"the parameter name {key!r} {_MARKUP}", field + ".parameters.properties")
    return list(tools)


# A call's markup is `<function=NAME>` and `<parameter=KEY>`; engine/turn.py reads the names
# back with this pattern, so a name outside it (empty, or holding '>' or a line break, which
# would end the tag early) could never be called.
MARKUP_NAME = r"[^>\n]+"
_MARKUP = "must be non-empty, without '>' or a line break (Qwen3.5 writes calls as <function=NAME>)"


def _unreadable_in_markup(name: str) -> bool:
    return re.fullmatch(MARKUP_NAME, name) is None
