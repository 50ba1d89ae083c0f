"""Anthropic's Messages API (`POST /v1/messages`), translated onto the chat engine.

`translate` turns the request into a chat-completions body (system, text, `tool_use` and
`tool_result` blocks, `tools`, `thinking`, `stop_sequences`), so it renders to the same prompt
ids as the same conversation sent to /v1/chat/completions and reuses the same pool sequences.
`message` and `stream` turn the engine's Turn and events back into Anthropic's shapes.
Usage follows Anthropic: `input_tokens` are the prompt tokens computed for this request,
`cache_read_input_tokens` those restored from the cache (their sum is the prompt).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..turn import Turn
from .completion import ApiError, ChatRequest
from .translation import Origins, bad, chat_request, sampling_fields, text_of

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip


def error_body(e: ApiError) -> dict:
    """An ApiError in Anthropic's error shape, which has no param: the message names it."""
    message = e.message
    if e.param and e.param not in message:
        message = f"{e.param}: {message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"),
                                       "message": message}}  # fmt: skip


@dataclass
class MessagesRequest:
    chat: ChatRequest
    stop_sequences: list[str]
    origins: Origins  # for errors found later (rendering), named as the client wrote them


def _blocks(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise bad(f"'{param}' must be a string or a non-empty list of content blocks", param,
                  "invalid_type")  # fmt: skip
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"'{param}[{i}]' must be a content block with a 'type'", f"{param}[{i}]",
                      "invalid_type")  # fmt: skip
    return content


def _user(blocks: list[dict], param: str, out: list[dict], origins: Origins) -> None:
    """A user turn: its tool results become tool messages, its text one user message after."""
    texts = []
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        kind = block["type"]
        if kind == "text":
            texts.append(text_of([block], param, ("text",)))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"'{where}.tool_use_id' must be a string", f"{where}.tool_use_id",
                          "invalid_type")  # fmt: skip
            result = block.get("content", "")
            result = text_of(result, f"{where}.content", ("text",))
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            origins.messages.append(where)
        else:
            raise bad(f"'{where}.type' {kind!r} is not supported in a user message (text, "
                      "tool_result)", f"{where}.type", "unsupported")  # fmt: skip
    if texts or not any(b["type"] == "tool_result" for b in blocks):
        out.append({"role": "user", "content": "\n".join(texts)})
        origins.messages.append(param)


def _join_user_turns(messages: list[dict], origins: Origins) -> None:
    """Consecutive user messages become one, as Anthropic combines consecutive turns of a role
    (their texts joined by newlines, as the text blocks of one message are)."""
    i = 1
    while i < len(messages):
        a, b = messages[i - 1], messages[i]
        if a["role"] == b["role"] == "user":
            a["content"] = f"{a['content']}\n{b['content']}"
            del messages[i], origins.messages[i]
        else:
            i += 1


def _assistant(blocks: list[dict], param: str) -> dict:
    texts, thinking, calls = [], [], []
    for i, block in enumerate(blocks):
        where, kind = f"{param}[{i}]", block["type"]
        if kind == "text":
            texts.append(text_of([block], param, ("text",)))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad(f"'{where}.thinking' must be a string", f"{where}.thinking",
                          "invalid_type")  # fmt: skip
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque: nothing the template could render
        elif kind == "tool_use":
            for key, kinds in (("id", str), ("name", str), ("input", dict)):
                if not isinstance(block.get(key), kinds):
                    what = "an object" if kinds is dict else "a string"
                    raise bad(f"'{where}.{key}' must be {what}", f"{where}.{key}", "invalid_type")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})  # fmt: skip
        else:
            raise bad(f"'{where}.type' {kind!r} is not supported in an assistant message "
                      "(text, thinking, tool_use)", f"{where}.type", "unsupported")  # fmt: skip
    message: dict = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of tools", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"'tools[{i}]' must be an object", f"tools[{i}]", "invalid_type")
        if tool.get("type") not in (None, "custom"):
            raise bad(f"'tools[{i}].type' {tool.get('type')!r} is not supported (client tools "
                      "only)", f"tools[{i}].type", "unsupported")  # fmt: skip
        # Key order as OpenAI's (name, description, parameters): the template prints the JSON.
        function = {"name": tool.get("name")}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema")
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> object:
    """Anthropic's tool_choice as the chat request's: `any` forces a call to one of the tools
    (OpenAI's "required"), `tool` a call to the named one (constrained decoding)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad("'tool_choice.name' must be a string", "tool_choice.name", "invalid_type")
        return {"type": "function", "function": {"name": name}}
    raise bad("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", "tool_choice.type",
              "unsupported_value")  # fmt: skip


def _not(flag: Any, param: str) -> bool:
    if not isinstance(flag, bool):
        raise bad(f"'{param}' must be a boolean", param, "invalid_type")
    return not flag


def _thinking(value: Any) -> bool | None:
    if value is None:
        return None  # the model's own default, as on /v1/chat/completions
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad("'thinking.type' must be 'enabled', 'adaptive' or 'disabled'", "thinking.type")
    return kind != "disabled"


_FIELDS = {
    "max_tokens": "max_tokens", "stop": "stop_sequences", "tools": "tools",
    "tool_choice.function": "tool_choice", "tool_choice": "tool_choice",
    "chat_template_kwargs.enable_thinking": "thinking",
}  # fmt: skip
_TOOL_FIELDS = {".function.parameters": ".input_schema", ".function": ""}


class _Origins(Origins):
    def rename(self, param: str | None) -> str | None:
        param = super().rename(param)
        if param and param.startswith("tools["):
            for old, new in _TOOL_FIELDS.items():
                param = param.replace(old, new)
        return param


def translate(body: Any, defaults: Mapping | None = None, *, counting: bool = False
              ) -> MessagesRequest:  # fmt: skip
    """A Messages request to the engine's chat request; ApiError(400) naming the field.
    `counting`: a `/v1/messages/count_tokens` body, which has no `max_tokens` (nor a need to
    fit one: the prompt is what counts)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    origins = _Origins(_FIELDS)
    if body.get("mcp_servers"):
        raise bad("'mcp_servers' is not supported: the server runs no tools (send client tools "
                  "in 'tools')", "mcp_servers", "unsupported")  # fmt: skip
    max_tokens = 1 if counting else body.get("max_tokens")
    if max_tokens is None:
        raise bad("'max_tokens' is required", "max_tokens", "missing")
    messages: list[dict] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": text_of(system, "system", ("text",))})
        origins.messages.append("system")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    for i, m in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"'{where}.role' must be 'user' or 'assistant'", f"{where}.role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if m["role"] == "user":
            _user(blocks, f"{where}.content", messages, origins)
        else:
            messages.append(_assistant(blocks, f"{where}.content"))
            origins.messages.append(where)
    if given[-1]["role"] == "assistant":
        last = f"messages[{len(given) - 1}]"
        raise bad(f"'{last}': the last message must be the user's (a final assistant message, "
                  "to prefill the answer, is not supported)", f"{last}.role", "unsupported")  # fmt: skip
    _join_user_turns(messages, origins)
    chat: dict = {"messages": messages, "max_tokens": max_tokens, **sampling_fields(body)}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        if isinstance(choice, dict) and "disable_parallel_tool_use" in choice:
            chat["parallel_tool_calls"] = _not(choice["disable_parallel_tool_use"],
                                               "tool_choice.disable_parallel_tool_use")  # fmt: skip
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list):
            raise bad(
                "'stop_sequences' must be a list of strings", "stop_sequences", "invalid_type"
            )
        chat["stop"] = stop
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    return MessagesRequest(chat_request(chat, defaults, origins), list(stop or []), origins)


# ----- the answer ---------------------------------------------------------------------------


def stop_reason(turn: Turn, stop_sequences: list[str], decode: Callable[[list[int]], str]):
    """(stop_reason, stop_sequence) of a turn in Anthropic's terms."""
    if turn.tool_calls:
        return "tool_use", None
    if turn.finish_reason == "length":
        return "max_tokens", None
    if stop_sequences:
        # Generation ends at the first stop string in the generated text, so the one found
        # earliest in it is the one that matched (an end-of-turn token leaves none).
        text = decode(turn.token_ids)
        found = [(text.find(s), s) for s in stop_sequences if s in text]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def usage(prompt_tokens: int, reused: int, output_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens - reused, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": reused, "output_tokens": output_tokens,
    }  # fmt: skip


def _tool_uses(turn: Turn) -> list[dict]:
    return [
        {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c.name,
         "input": c.arguments}
        for c in turn.tool_calls
    ]  # fmt: skip


def message(turn: Turn, request: MessagesRequest, ident: str, model: str,
            decode: Callable[[list[int]], str]) -> dict:  # fmt: skip
    """The non-streamed answer: thinking, text and tool_use blocks, stop reason, usage."""
    content: list[dict] = []
    if turn.reasoning:
        content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.text or not turn.tool_calls:
        content.append({"type": "text", "text": turn.text})
    content += _tool_uses(turn)
    reason, sequence = stop_reason(turn, request.stop_sequences, decode)
    s = turn.stats
    return {
        "id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence,
        "usage": usage(s.prompt_tokens, s.reused_tokens, s.generated_tokens),
    }  # fmt: skip


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def stream(events: AsyncIterator[tuple], request: MessagesRequest, ident: str, model: str,
                 prompt_tokens: int, decode: Callable[[list[int]], str]) -> AsyncIterator[str]:  # fmt: skip
    """Anthropic's event sequence for the engine's events (the first one is ("first", reused)).

    The blocks are those `message` returns: thinking, then text, then tool_use (whose input
    is known once the answer is complete, so it comes as one input_json_delta)."""
    index, open_kind = -1, None

    def start(kind: str, block: dict) -> str:
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        return _sse("content_block_start", {"index": index, "content_block": block})

    def stop() -> str:
        nonlocal open_kind
        open_kind = None
        return _sse("content_block_stop", {"index": index})

    async for event in events:
        if event[0] == "first":
            head = {
                "id": ident, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(prompt_tokens, event[1], 0),
            }  # fmt: skip
            yield _sse("message_start", {"message": head})
        elif event[0] == "delta":
            _, reasoning, content, _raw = event
            for kind, text, block, delta in (
                ("thinking", reasoning, {"type": "thinking", "thinking": "", "signature": ""},
                 {"type": "thinking_delta", "thinking": reasoning}),
                ("text", content, {"type": "text", "text": ""},
                 {"type": "text_delta", "text": content}),
            ):  # fmt: skip
                if not text:
                    continue
                if open_kind != kind:
                    if open_kind is not None:
                        yield stop()
                    yield start(kind, block)
                yield _sse("content_block_delta", {"index": index, "delta": delta})
        elif event[0] == "error":
            yield _sse("error", {"error": error_body(event[1])["error"]})
            return
        elif event[0] == "done":
            turn: Turn = event[1]
            if open_kind == "thinking" and not turn.text and not turn.tool_calls:
                yield stop()
            if open_kind is None and not turn.text and not turn.tool_calls:
                yield start("text", {"type": "text", "text": ""})
            if open_kind is not None:
                yield stop()
            for block in _tool_uses(turn):
                yield start("tool_use", {**block, "input": {}})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield _sse("content_block_delta", {"index": index, "delta": delta})
                yield stop()
            reason, sequence = stop_reason(turn, request.stop_sequences, decode)
            s = turn.stats
            yield _sse("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(s.prompt_tokens, s.reused_tokens, s.generated_tokens),
            })  # fmt: skip
            yield _sse("message_stop", {})
            return
