"""The engine's chat window: the last exchanges that fit, tokenized per segment.

Segment texts do not depend on where an exchange sits in the window: the current user message
is always the template's last query, so every history answer renders without its think block
(unless qwen3.6 preserves thinking for all), and tool results are always followed by an
assistant message within their exchange. So each exchange's token count is computed once
(cached by text) and the window is chosen by summing counts, without re-rendering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cache import SegmentCache
from .errors import PromptTooLong, RenderError
from .template import ASSISTANT_HEAD, render_parts
from .validation import validate_exchange
from .variants import get_variant


@dataclass
class Boundaries:
    """Token positions in `Prompt.ids` where the engine may snapshot."""

    system_end: int  # right after the system block (0 if there is none)
    message_starts: list[int]  # where each of Prompt.messages starts (the system message: 0)
    # right after "<|im_start|>assistant\n" of each assistant message (history and current
    # tool-call steps), in order
    assistant_starts: list[int]
    # right after the generation prompt's "<|im_start|>assistant\n" (before its think prefix)
    generation_start: int | None

    def points(self) -> set[int]:
        """Every boundary position (0 excluded): where the engine takes snapshots."""
        out = {self.system_end, *self.message_starts, *self.assistant_starts}
        if self.generation_start is not None:
            out.add(self.generation_start)
        return out - {0}

    def resume_points(self, first: int) -> set[int]:
        """The system block's end (a turn that trims the window restarts there) and every
        boundary from position `first` on: where a later turn of the conversation resumes."""
        return {self.system_end} | {p for p in self.points() if p >= first}


@dataclass
class Prompt:
    """A rendered, tokenized prompt and what went into it."""

    text: str
    ids: list[int]
    messages: list[dict]  # the messages actually rendered (system first, if any)
    dropped: int  # how many oldest exchanges were left out
    boundaries: Boundaries


def _head_tokens(ids: Sequence[int], head: Sequence[int]) -> int:
    """How many tokens of `head` ("<|im_start|>assistant\\n") start `ids`.

    Normally all of them. If the answer begins with whitespace that the pre-tokenizer merges
    with the newline (e.g. "\\r\\n" left after a think block), the boundary is not a token
    boundary; the tokens that do match end at the last boundary before it.
    """
    n = 0
    for a, b in zip(ids, head, strict=False):
        if a != b:
            break
        n += 1
    return n


def build_prompt(
    encode: Callable[[str], list[int]],
    *,
    system: str | None,
    history: Sequence[Sequence[dict]],
    current: Sequence[dict],
    max_exchanges: int = 6,
    max_tokens: int | None = None,
    variant: str = "qwen3.5",
    enable_thinking: bool | None = None,
    tools: Sequence[dict] | None = None,
    preserve_thinking: bool | None = None,
    cache: SegmentCache | None = None,
    text_spans: bool = False,
) -> Prompt:
    """Render and tokenize the prompt for the next assistant turn.

    Keeps at most `max_exchanges` of the most recent complete exchanges in `history`, fewer if
    needed to fit `max_tokens`, dropping whole exchanges from the oldest. Raises
    PromptTooLong if the system block and `current` alone do not fit, RenderError on invalid
    input. `encode` must treat ChatML special tokens as special; `cache` should be reused
    across turns (one per tokenizer). With `text_spans`, `encode` is called as
    `encode(text, spans)` with the spans of message text in `text` (see RenderedParts), so that
    it can encode the special tokens written there as ordinary text.
    """
    get_variant(variant)
    if max_exchanges < 0:
        raise ValueError("max_exchanges must be >= 0")
    if system is not None and not isinstance(system, str):
        raise RenderError(
            f"system must be a string or None, got {type(system).__name__}", where="system"
        )
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence):
        raise RenderError("history must be a list of exchanges", where="history")
    exchanges = [validate_exchange(ex, where=f"history[{k}]") for k, ex in enumerate(history)]
    cur = validate_exchange(current, complete=False, where="current")
    cache = cache if cache is not None else SegmentCache()

    # Render the system, every candidate exchange and the current one in a single pass; the
    # pieces are valid for any suffix of the candidates (see the module docstring).
    candidates = exchanges[max(0, len(exchanges) - max_exchanges) :] if max_exchanges else []
    head = [{"role": "system", "content": system}] if system is not None else []
    flat = head + [m for ex in candidates for m in ex] + cur
    parts = render_parts(
        flat,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
        tools=tools,
        preserve_thinking=preserve_thinking,
        variant=variant,
    )

    def ids_of(text: str, spans: tuple = ()) -> tuple[int, ...]:
        return cache.encode(encode, text, spans if text_spans else None)

    seg_ids = [ids_of(t, s) for t, s in zip(parts.messages, parts.message_spans, strict=True)]
    header_ids = ids_of(parts.header, parts.header_spans)
    gen_head_ids = ids_of(parts.generation_head)
    think_ids = ids_of(parts.generation_think)

    # Token cost of each candidate exchange and of what must always fit.
    costs, pos = [], len(head)
    for ex in candidates:
        costs.append(sum(len(seg_ids[i]) for i in range(pos, pos + len(ex))))
        pos += len(ex)
    current_tokens = sum(len(ids) for ids in seg_ids[pos:])
    gen_tokens = len(gen_head_ids) + len(think_ids)
    total = len(header_ids) + current_tokens + gen_tokens
    if max_tokens is not None and total > max_tokens:
        raise PromptTooLong(
            needed=total,
            max_tokens=max_tokens,
            system_tokens=len(header_ids),
            current_tokens=current_tokens,
            generation_tokens=gen_tokens,
        )
    kept = 0
    for cost in reversed(costs):
        if max_tokens is not None and total + cost > max_tokens:
            break
        total += cost
        kept += 1

    # Assemble the kept suffix.
    first = len(head) + sum(len(ex) for ex in candidates[: len(candidates) - kept])
    chosen = list(range(len(head))) + list(range(first, len(flat)))
    assistant_head = ids_of(ASSISTANT_HEAD)
    ids: list[int] = list(header_ids)
    texts = [parts.header]
    starts, assistant_starts = [], []
    for i in chosen:
        starts.append(len(ids) if parts.messages[i] else 0)
        if flat[i]["role"] == "assistant":
            assistant_starts.append(len(ids) + _head_tokens(seg_ids[i], assistant_head))
        ids.extend(seg_ids[i])
        texts.append(parts.messages[i])
    ids.extend(gen_head_ids)
    generation_start = len(ids)
    ids.extend(think_ids)
    texts += [parts.generation_head, parts.generation_think]
    boundaries = Boundaries(
        system_end=len(header_ids),
        message_starts=starts,
        assistant_starts=assistant_starts,
        generation_start=generation_start,
    )
    return Prompt(
        text="".join(texts),
        ids=ids,
        messages=[flat[i] for i in chosen],
        dropped=len(exchanges) - kept,
        boundaries=boundaries,
    )
