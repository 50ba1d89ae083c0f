"""The few Jinja semantics the official template relies on, emulated in plain Python.

The template reads messages with Jinja attribute access (``item.text``), membership tests
(``'image' in item``), ``is string`` / ``is iterable`` / ``is mapping`` tests and the
transformers ``tojson`` filter. Matching those exactly (including on odd inputs such as a
string given as a content part) is what makes the output byte-identical.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .errors import RenderError

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


class _Undefined:
    """Jinja's Undefined: falsy, iterates as empty, renders as ''."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return "Undefined"


UNDEFINED: Any = _Undefined()


def attr(obj: Any, name: str) -> Any:
    """``obj.name`` as Jinja resolves it on JSON-like data: a mapping key, else Undefined.

    (Jinja tries a Python attribute first; no key the template reads is a method name of
    dict, list or str, so the key lookup is all that matters.)
    """
    if isinstance(obj, Mapping):
        return obj.get(name, UNDEFINED)
    return UNDEFINED


def contains(item: Any, key: str, index: int | None) -> bool:
    """``key in item``: a key test on mappings, a substring test on strings."""
    if isinstance(item, (str, list, tuple, Mapping)):
        return key in item
    raise RenderError(
        f"content part of type {type(item).__name__} is not a mapping", index=index, field="content"
    )


def to_text(value: Any) -> str:
    """``{{ value }}`` / ``value | string``: Python ``str`` except that Undefined renders ''."""
    if value is UNDEFINED:
        return ""
    return value if isinstance(value, str) else str(value)


_JSON_SCALARS = (str, int, float, type(None))  # bool is an int
_MAX_DEPTH = 1000  # Python's default recursion limit: json.dumps fails before it


def data_text(value: Any, index: int | None, field: str) -> str:
    """``{{ value }}`` of caller data (a text part's text, a qwen3.5 scalar argument).

    transformers hands the template JSON data only, with any other object replaced by a
    "<type>" placeholder string; like non-JSON content, such values are refused here
    (RenderError), never printed another way (``str(b"x")`` is "b'x'")."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (Mapping, list, tuple)):
            if depth >= _MAX_DEPTH:  # as deep as json.dumps goes (a container in itself too)
                raise RenderError("a value nested this deep is not JSON data", index=index,
                                  field=field)  # fmt: skip
            items = [*item.keys(), *item.values()] if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in items)
        elif not isinstance(item, _JSON_SCALARS) and item is not UNDEFINED:
            raise RenderError(f"a {type(item).__name__} is not JSON data", index=index, field=field)
    return to_text(value)


def tojson(value: Any, index: int | None = None, field: str | None = None) -> str:
    """transformers' ``tojson`` filter: ``json.dumps`` with ``ensure_ascii=False`` and defaults
    otherwise (separators ``', '`` and ``': '``, no indent, keys in insertion order)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise RenderError(
            f"value is not JSON serializable: {e}", index=index, field=field
        ) from None
    except RecursionError:  # the template's tojson raises it too
        raise RenderError(
            "value is nested too deeply to serialize as JSON", index=index, field=field
        ) from None


def is_iterable_sequence(value: Any) -> bool:
    """``value is iterable and value is not mapping`` (Undefined counts: it iterates as empty)."""
    if isinstance(value, Mapping):
        return False
    try:
        iter(value)
    except TypeError:
        return False
    return True


class VisionCounter:
    """The template's ``image_count`` / ``video_count`` namespaces (used by ``add_vision_id``)."""

    __slots__ = ("images", "videos")

    def __init__(self) -> None:
        self.images = 0
        self.videos = 0


def render_content(
    content: Any,
    index: int | None,
    *,
    counter: VisionCounter | None = None,
    add_vision_id: bool = False,
    is_system: bool = False,
    marks: list[tuple[int, int]] | None = None,
) -> str:
    """The template's ``render_content`` macro (not yet trimmed).

    `counter` is given where the template passes ``do_vision_count=true``. `marks`, if given,
    receives the (start, end) of each image/video placeholder in the result: template markup
    (control tokens) amid the message text.
    """
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if content is UNDEFINED or isinstance(content, (list, tuple)):
        out: list[str] = []
        for item in content:
            if (
                contains(item, "image", index)
                or contains(item, "image_url", index)
                or attr(item, "type") == "image"
            ):
                if is_system:
                    raise RenderError(
                        "System message cannot contain images.", index=index, field="content"
                    )
                if counter is not None:
                    counter.images += 1
                if add_vision_id:
                    out.append(f"Picture {counter.images if counter else 0}: ")
                _placeholder(out, IMAGE_PLACEHOLDER, marks)
            elif contains(item, "video", index) or attr(item, "type") == "video":
                if is_system:
                    raise RenderError(
                        "System message cannot contain videos.", index=index, field="content"
                    )
                if counter is not None:
                    counter.videos += 1
                if add_vision_id:
                    out.append(f"Video {counter.videos if counter else 0}: ")
                _placeholder(out, VIDEO_PLACEHOLDER, marks)
            elif contains(item, "text", index):
                out.append(data_text(attr(item, "text"), index, "content"))
            else:
                raise RenderError("Unexpected item type in content.", index=index, field="content")
        return "".join(out)
    # Mappings, numbers, booleans and other objects: the template raises. (transformers would
    # turn non-JSON objects into "<type>" placeholder strings first; we refuse them instead.)
    raise RenderError(
        f"Unexpected content type ({type(content).__name__}).", index=index, field="content"
    )


def _placeholder(out: list[str], text: str, marks: list[tuple[int, int]] | None) -> None:
    if marks is not None:
        start = sum(map(len, out))
        marks.append((start, start + len(text)))
    out.append(text)
