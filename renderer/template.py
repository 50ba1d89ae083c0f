"""The official Qwen3.5 / Qwen3.6 chat templates as plain Python.

`render_parts` walks the messages exactly as the Jinja template does and returns the rendered
text cut into pieces (system block, one piece per message, generation prompt), so that the
window code can tokenize and cache each piece on its own. `render_messages` joins them.
Each piece also says where message text sits in it, so that the tokenizer can keep special
token strings in that text from becoming control tokens (role forgery).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .content import (
    UNDEFINED,
    VisionCounter,
    attr,
    data_text,
    is_iterable_sequence,
    render_content,
    to_text,
    tojson,
)
from .errors import RenderError
from .variants import Variant, generation_think, get_variant

TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is no "
    "function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>"
)
ASSISTANT_HEAD = "<|im_start|>assistant\n"

Spans = tuple[tuple[int, int], ...]


@dataclass
class RenderedParts:
    """A rendered prompt cut at the places the engine cares about.

    ``header + "".join(messages) + generation_head + generation_think`` is the full text.
    ``messages[i]`` is the text message i contributes ('' for a leading system message, whose
    text lives in `header`).

    `header_spans` and `message_spans[i]` are the (start, end) offsets, in that piece, of
    message text: every message's content (image and video placeholders excepted), the
    assistant's reasoning, tool definitions, tool-call names and arguments. The rest is the
    template's own markup.
    """

    header: str
    messages: list[str]
    generation_head: str
    generation_think: str
    header_spans: Spans = ()
    message_spans: list[Spans] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.header + "".join(self.messages) + self.generation_head + self.generation_think


class _Piece:
    """One piece of the prompt being built, remembering where message text sits in it."""

    __slots__ = ("parts", "spans", "size")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self.size = 0

    def markup(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)

    def text(self, text: str, marks: Sequence[tuple[int, int]] = ()) -> None:
        """Message text; `marks` (offsets in `text`) are placeholders, markup within it."""
        pos = 0
        for start, end in [*marks, (len(text), len(text))]:
            if start > pos:
                a, b = self.size + pos, self.size + start
                if self.spans and self.spans[-1][1] == a:  # adjacent: one span
                    a = self.spans.pop()[0]
                self.spans.append((a, b))
            pos = end
        self.markup(text)

    def result(self) -> tuple[str, Spans]:
        return "".join(self.parts), tuple(self.spans)


Marks = list[tuple[int, int]]  # placeholders (markup) inside a message text


def _cut(text: str, marks: Marks, start: int, end: int) -> tuple[str, Marks]:
    """text[start:end] and the marks within it."""
    return text[start:end], [(a - start, b - start) for a, b in marks if start <= a and b <= end]


def _strip(
    text: str, marks: Marks, chars: str | None = None, left: bool = True, right: bool = True
) -> tuple[str, Marks]:
    """str.strip / lstrip / rstrip, keeping the marks (placeholders are never stripped)."""
    start = len(text) - len(text.lstrip(chars)) if left else 0
    end = len(text.rstrip(chars)) if right else len(text)
    return _cut(text, marks, start, max(start, end))


def _content(
    message: Any,
    index: int,
    *,
    counter: VisionCounter | None = None,
    add_vision_id: bool = False,
    is_system: bool = False,
) -> tuple[str, Marks]:
    """The message's content as the template prints it (trimmed), and its placeholders."""
    marks: Marks = []
    raw = render_content(
        attr(message, "content"), index, counter=counter, add_vision_id=add_vision_id,
        is_system=is_system, marks=marks,
    )  # fmt: skip
    return _strip(raw, marks)


def _reasoning_field(message: Mapping) -> Any:
    # transformers (render_jinja_template) aliases `thinking` and `reasoning` to
    # `reasoning_content` before the template sees the message: the first one that is not None.
    for key in ("reasoning_content", "thinking", "reasoning"):
        value = message.get(key)
        if value is not None:
            return value
    return UNDEFINED


def _tool_schemas(tools: Any) -> list:
    # render_jinja_template accepts JSON-schema dicts (or functions, which it converts; we do not).
    if tools is None:
        return []
    schemas = []
    try:
        items = list(tools)
    except TypeError:
        raise RenderError("tools must be a list of JSON schema dicts", field="tools") from None
    for i, tool in enumerate(items):
        if not isinstance(tool, Mapping):
            raise RenderError(
                f"tools[{i}] is a {type(tool).__name__}, not a JSON schema dict", field="tools"
            )
        schemas.append(tool)
    return schemas


def _header(messages: Sequence, schemas: list, add_vision_id: bool) -> _Piece:
    first = messages[0]
    has_system = attr(first, "role") == "system"
    piece = _Piece()
    if schemas:
        piece.markup("<|im_start|>system\n" + TOOLS_PREAMBLE)
        for tool in schemas:
            piece.markup("\n")
            piece.text(tojson(tool, field="tools"))
        piece.markup(TOOLS_INSTRUCTIONS)
        if has_system:
            content, marks = _content(first, 0, is_system=True, add_vision_id=add_vision_id)
            if content:
                piece.markup("\n\n")
                piece.text(content, marks)
        piece.markup("<|im_end|>\n")
    elif has_system:
        content, marks = _content(first, 0, is_system=True, add_vision_id=add_vision_id)
        piece.markup("<|im_start|>system\n")
        piece.text(content, marks)
        piece.markup("<|im_end|>\n")
    return piece


def _last_query_index(messages: Sequence, add_vision_id: bool) -> int:
    # The last user message that is not itself a wrapped tool response.
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if attr(message, "role") == "user":
            content = render_content(
                attr(message, "content"), index, add_vision_id=add_vision_id
            ).strip()
            if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
                return index
    raise RenderError("No user query found in messages.")


def _tool_calls(message: Mapping, content: str, index: int, spec: Variant, out: _Piece) -> None:
    calls = attr(message, "tool_calls")
    # A mapping (or an empty list) is silently ignored by the template.
    if not calls or not is_iterable_sequence(calls):
        return
    for j, call in enumerate(calls):
        function = attr(call, "function")
        if function is not UNDEFINED:
            call = function
        name = attr(call, "name")
        if not isinstance(name, str):
            # `'<function=' + name`: Undefined or a non-string makes Jinja raise.
            raise RenderError(
                f"tool call name must be a string, got {type(name).__name__}",
                index=index,
                field=f"tool_calls[{j}].function.name",
            )
        if j == 0:
            out.markup(
                "\n\n<tool_call>\n<function=" if content.strip() else "<tool_call>\n<function="
            )
        else:
            out.markup("\n<tool_call>\n<function=")
        out.text(name)
        out.markup(">\n")
        arguments = attr(call, "arguments")
        if arguments is not UNDEFINED:
            if not isinstance(arguments, Mapping):
                # Jinja's `items` filter only takes mappings: a JSON string raises.
                raise RenderError(
                    f"tool call arguments must be a mapping, got {type(arguments).__name__}",
                    index=index,
                    field=f"tool_calls[{j}].function.arguments",
                )
            for key, value in arguments.items():
                if not isinstance(key, str):
                    raise RenderError(
                        f"argument name {key!r} is not a string",
                        index=index,
                        field=f"tool_calls[{j}].function.arguments",
                    )
                out.markup("<parameter=")
                out.text(key)
                out.markup(">\n")
                out.text(_argument_text(value, spec, index, j, key))
                out.markup("\n</parameter>\n")
        out.markup("</function>\n</tool_call>")


def _argument_text(value: Any, spec: Variant, index: int, j: int, key: str) -> str:
    field = f"tool_calls[{j}].function.arguments.{key}"
    if isinstance(value, str):
        return value
    if spec.args_tojson_scalars:
        # qwen3.6: everything but strings goes through tojson (true, null, 1.5, ...)
        return tojson(value, index, field)
    # qwen3.5: mappings and non-string sequences through tojson, scalars through str()
    # (True -> "True", None -> "None").
    if isinstance(value, (Mapping, list, tuple)):
        return tojson(value, index, field)
    return data_text(value, index, field)


def _assistant(
    message: Mapping, content: str, marks: Marks, index: int, with_think: bool, spec: Variant
) -> _Piece:
    reasoning, reasoning_marks = _reasoning_field(message), []
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            # The template's cuts: content.split("</think>")[0].rstrip("\n")
            # .split("<think>")[-1].lstrip("\n") and content.split("</think>")[-1].lstrip("\n").
            head = _cut(content, marks, 0, content.index("</think>"))
            head = _strip(*head, "\n", left=False)
            opened = head[0].rfind("<think>")
            head = _cut(*head, opened + len("<think>") if opened >= 0 else 0, len(head[0]))
            reasoning, reasoning_marks = _strip(*head, "\n", right=False)
            tail = _cut(content, marks, content.rindex("</think>") + len("</think>"), len(content))
            content, marks = _strip(*tail, "\n", right=False)
    reasoning, reasoning_marks = _strip(reasoning, reasoning_marks)
    piece = _Piece()
    piece.markup(ASSISTANT_HEAD)
    if with_think:
        piece.markup("<think>\n")
        piece.text(reasoning, reasoning_marks)
        piece.markup("\n</think>\n\n")
    piece.text(content, marks)
    _tool_calls(message, content, index, spec, piece)
    piece.markup("<|im_end|>\n")
    return piece


def render_parts(
    messages: Sequence[Mapping],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping] | None = None,
    preserve_thinking: bool | None = None,
    variant: str = "qwen3.5",
    add_vision_id: bool = False,
) -> RenderedParts:
    """Render like the official template, returning the text in pieces (see RenderedParts)."""
    spec = get_variant(variant)
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise RenderError("messages must be a list of message dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RenderError(f"a message must be a dict, got {type(message).__name__}", index=i)
    if not messages:
        raise RenderError("No messages provided.")
    schemas = _tool_schemas(tools)
    header = _header(messages, schemas, add_vision_id)
    last_query = _last_query_index(messages, add_vision_id)
    keep_all_thinking = spec.preserve_thinking and preserve_thinking is True
    counter = VisionCounter()
    last = len(messages) - 1
    texts: list[str] = []
    spans: list[Spans] = []
    for i, message in enumerate(messages):
        content, marks = _content(message, i, counter=counter, add_vision_id=add_vision_id)
        role = attr(message, "role")
        piece = _Piece()
        if role == "system":
            if i != 0:
                raise RenderError("System message must be at the beginning.", index=i, field="role")
        elif role == "user":
            piece.markup("<|im_start|>user\n")
            piece.text(content, marks)
            piece.markup("<|im_end|>\n")
        elif role == "assistant":
            with_think = keep_all_thinking or i > last_query
            piece = _assistant(message, content, marks, i, with_think, spec)
        elif role == "tool":
            # Consecutive tool results share one user turn. `loop.previtem` is falsy for the
            # first message (and for an empty dict), so a leading tool message gets no header.
            prev = messages[i - 1] if i > 0 else None
            opens = bool(prev) and attr(prev, "role") != "tool"
            closes = i == last or attr(messages[i + 1], "role") != "tool"
            piece.markup(("<|im_start|>user" if opens else "") + "\n<tool_response>\n")
            piece.text(content, marks)
            piece.markup("\n</tool_response>" + ("<|im_end|>\n" if closes else ""))
        else:
            raise RenderError(f"Unexpected message role {to_text(role)!r}.", index=i, field="role")
        text, where = piece.result()
        texts.append(text)
        spans.append(where)
    head, head_spans = header.result()
    if add_generation_prompt:
        think = generation_think(spec, enable_thinking)
        return RenderedParts(head, texts, ASSISTANT_HEAD, think, head_spans, spans)
    return RenderedParts(head, texts, "", "", head_spans, spans)


def render_messages(
    messages: Sequence[Mapping],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping] | None = None,
    preserve_thinking: bool | None = None,
    variant: str = "qwen3.5",
    add_vision_id: bool = False,
) -> str:
    """Render `messages` to the prompt text, byte-identical to the official `variant` template.

    Raises RenderError (a ValueError) on every input the template raises on, naming the
    message index and the reason. `preserve_thinking` only matters for "qwen3.6".
    """
    return render_parts(
        messages,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        tools=tools,
        preserve_thinking=preserve_thinking,
        variant=variant,
        add_vision_id=add_vision_id,
    ).text
