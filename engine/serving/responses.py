"""OpenAI's Responses API (`POST /v1/responses`), translated onto the chat engine.

`translate` turns `instructions` and `input` (a string, or message, `function_call`,
`function_call_output` and `reasoning` items) into chat messages, after the conversation of
`previous_response_id` when one is given: the server keeps recent conversations in a bounded
`ResponseStore`, so a client may send only the new input. Either way the prompt is the whole
conversation's ids, and reuse comes from the pool as for chat. `response` and `stream` turn
the engine's Turn and events back into Responses objects and events.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from renderer.validation import loads_json

from ..turn import Turn
from .completion import ApiError, ChatRequest
from .translation import Origins, bad, chat_request, sampling_fields, text_of

KEPT_RESPONSES = 256  # conversations kept for previous_response_id (the oldest go first)
_TEXT = ("input_text", "output_text", "text")


class ResponseStore:
    """The last `size` responses' conversations (chat messages, without instructions), by id;
    thread-safe (requests are translated on worker threads)."""

    def __init__(self, size: int = KEPT_RESPONSES):
        self.size = size
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ident: str) -> list[dict] | None:
        with self._lock:
            messages = self._items.get(ident)
            if messages is not None:
                self._items.move_to_end(ident)
            return messages

    def put(self, ident: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[ident] = messages
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class ResponsesRequest:
    chat: ChatRequest
    history: list[dict]  # the conversation without the system message (what is stored)
    store: bool
    origins: Origins  # for errors found later (rendering), named as the client wrote them
    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    think_end: int | None = None  # the `</think>` token's id: where reasoning_tokens end


def _input_items(value: Any, origins: Origins) -> list[dict]:
    """The input as chat messages (no system message: see `translate`)."""
    if isinstance(value, str):
        origins.messages.append("input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("'input' must be a string or a list of items", "input", "invalid_type")
    if not value:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    reasoning: list[str] = []  # reasoning items attach to the assistant message that follows
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an object", where, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"'{where}.role' must be user, assistant, system or developer",
                          f"{where}.role")  # fmt: skip
            text = text_of(item.get("content"), f"{where}.content", _TEXT)
            message = {"role": "system" if role == "developer" else role, "content": text}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "\n".join(reasoning), []
            out.append(message)
            origins.messages.append(where)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad(f"'{where}.{key}' must be a string", f"{where}.{key}",
                              "invalid_type")  # fmt: skip
            try:
                arguments = loads_json(item["arguments"]) if item["arguments"].strip() else {}
            except ValueError as e:
                raise bad(f"'{where}.arguments' is not valid JSON: {e}", f"{where}.arguments",
                          "invalid_json") from None  # fmt: skip
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": arguments}}  # fmt: skip
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning_content"], reasoning = "\n".join(reasoning), []
                out.append(last)
                origins.messages.append(where)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"'{where}.call_id' must be a string", f"{where}.call_id",
                          "invalid_type")  # fmt: skip
            output = text_of(item.get("output"), f"{where}.output", _TEXT)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            origins.messages.append(where)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            kinds = ("reasoning_text", "summary_text")
            key = "content" if item.get("content") else "summary"
            reasoning.append(text_of(parts, f"{where}.{key}", kinds))
        else:
            raise bad(f"'{where}.type' {kind!r} is not supported (message, function_call, "
                      "function_call_output, reasoning)", f"{where}.type", "unsupported")  # fmt: skip
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of tools", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"'tools[{i}].type' must be 'function' (only function tools are "
                      "supported)", f"tools[{i}].type", "unsupported")  # fmt: skip
        # Key order as OpenAI's (name, description, parameters): the template prints the JSON.
        function = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {}
        out.append({"type": "function", "function": function})
    return out


def _thinking(reasoning: Any) -> bool | None:
    if reasoning is None:
        return None  # the model's own default, as on /v1/chat/completions
    if not isinstance(reasoning, dict):
        raise bad("'reasoning' must be an object", "reasoning", "invalid_type")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad(f"'reasoning.effort' {effort!r} is not one of none, minimal, low, medium, "
                  "high, xhigh", "reasoning.effort")  # fmt: skip
    return effort != "none"  # the template has one switch: think or not


_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "tools": "tools",
           "tool_choice.function": "tool_choice", "tool_choice": "tool_choice",
           "chat_template_kwargs.enable_thinking": "reasoning.effort"}  # fmt: skip


def _tool_choice(choice: Any) -> str | dict:
    """The Responses forms of `tool_choice` as the chat ones; ApiError(400) for the forms
    that have none here (allowed_tools, hosted tools)."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise bad("'tool_choice.name' must be a string", "tool_choice.name", "invalid_type")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
              "'name': ...} (allowed_tools and hosted tools are not supported)", "tool_choice",
              "unsupported_value")  # fmt: skip


class _Origins(Origins):
    def rename(self, param: str | None) -> str | None:
        param = super().rename(param)
        if param and param.startswith("tools["):
            param = param.replace(".function", "")
        return param


def translate(body: Any, store: ResponseStore, defaults: Mapping | None = None, *,
              think_end: int | None = None) -> ResponsesRequest:  # fmt: skip
    """A Responses request to the engine's chat request; ApiError(400) naming the field.
    `think_end`: the `</think>` token's id, to count the answer's reasoning tokens."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    origins = _Origins(_FIELDS)
    for name, why in (("background", "responses are answered while the request waits"),
                      ("conversation", "the server keeps no conversation objects: send the "
                                       "input, or previous_response_id"),
                      ("prompt", "the server keeps no prompt templates: send instructions")):  # fmt: skip
        if body.get(name) not in (None, False):
            raise bad(f"'{name}' is not supported: {why}", name, "unsupported")
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad("'previous_response_id' must be a string", "previous_response_id",
                      "invalid_type")  # fmt: skip
        kept = store.get(previous)
        if kept is None:
            raise bad(f"Previous response with id '{previous}' not found (the server keeps the "
                      f"last {store.size}).", "previous_response_id", "previous_response_not_found")  # fmt: skip
        history = [dict(m) for m in kept]
        origins.messages += ["previous_response_id"] * len(history)
    if "input" not in body:
        raise bad("'input' is required", "input", "missing")
    history += _input_items(body["input"], origins)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string", "instructions", "invalid_type")
    # System items at the start (and `instructions`, first) make the one system message.
    system = [instructions] if instructions else []
    while history and history[0]["role"] == "system":
        system.append(history.pop(0)["content"])
        origins.messages.pop(0)
    messages = history
    if system:
        messages = [{"role": "system", "content": "\n\n".join(system)}, *history]
        origins.messages.insert(0, "instructions")
    chat: dict = {"messages": messages, **sampling_fields(body)}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    thinking = _thinking(body.get("reasoning"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("only text.format {'type': 'text'} is supported", "text.format", "unsupported")
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise bad("'store' must be a boolean", "store", "invalid_type")
    request = chat_request(chat, defaults, origins)
    echo = {k: body.get(k) for k in ("instructions", "previous_response_id", "metadata",
                                     "max_output_tokens", "tool_choice", "tools")}  # fmt: skip
    return ResponsesRequest(request, history, store_it, origins, echo, think_end)


# ----- the answer ---------------------------------------------------------------------------


def _ident(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Output:
    """The output items of one answer, with their ids (shared by the stream and the store)."""

    reasoning: dict | None
    message: dict | None
    calls: list[dict]

    @property
    def items(self) -> list[dict]:
        return [i for i in (self.reasoning, self.message) if i is not None] + self.calls


def reasoning_item(text: str, ident: str | None = None) -> dict:
    return {"type": "reasoning", "id": ident or _ident("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}  # fmt: skip


def message_item(text: str, ident: str | None = None) -> dict:
    return {"type": "message", "id": ident or _ident("msg"), "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def output(turn: Turn, reasoning_id: str | None = None, message_id: str | None = None) -> Output:
    """Reasoning item if the model thought, message item if it said something (or nothing
    else), then one function_call item per tool call."""
    calls = [
        {"type": "function_call", "id": _ident("fc"), "call_id": f"call_{uuid.uuid4().hex[:24]}",
         "name": c.name, "arguments": json.dumps(c.arguments), "status": "completed"}
        for c in turn.tool_calls
    ]  # fmt: skip
    return Output(
        reasoning_item(turn.reasoning, reasoning_id) if turn.reasoning else None,
        message_item(turn.text, message_id) if turn.text or not calls else None,
        calls,
    )


def assistant_message(turn: Turn, out: Output) -> dict:
    """The answer as the chat message a client resending these items would produce."""
    message: dict = {"role": "assistant", "content": turn.text}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if out.calls:
        message["tool_calls"] = [
            {"id": c["call_id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
            for c in out.calls
        ]  # fmt: skip
    return message


def reasoning_tokens(turn: Turn, think_end: int | None) -> int:
    """The generated tokens of the think block, its `</think>` included (all of them if it
    never closed); 0 with thinking off."""
    if turn.reasoning is None or think_end is None:  # None: the prompt opened no think block
        return 0
    ids = turn.token_ids
    return ids.index(think_end) + 1 if think_end in ids else len(ids)


def usage(turn: Turn, think_end: int | None = None) -> dict:
    s = turn.stats
    details = {"reasoning_tokens": reasoning_tokens(turn, think_end)}
    return {
        "input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.reused_tokens},
        "output_tokens": s.generated_tokens, "output_tokens_details": details,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
    }  # fmt: skip


def response(request: ResponsesRequest, ident: str, created: int, model: str,
             turn: Turn | None = None, out: Output | None = None) -> dict:  # fmt: skip
    """The response object: in progress (no turn yet), or completed / incomplete."""
    body = {
        "id": ident, "object": "response", "created_at": created, "model": model,
        "status": "in_progress", "error": None, "incomplete_details": None, "output": [],
        "parallel_tool_calls": request.chat.parallel_tool_calls,
        "temperature": request.chat.params.temperature,
        "top_p": request.chat.params.top_p, "text": {"format": {"type": "text"}},
        "store": request.store, "usage": None, **request.echo,
    }  # fmt: skip
    body["tool_choice"] = body.get("tool_choice") or "auto"
    body["tools"] = body.get("tools") or []
    body["metadata"] = body.get("metadata") or {}
    if turn is not None:
        assert out is not None
        body["output"], body["usage"] = out.items, usage(turn, request.think_end)
        body["completed_at"] = int(time.time())
        if turn.finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
    return body


def remember(store: ResponseStore, request: ResponsesRequest, ident: str, turn: Turn,
             out: Output) -> None:  # fmt: skip
    if request.store:
        store.put(ident, [*request.history, assistant_message(turn, out)])


async def stream(events: AsyncIterator[tuple], request: ResponsesRequest, store: ResponseStore,
                 ident: str, created: int, model: str) -> AsyncIterator[str]:  # fmt: skip
    """The Responses event sequence for the engine's events: response.created, then each
    output item (added, its deltas, done), then response.completed (or .incomplete)."""
    seq = 0
    reasoning_id, message_id = _ident("rs"), _ident("msg")
    items: dict[str, int] = {}  # "reasoning" / "message" -> output_index
    texts = {"reasoning": "", "message": ""}

    def sse(kind: str, **data) -> str:
        nonlocal seq
        seq += 1
        body = {"type": kind, "sequence_number": seq - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def open_item(kind: str) -> list[str]:
        items[kind] = len(items)
        index, part_kind = items[kind], ("reasoning_text" if kind == "reasoning" else "output_text")
        item = (reasoning_item("", reasoning_id) if kind == "reasoning"
                else message_item("", message_id))  # fmt: skip
        item["status"], item["content"] = "in_progress", []
        part = {"type": part_kind, "text": ""}
        if kind == "message":
            part.update(annotations=[], logprobs=[])
        return [
            sse("response.output_item.added", output_index=index, item=item),
            sse("response.content_part.added", item_id=item["id"], output_index=index,
                content_index=0, part=part),
        ]  # fmt: skip

    def close_item(kind: str, item: dict) -> list[str]:
        index, part = items[kind], item["content"][0]
        done = (
            "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [
            sse(done, item_id=item["id"], output_index=index, content_index=0,
                text=part["text"], **extra),
            sse("response.content_part.done", item_id=item["id"], output_index=index,
                content_index=0, part=part),
            sse("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    async for event in events:
        if event[0] == "first":
            head = response(request, ident, created, model)
            yield sse("response.created", response=head)
            yield sse("response.in_progress", response=head)
        elif event[0] == "delta":
            _, reasoning, content, _raw = event
            for kind, text in (("reasoning", reasoning), ("message", content)):
                if not text:
                    continue
                if kind not in items:
                    for line in open_item(kind):
                        yield line
                texts[kind] += text
                name = ("response.reasoning_text.delta" if kind == "reasoning"
                        else "response.output_text.delta")  # fmt: skip
                extra = {} if kind == "reasoning" else {"logprobs": []}
                item_id = reasoning_id if kind == "reasoning" else message_id
                yield sse(name, item_id=item_id, output_index=items[kind], content_index=0,
                          delta=text, **extra)  # fmt: skip
        elif event[0] == "error":
            e: ApiError = event[1]
            yield sse("error", code=e.code, message=e.message, param=e.param)
            return
        elif event[0] == "done":
            turn: Turn = event[1]
            out = output(turn, reasoning_id, message_id)
            for kind, item in (("reasoning", out.reasoning), ("message", out.message)):
                if item is None:
                    continue
                if kind not in items:
                    for line in open_item(kind):
                        yield line
                for line in close_item(kind, item):
                    yield line
            for call in out.calls:
                index = len(items)
                items[call["id"]] = index
                yield sse("response.output_item.added", output_index=index,
                          item={**call, "arguments": "", "status": "in_progress"})  # fmt: skip
                yield sse("response.function_call_arguments.delta", item_id=call["id"],
                          output_index=index, delta=call["arguments"])  # fmt: skip
                yield sse("response.function_call_arguments.done", item_id=call["id"],
                          output_index=index, name=call["name"], arguments=call["arguments"])  # fmt: skip
                yield sse("response.output_item.done", output_index=index, item=call)
            remember(store, request, ident, turn, out)
            final = response(request, ident, created, model, turn, out)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield sse(kind, response=final)
            return
