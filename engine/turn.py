"""What one turn returns: the answer, its ids, the tool calls it made, and what it cost."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from renderer.validation import MARKUP_NAME

from .runtime.sampling import TokenLogprob


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # restored from the cache
    prefilled_tokens: int = 0  # computed after the message arrived
    generated_tokens: int = 0
    warm_tokens: int = 0  # computed ahead of time, while the user was typing
    dropped_exchanges: int = 0  # left out of the window
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    cache_bytes: int = 0
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_tokens: int = 0  # of those, how many stood
    acceptance_rate: float = 0.0
    tokens_per_verify: float = 0.0  # tokens each verify step produced, on average

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def to_message(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Turn:
    text: str  # the answer (without reasoning and tool-call markup)
    reasoning: str | None
    prompt_ids: list[int]
    token_ids: list[int]  # generated, without the stop token
    stats: TurnStats
    finish_reason: str  # "stop" or "length"
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_error: str | None = None  # malformed tool-call markup, reported not guessed
    # One per token of `token_ids` when asked for (`logprobs=True`): the model's own
    # distribution (log_softmax of the raw logits; see engine/runtime/sampling.py).
    logprobs: list[TokenLogprob] | None = None

    def message(self) -> dict:
        """The assistant message this turn adds to the conversation."""
        m: dict = {"role": "assistant", "content": self.text}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return m


def make_turn(prompt, raw: str, progress, t0: float, *, cache_bytes: int, warm_tokens: int,
              finish: str | None = None, logprobs: list | None = None) -> Turn:  # fmt: skip
    """The Turn for generated text `raw` after `prompt` (a renderer Prompt), from the
    `Progress` of its generation; `t0` is when the call began (for the time to first token)."""
    thinking = prompt.text.endswith("<think>\n")  # the generation prompt opened a think block
    reasoning, answer = split_reasoning(raw, thinking)
    content, calls, error = parse_tool_calls(answer)
    p, n = progress, len(progress.tokens)
    stats = TurnStats(
        prompt_tokens=len(prompt.ids),
        reused_tokens=p.reused,
        prefilled_tokens=p.prefilled,
        generated_tokens=n,
        dropped_exchanges=prompt.dropped,
        ttft_s=(p.first_token_at - t0) if p.first_token_at else 0.0,
        prefill_s=p.prefill_s,
        decode_s=p.decode_s,
        prefill_tps=p.prefilled / p.prefill_s if p.prefill_s > 0 else 0.0,
        decode_tps=(n - 1) / p.decode_s if p.decode_s > 0 and n > 1 else 0.0,
        cache_bytes=cache_bytes,
        warm_tokens=warm_tokens,
    )
    spec = p.speculation
    stats.drafted_tokens, stats.accepted_tokens = spec.drafted, spec.accepted
    stats.acceptance_rate, stats.tokens_per_verify = spec.acceptance_rate, spec.tokens_per_verify
    if logprobs is not None:
        logprobs = logprobs[:n]  # not the stop token
    return Turn(content, reasoning, list(prompt.ids), list(p.tokens), stats, finish or p.finish,
                calls, error, logprobs)  # fmt: skip


_FUNCTION = re.compile(rf"\s*<function=({MARKUP_NAME})>")
_PARAM = re.compile(rf"\s*<parameter=({MARKUP_NAME})>\n?")
_JSON_END = re.compile(r"\s*</parameter>")
_CALL_END = re.compile(r"\s*</function>\s*</tool_call>")
_SPACE = re.compile(r"\s*")
_JSON = json.JSONDecoder()
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what a \uXXXX escape without its pair gives
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def split_reasoning(raw: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of generated text; with thinking on it starts inside <think>."""
    if not thinking:
        return None, raw.strip()
    if "</think>" not in raw:
        return raw.strip(), ""  # ran out of tokens while thinking
    reasoning, _, answer = raw.partition("</think>")
    return reasoning.strip(), answer.strip()


def parse_tool_calls(answer: str) -> tuple[str, list[ToolCall], str | None]:
    """Split the template's XML tool calls off an answer: (content, calls, error).

    Read in order, not by searching for closing tags: a value that parses as JSON ends where
    the JSON ends, so a JSON string argument (what a forced call writes) may contain
    `</parameter>`, `</function>` or `</tool_call>`. Any other value is a plain string up to
    the first `</parameter>` (as the template writes strings). Malformed markup is reported,
    not guessed at: no calls, the whole answer kept as content.
    """
    start = answer.find("<tool_call>")
    if start < 0:
        return answer, [], None
    calls, pos = [], start
    while pos < len(answer):
        if not answer.startswith("<tool_call>", pos):
            return answer, [], "unterminated <tool_call> block or stray text around it"
        call, pos = _read_call(answer, pos + len("<tool_call>"), len(calls))
        if isinstance(call, str):
            return answer, [], call
        calls.append(call)
        pos = _SPACE.match(answer, pos).end()
    return answer[:start].strip(), calls, None


def _read_call(text: str, pos: int, i: int) -> tuple[ToolCall | str, int]:
    """The call whose `<tool_call>` ends at `pos`, and where it ends; an error string instead
    of the call if it is malformed."""
    m = _FUNCTION.match(text, pos)
    if not m:
        return f"tool call {i}: expected <function=NAME>...</function>", pos
    name, pos, args = m.group(1).strip(), m.end(), {}
    while not (end := _CALL_END.match(text, pos)):
        m = _PARAM.match(text, pos)
        if not m:
            if "</tool_call>" not in text[pos:]:
                return "unterminated <tool_call> block or stray text around it", pos
            return f"tool call {i} ({name}): text outside <parameter> blocks", pos
        key, pos = m.group(1).strip(), m.end()
        try:
            value, after = _JSON.raw_decode(text, _SPACE.match(text, pos).end())
            close = _JSON_END.match(text, after)
        except (json.JSONDecodeError, RecursionError):  # (nested past what Python decodes)
            close = None
        if close is None:  # a plain string, up to the first </parameter>
            close_at = text.find("</parameter>", pos)
            if close_at < 0:
                return "unterminated <tool_call> block or stray text around it", pos
            value = text[pos:close_at].removesuffix("\n")
            pos = close_at + len("</parameter>")
        else:
            if _SURROGATE_ESCAPE.search(text, pos, after):
                value = _valid_unicode(value)
            pos = close.end()
        args[key] = value
    return ToolCall(name, args), end.end()


def _valid_unicode(value):
    """A decoded JSON value with each lone surrogate (an unpaired `\\ud800`-style escape: it
    decodes, but has no UTF-8 form) replaced by U+FFFD, as undecodable bytes are in generated
    text; encoding it would fail wherever the call goes (a session log, an Anthropic
    tool_use). In place and without recursion: the value may nest as deep as JSON decodes."""

    def fix(v):
        return _LONE_SURROGATE.sub("\ufffd", v) if isinstance(v, str) else v

    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            node[:] = [fix(v) for v in node]
            stack.extend(v for v in node if isinstance(v, (list, dict)))
        elif isinstance(node, dict):
            items = [(fix(k), fix(v)) for k, v in node.items()]
            node.clear()
            node.update(items)
            stack.extend(v for _, v in items if isinstance(v, (list, dict)))
    return fix(value)
