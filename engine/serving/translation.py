"""What the other APIs (/v1/messages, /v1/responses, /v1/completions) share: each translates
its request into a chat-completions body, so one parser, one renderer and one pool serve them
all, and translates errors back so that they name the field as the client wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .completion import ApiError, ChatRequest, parse_request

_MESSAGE = re.compile(r"messages\[(\d+)\]")
# A parameter's name in an error message: a word, then any [index] or .field parts.
_NAME = re.compile(r"[A-Za-z_]\w*(?:\[\d+\]|\.[A-Za-z_]\w*)*")
_QUOTES = "'\"`"


def bad(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def text_of(content: Any, param: str, kinds: Sequence[str]) -> str:
    """A string, or a list of text parts of the given `kinds` ({"type": k, "text": ...}),
    joined; ApiError(400) naming `param` for anything else (images, files)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{param}' must be a string or a list of text parts", param, "invalid_type")
    texts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise bad(f"'{where}' must be an object", where, "invalid_type")
        if part.get("type") not in kinds:
            raise bad(f"'{where}.type' must be one of {', '.join(kinds)} (only text is "
                      f"supported), got {part.get('type')!r}", f"{where}.type", "unsupported")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise bad(f"'{where}.text' must be a string", f"{where}.text", "invalid_type")
        texts.append(part["text"])
    return "".join(texts)


class Origins:
    """Where each translated chat message came from in the client's request, and how the
    chat body's top-level fields are called in the client's API, for error messages."""

    def __init__(self, fields: Mapping[str, str] | None = None):
        self.messages: list[str] = []  # e.g. "messages[2]" or "input[5]", per chat message
        self.fields = dict(fields or {})  # chat-body prefix -> the client's name

    def rename(self, param: str | None) -> str | None:
        if param is None:
            return None
        m = _MESSAGE.match(param)
        if m:
            i = int(m.group(1))
            if i < len(self.messages):
                rest = param[m.end() :]
                return self.messages[i] + (".content" if rest.startswith(".content") else "")
            param = "messages"  # (a message the translation did not make): the whole list
        for old in sorted(self.fields, key=len, reverse=True):
            if param == old or param.startswith(old):
                return self.fields[old] + param[len(old) :]
        return param

    def error(self, e: ApiError) -> ApiError:
        """`e` with its param (and the param in its message) as the client calls it."""
        param = self.rename(e.param)
        message = e.message
        if e.param and param != e.param:
            message = _renamed(message, e.param, param)
        return ApiError(e.status, message, param=param, code=e.code, type=e.type)


def _renamed(message: str, old: str, new: str) -> str:
    """`message` with the parameter `old` called `new` where it names it: as a whole name
    (`messages[3]` but not the start of `messages[3].role`, another parameter). A plain word
    (`messages`) names the parameter only quoted or opening the message: elsewhere it is
    prose ("the messages take 9000 tokens")."""
    word = old.isalpha()

    def one(m: re.Match) -> str:
        start, end = m.span()
        if m.group() != old:
            return m.group()
        quoted = (
            start > 0
            and message[start - 1] in _QUOTES
            and message[end : end + 1] == message[start - 1]
        )
        return new if not word or start == 0 or quoted else old

    return _NAME.sub(one, message)


def chat_request(body: dict, defaults: Mapping | None, origins: Origins) -> ChatRequest:
    """`parse_request` of a translated chat body; its errors name the client's fields."""
    try:
        return parse_request(body, defaults)
    except ApiError as e:
        raise origins.error(e) from None


SAMPLING_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty",
)  # fmt: skip


def sampling_fields(body: Mapping) -> dict:
    """The fields every API passes through to the chat body unchanged."""
    return {k: body[k] for k in SAMPLING_FIELDS if k in body}
