"""The official Qwen3.5 / Qwen3.6 chat template variants and how they differ."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """What distinguishes one official template from the others."""

    name: str
    thinking_default: bool  # generation prompt opens a think block unless told otherwise
    preserve_thinking: bool  # reads the `preserve_thinking` flag (qwen3.6 only)
    args_tojson_scalars: bool  # non-string scalar tool arguments go through tojson (qwen3.6)
    template: str  # file name under engine/templates/


VARIANTS: dict[str, Variant] = {
    "qwen3.5-small": Variant("qwen3.5-small", False, False, False, "qwen3.5-small.jinja"),
    "qwen3.5": Variant("qwen3.5", True, False, False, "qwen3.5.jinja"),
    "qwen3.6": Variant("qwen3.6", True, True, True, "qwen3.6.jinja"),
}


def get_variant(variant: str) -> Variant:
    """Look a variant up by name; unknown names are a caller bug, hence a plain ValueError."""
    try:
        return VARIANTS[variant]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown template variant {variant!r}; known: {sorted(VARIANTS)}"
        ) from None


THINK_OPEN = "<think>\n"
THINK_EMPTY = "<think>\n\n</think>\n\n"


def generation_think(spec: Variant, enable_thinking: object) -> str:
    """The text after ``<|im_start|>assistant\\n`` of the generation prompt.

    The templates test ``enable_thinking is true/false`` (identity with the booleans), so
    ``None``, ``0`` or ``1`` fall back to the variant's default.
    """
    if spec.thinking_default:
        return THINK_EMPTY if enable_thinking is False else THINK_OPEN
    return THINK_OPEN if enable_thinking is True else THINK_EMPTY
