"""The OpenAI chat-completions request and answer, without HTTP: parsing, rendering, output text.

- `decode_body`: the raw body to JSON, refusing what no later step could handle (lone
  surrogates, nesting past MAX_JSON_DEPTH, integers of thousands of digits) with a 400.
- `parse_request`: the JSON body to a `ChatRequest`, or an `ApiError` naming the bad field.
- `render_request`: the whole conversation to prompt ids and boundaries (nothing is dropped:
  a prompt that does not fit the context window is an error, never a silent trim).
- `OutputText`: generated text as the client sees it, piece by piece: stop strings cut,
  reasoning split from content, tool calls parsed, deltas that always add up to the final
  message.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from renderer import (
    Prompt,
    RenderError,
    SegmentCache,
    build_prompt,
    split_conversation,
    validate_exchange,
)
from renderer.validation import (
    check_text_only,
    check_tool_results,
    json_path,
    json_problem,
    loads_json,
    validate_tools,
)

from ..checkpoints.tokenizer import check_special_mode, encode_in_pieces
from ..constraints import response_format_spec, thinking_budget
from ..runtime.sampling import MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams
from ..turn import ToolCall, parse_tool_calls, split_reasoning

MAX_STOP_STRINGS = 4  # as the OpenAI API
# Choices one request may ask for (`n`): they decode together, at most the batch's default
# width (runtime.batch.DEFAULT_MAX_BATCH), each on its own pool sequence.
MAX_CHOICES = 8
THINK_END = "</think>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class ApiError(Exception):
    """An error answered as an OpenAI-style error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type,
        )  # fmt: skip

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param, "code": self.code,
            }
        }  # fmt: skip


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class ChatRequest:
    messages: list
    model: str | None = None
    tools: list | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # None: the server's default, within the context window
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None
    response_format: dict | None = None  # a grammar spec (engine/constraints.py); None: text
    forced_tools: list | None = None  # tool_choice required/named: the answer calls one of them
    logprobs: bool = False
    top_logprobs: int = 0
    max_thinking_tokens: int | None = None  # None: unbounded
    n: int = 1  # choices: answers sampled for the one prompt (`choice`)
    parallel_tool_calls: bool = True  # False: the answer ends with its first tool call

    @property
    def top_logprobs_or_none(self) -> int | None:
        """What `Sampler(top_logprobs=...)` takes: None when no logprobs are asked for."""
        return self.top_logprobs if self.logprobs else None


def decode_body(raw: bytes) -> Any:
    """The request body as JSON; ApiError(400) for anything no later step can take."""
    try:
        body = loads_json(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    check_body(body)
    return body


def check_body(body: Any) -> None:
    """ApiError(400) naming the field for what no later step can take: lone surrogates,
    nesting too deep, integers of thousands of digits (`renderer.validation.json_problem`)."""
    problem = json_problem(body)
    if problem:
        keys, reason = problem
        param = json_path("", keys) or None
        raise _bad(f"{param or 'the body'}: {reason}", param, "invalid_value")


def _number(body: Mapping, name: str, lo: float, hi: float, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number", name, "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(f"'{name}' must be a finite number", name, "invalid_value")
    if not lo <= value <= hi:  # exact for ints of any size (no float conversion)
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {value}", name, "invalid_value")
    return float(value)


def _integer(body: Mapping, name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name, "invalid_type")
    if minimum is not None and value < minimum:
        raise _bad(f"'{name}' must be >= {minimum}, got {value}", name, "invalid_value")
    return value


def _flag(body: Mapping, name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"'{param or name}' must be a boolean", param or name, "invalid_type")
    return value


# Sampling fields a request may set, their range and the value when neither the request nor
# the checkpoint's generation_config.json sets one (OpenAI's defaults).
_SAMPLING = {
    "temperature": (0.0, 2.0, 1.0),
    "top_p": (0.0, 1.0, 1.0),
    "min_p": (0.0, 1.0, 0.0),
    "repetition_penalty": (0.0, 10.0, 1.0),
    "presence_penalty": (-2.0, 2.0, 0.0),
    "frequency_penalty": (-2.0, 2.0, 0.0),
}


def parse_request(body: Any, defaults: Mapping | None = None) -> ChatRequest:
    """Check a chat-completions body; raises ApiError(400) naming the offending parameter.

    `defaults`: SamplingParams fields for what the request omits (the checkpoint's
    generation_config.json in the server). Message contents are checked later, by the
    renderer (`Renderer.render`).
    """
    defaults = defaults or {}
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    # OpenAI's `developer` role is its new name for the system message.
    messages = [
        {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
        for m in messages
    ]
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(old) is not None:
            raise _bad(f"'{old}' is OpenAI's deprecated form of '{new}': send '{new}' (answers "
                       "come back as tool_calls)", old, "unsupported")  # fmt: skip
    parallel = _flag(body, "parallel_tool_calls")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"] or body.get("audio") is not None:
        param = "audio" if body.get("audio") is not None else "modalities"
        raise _bad("only text output is supported (the engine runs the text model): "
                   "'modalities' may be [\"text\"] and 'audio' must be absent", param,
                   "unsupported_value")  # fmt: skip
    n = _integer(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise _bad(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n", "invalid_value")
    logprobs = _flag(body, "logprobs") or False
    top_logprobs = _integer(body, "top_logprobs", 0)
    if top_logprobs is not None and top_logprobs > MAX_TOP_LOGPROBS:
        raise _bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}",
                   "top_logprobs", "invalid_value")  # fmt: skip
    if top_logprobs is not None and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    try:
        response_format = response_format_spec(body.get("response_format"))
    except ValueError as e:
        raise _bad(str(e), "response_format", "invalid_value") from None
    try:
        budget = thinking_budget(body.get("max_thinking_tokens"), body.get("reasoning_effort"))
    except ValueError as e:
        raise _bad(str(e), str(e).split(" ", 1)[0], "invalid_value") from None

    tools = body.get("tools")
    if tools is not None:
        try:
            validate_tools(tools)
        except RenderError as e:
            code = "invalid_type" if e.field == "tools" else "invalid_value"
            raise _bad(f"{e.field}: {e.reason}", e.field, code) from None
    choice = body.get("tool_choice")
    forced = forced_tools_of(choice, tools)
    if forced and response_format is not None:
        raise _bad("a forced tool_choice and a response_format cannot be combined",
                   "response_format", "invalid_value")  # fmt: skip
    if choice == "none" or not tools:
        tools = None  # the model is not told about tools it must not call

    stream = _flag(body, "stream") or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")

    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop", "invalid_value")

    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise _bad(
            "'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type"
        )
    for key in kwargs:
        if key not in ("enable_thinking", "preserve_thinking"):
            raise _bad(
                f"unknown chat_template_kwargs key {key!r} (supported: enable_thinking, "
                "preserve_thinking)", f"chat_template_kwargs.{key}", "unsupported",
            )  # fmt: skip
    thinking = _flag(kwargs, "enable_thinking", "chat_template_kwargs.enable_thinking")
    preserve = _flag(kwargs, "preserve_thinking", "chat_template_kwargs.preserve_thinking")

    sampling = {
        name: _number(body, name, lo, hi, defaults.get(name, fallback))
        for name, (lo, hi, fallback) in _SAMPLING.items()
    }
    top_k = _integer(body, "top_k", 0)
    sampling["top_k"] = defaults.get("top_k", 0) if top_k is None else top_k
    seed = _integer(body, "seed", 0)
    if seed is not None and seed > MAX_SEED:
        raise _bad(f"'seed' must be at most 2**64-1, got {seed}", "seed", "invalid_value")
    bias = _logit_bias(body.get("logit_bias"))
    try:
        params = SamplingParams(**sampling, seed=seed, logit_bias=bias)
    except ValueError as e:  # e.g. top_p == 0 or min_p == 1
        raise _bad(str(e), str(e).split(" ", 1)[0], "invalid_value") from None
    return ChatRequest(
        messages=messages, model=model, tools=tools, stream=stream,
        include_usage=bool(stream and include_usage), max_tokens=max_tokens, params=params,
        stop=stop, enable_thinking=thinking, preserve_thinking=preserve,
        response_format=response_format, forced_tools=forced, logprobs=logprobs,
        top_logprobs=top_logprobs or 0, max_thinking_tokens=budget, n=n,
        parallel_tool_calls=parallel is not False,
    )  # fmt: skip


def _logit_bias(value: Any) -> dict[int, Any]:
    """OpenAI's `logit_bias` (an object of token ids, as strings, to biases from -100 to 100)
    with its ids as ints, as SamplingParams takes it (and checks the biases); the ids are
    checked against the vocabulary later (`check_logit_bias`), where the tokenizer is known."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("'logit_bias' must be an object of token ids to biases", "logit_bias",
                   "invalid_type")  # fmt: skip
    bias = {}
    for key, b in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20):
            raise _bad(f"'logit_bias': keys are token ids (decimal integers), got {key!r}",
                       "logit_bias", "invalid_value")  # fmt: skip
        if int(key) in bias:  # "1" and "01"
            raise _bad(f"'logit_bias' names token {int(key)} twice", "logit_bias",
                       "invalid_value")  # fmt: skip
        bias[int(key)] = b
    return bias


def check_logit_bias(params: SamplingParams, tokenizer) -> None:
    """ApiError(400) if `logit_bias` names a token past the tokenizer's vocabulary."""
    try:
        params.check_vocabulary(tokenizer.vocab_size)
    except ValueError as e:
        raise _bad(str(e), "logit_bias", "invalid_value") from None


def choice(request: ChatRequest, index: int) -> ChatRequest:
    """Choice `index` of an `n`-choice request: one answer, its seed (if one is set) moved on by
    `index` (mod 2**64), so the choices are distinct samples and each is the answer that same
    request with n=1 and that seed gets."""
    seed = request.params.seed
    params = request.params
    if seed is not None:
        params = dataclasses.replace(params, seed=(seed + index) % (MAX_SEED + 1))
    return dataclasses.replace(request, params=params, n=1)


def forced_tools_of(choice: object, tools: list | None) -> list | None:
    """The tools `tool_choice` forces the answer to call one of (None: not forced)."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        if not tools:
            raise _bad("tool_choice 'required' needs tools", "tool_choice", "invalid_value")
        return tools
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad("tool_choice.function.name must be a string", "tool_choice.function.name",
                       "invalid_type")  # fmt: skip
        named = [t for t in tools or [] if t.get("function", t).get("name") == name]
        if not named:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools",
                       "tool_choice.function.name", "invalid_value")  # fmt: skip
        return named
    raise _bad("tool_choice must be 'auto', 'none', 'required' or "
               "{'type': 'function', 'function': {'name': ...}}", "tool_choice",
               "unsupported_value")  # fmt: skip


def _message_param(error: RenderError, offset: int) -> str:
    if error.index is None:
        return "messages"
    param = f"messages[{offset + error.index}]"
    return f"{param}.{error.field}" if error.field else param


class SharedSegmentCache(SegmentCache):
    """A SegmentCache for many threads: the lock covers lookups and stores, never `encode`,
    so one huge request being tokenized does not hold up the others; long texts are encoded
    a piece at a time, so the GIL the tokenizer holds is released between pieces."""

    def __init__(self, maxsize: int = 1024) -> None:
        super().__init__(maxsize)
        self._lock = threading.Lock()

    @staticmethod
    def _encode(encode, text: str, spans: tuple | None) -> tuple[int, ...]:
        return tuple(encode_in_pieces(encode, text, spans=spans)) if text else ()

    def _lookup(self, key):
        with self._lock:
            return super()._lookup(key)

    def _store(self, key, ids: tuple[int, ...]) -> None:
        with self._lock:
            super()._store(key, ids)


def _verbatim_bytes(messages: Sequence[Mapping]) -> int:
    """UTF-8 bytes of the text the template copies verbatim: system, user and tool contents,
    trimmed as it trims them (assistant contents may lose a think part, so they do not count)."""
    total = 0
    for m in messages:
        if m.get("role") not in ("system", "user", "tool"):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p.get("text"), str))
        if isinstance(content, str):
            total += len(content.strip().encode("utf-8"))
    return total


class Renderer:
    """Renders requests to prompts for one engine; thread-safe (one shared segment cache).

    With a context `window`, a request whose text cannot fit it is refused before anything
    is tokenized: no token spans more than `max_token_bytes` bytes, so N bytes of verbatim
    text are at least N / max_token_bytes tokens. `special_tokens_in_content`: see `Session`
    ("text": no role forgery through message text).
    """

    def __init__(self, engine, window: int | None = None, special_tokens_in_content: str = "text"):
        self.engine = engine
        self.window = window
        self.text_spans = check_special_mode(special_tokens_in_content) == "text"
        self.segments = SharedSegmentCache(4096)
        self._max_token_bytes: int | None = None

    @property
    def max_token_bytes(self) -> int:
        """The most bytes one token of the vocabulary stands for (special tokens included)."""
        if self._max_token_bytes is None:
            # Byte-level BPE: each character of a vocabulary entry is one byte; added tokens
            # (<|im_start|>...) are their text.
            vocab = self.engine.tokenizer.backend.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max(map(len, vocab))
        return self._max_token_bytes

    def check_length(self, request: ChatRequest) -> None:
        """ApiError(400) if the request's text alone is surely longer than the window."""
        if self.window is None:
            return
        size = _verbatim_bytes(request.messages)
        if size > self.window * self.max_token_bytes:
            at_least = size // self.max_token_bytes
            raise ApiError(
                400,
                f"This model's maximum context length is {self.window} tokens, but the "
                f"messages take at least {at_least} tokens ({size} bytes of text). Shorten the "
                "conversation (the server never drops messages).",
                param="messages",
                code="context_length_exceeded",
            )

    def render(self, request: ChatRequest) -> Prompt:
        """The prompt of the whole conversation; ApiError(400) naming the bad message field."""
        try:
            system, history, current = split_conversation(request.messages)
        except RenderError as e:
            raise _bad(e.reason, _message_param(e, 0), "invalid_message") from None
        # Check exchanges here, where their offsets in `messages` are known, so an error names
        # the message by its index in the request.
        offset = 1 if system is not None else 0
        for k, exchange in enumerate([*history, current]):
            try:
                validate_exchange(exchange, complete=k < len(history))
            except RenderError as e:
                raise _bad(e.reason, _message_param(e, offset), "invalid_message") from None
            offset += len(exchange)
        try:
            check_tool_results(request.messages)
            check_text_only(request.messages)
        except RenderError as e:
            raise _bad(e.reason, _message_param(e, 0), "invalid_message") from None
        self.check_length(request)
        try:
            return build_prompt(
                self.engine.tokenizer.encode,
                system=system,
                history=history,
                current=current,
                max_exchanges=10**9,  # stateless clients send what they want seen: keep all
                max_tokens=None,  # the context check is ours, with a clear 400
                variant=self.engine.entry.template,
                enable_thinking=request.enable_thinking,
                tools=request.tools,
                preserve_thinking=request.preserve_thinking,
                cache=self.segments,
                text_spans=self.text_spans,
            )
        except RenderError as e:
            param = "tools" if e.field == "tools" else _message_param(e, 0)
            raise _bad(str(e), param, "invalid_message") from None


def prepare(
    raw: bytes, renderer: Renderer, defaults: Mapping | None = None
) -> tuple[ChatRequest, Prompt]:
    """A request body to its checked request and prompt: everything the server does before
    queueing a job; ApiError (4xx) for any bad input, however malformed."""
    request = parse_request(decode_body(raw), defaults)
    return request, renderer.render(request)


def output_budget(request: ChatRequest, prompt_tokens: int, window: int, default: int, *,
                  prompt: str = "messages") -> int:  # fmt: skip
    """max_tokens for the request; ApiError(400) if the prompt leaves no room in the window.
    `prompt`: what the client sent, as the errors call it ("messages", or a raw "prompt")."""
    if prompt_tokens >= window:
        takes, shorten = {
            "messages": ("the messages take", "the conversation (the server never drops messages)"),
            "prompt": ("the prompt takes", "the prompt"),
        }[prompt]  # fmt: skip
        raise ApiError(
            400,
            f"This model's maximum context length is {window} tokens, but {takes} "
            f"{prompt_tokens} tokens. Shorten {shorten}.",
            param=prompt,
            code="context_length_exceeded",
        )
    if request.max_tokens is None:
        return min(default, window - prompt_tokens)
    if prompt_tokens + request.max_tokens > window:
        raise ApiError(
            400,
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt_tokens + request.max_tokens} tokens ({prompt_tokens} in the {prompt}, "
            f"{request.max_tokens} in the completion). Reduce the length of the {prompt} or "
            "the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return request.max_tokens


def _partial_suffix(text: str, needles: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `needles`."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


@dataclass
class Message:
    """The final assistant message of a completion."""

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]
    tool_call_error: str | None

    def openai_tool_calls(self) -> list[dict]:
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in self.tool_calls
        ]


class OutputText:
    """Generated text, piece by piece, as the client sees it.

    `add(piece)` returns the new (reasoning, content) text; text that might still turn into a
    stop string, `</think>` or `<tool_call>` is held back until it is clear. Streamed deltas
    concatenate to exactly what `message()` returns for the whole text (the same
    `split_reasoning`/`parse_tool_calls` the Python API uses). Stop strings apply to the
    whole generated text (reasoning included) and are never shown. With `one_call` (OpenAI's
    `parallel_tool_calls: false`) the answer ends with its first tool call's `</tool_call>`.
    """

    def __init__(self, thinking: bool, stop: Sequence[str] = (), one_call: bool = False):
        self.thinking = thinking
        self.stop_strings = list(stop)
        self.one_call = one_call
        self.raw = ""
        self.stopped = False  # a stop string matched, or the one call ended: generation ends
        self._sent = ("", "")

    def add(self, piece: str) -> tuple[str, str]:
        if self.stopped or not piece:
            return "", ""
        start = len(self.raw)
        self.raw += piece
        hits = [
            i for s in self.stop_strings if (i := self.raw.find(s, max(0, start - len(s) + 1))) >= 0
        ]
        if hits:
            self.raw = self.raw[: min(hits)]
            self.stopped = True
        if self.one_call and (end := self._call_end(start)) is not None:
            self.raw, self.stopped = self.raw[:end], True
        return self._delta(final=False)

    def _call_end(self, start: int) -> int | None:
        """Where the answer's first `</tool_call>` ends, if the piece added at `start` has
        completed one (past the think block: a call in the reasoning is no call)."""
        answer = 0
        if self.thinking:
            think = self.raw.find(THINK_END)
            if think < 0:
                return None
            answer = think + len(THINK_END)
        i = self.raw.find(TOOL_CALL_END, max(answer, start - len(TOOL_CALL_END) + 1))
        return None if i < 0 else i + len(TOOL_CALL_END)

    def flush(self) -> tuple[str, str]:
        """Everything still held back, once generation has ended."""
        return self._delta(final=True)

    def message(self) -> Message:
        reasoning, answer = split_reasoning(self.raw, self.thinking)
        content, calls, error = parse_tool_calls(answer)
        if not calls:
            content = answer  # no calls, or malformed markup: show the answer as it came
        return Message(content, reasoning, calls, error)

    def _visible(self, final: bool) -> tuple[str, str]:
        raw = self.raw
        if not final and not self.stopped:
            raw = raw[: len(raw) - _partial_suffix(raw, self.stop_strings)]
        if not self.thinking:
            reasoning, answer = "", raw
        elif THINK_END in raw:
            reasoning, _, answer = raw.partition(THINK_END)
        else:
            held = 0 if final else _partial_suffix(raw, [THINK_END])
            reasoning, answer = raw[: len(raw) - held], ""
        if final:
            m = self.message()
            return m.reasoning or "", m.content or ""
        if TOOL_CALL in answer:
            answer = answer[: answer.index(TOOL_CALL)]
        else:
            answer = answer[: len(answer) - _partial_suffix(answer, [TOOL_CALL])]
        # Trailing whitespace is held back: the final message is stripped.
        return reasoning.strip(), answer.strip()

    def _delta(self, final: bool) -> tuple[str, str]:
        new = self._visible(final)
        out = []
        for sent, now in zip(self._sent, new):
            # Visible text only grows (see the class docstring); anything else is held.
            out.append(now[len(sent) :] if now.startswith(sent) else "")
        self._sent = tuple(
            now if now.startswith(sent) else sent for sent, now in zip(self._sent, new)
        )
        return out[0], out[1]
