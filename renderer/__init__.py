"""ChatML prompt rendering for Qwen3.5 / Qwen3.6, byte-identical to the official templates.

- `render_messages`: the official chat template in plain Python (no Jinja at run time).
- `build_prompt`: the engine's chat window (last exchanges within a token budget), tokenized
  per segment with a cache, with the token boundaries the engine snapshots at.
"""

from .cache import SegmentCache
from .errors import PromptTooLong, RenderError
from .template import render_messages, render_parts
from .validation import split_conversation, validate_exchange, validate_messages
from .variants import VARIANTS, Variant
from .window import Boundaries, Prompt, build_prompt

__all__ = [
    "VARIANTS",
    "Boundaries",
    "Prompt",
    "PromptTooLong",
    "RenderError",
    "SegmentCache",
    "Variant",
    "build_prompt",
    "render_messages",
    "render_parts",
    "split_conversation",
    "validate_exchange",
    "validate_messages",
]
