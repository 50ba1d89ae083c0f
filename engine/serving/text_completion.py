"""The legacy completions API (`POST /v1/completions`): raw text in, raw text out.

The prompt (a string, or token ids) goes to the model as it is, with no chat template: its ids
are routed through the same pool as chat prompts, so a prompt that extends an earlier one
(few-shot evaluation, a document growing call by call) restores the longest cached prefix.
Special tokens written in a string prompt are control tokens (raw mode: the caller formats).
`logprobs` with `echo` and `max_tokens: 0` scores the prompt: one forward pass over it, the
log-softmax at each position read at the next token (what evaluation harnesses ask for), in
chunks that take turns with the other requests' decode steps, stopping if the client leaves.
Without echo, `logprobs` reports the generated tokens' (streamed: each chunk carries those of
the tokens it covers).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Generator, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from renderer import Prompt
from renderer.window import Boundaries

from ..checkpoints.tokenizer import StreamDecoder, encode_in_pieces
from ..runtime.batch import WAIT
from ..runtime.generate import eval_caches
from ..runtime.sampling import token_logprobs
from ..turn import Turn
from .completion import ApiError, ChatRequest, check_logit_bias, output_budget
from .translation import Origins, bad, chat_request, sampling_fields

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for this endpoint
MAX_LOGPROBS = 20
LOGPROB_CHUNK = 128  # prompt positions per forward pass: bounds the [T, vocab] logits


@dataclass
class CompletionRequest:
    chat: ChatRequest  # sampling, stop strings, stream; its messages are unused
    prompt: Prompt  # the raw ids, no template, no boundaries
    echo: bool
    logprobs: int | None  # top-N alternatives per position, None: no logprobs

    @property
    def max_tokens(self) -> int:
        return self.chat.max_tokens or 0


def _too_long(window: int, tokens: int, at_least: str = "") -> ApiError:
    return bad(f"This model's maximum context length is {window} tokens, but the prompt takes "
               f"{at_least}{tokens} tokens.", "prompt", "context_length_exceeded")  # fmt: skip


def _prompt_ids(value: Any, tokenizer, vocab: int, window: int, max_token_bytes: int | None
                ) -> tuple[list[int], str]:  # fmt: skip
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > 1:
            raise bad("'prompt' takes one prompt per request", "prompt", "unsupported_value")
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad("'prompt' must not be empty", "prompt")
        # Refused before tokenizing when its bytes cannot fit (no token spans more than
        # `max_token_bytes`); else tokenized a piece at a time, as chat messages are, so a
        # huge prompt does not hold the GIL from the other requests for seconds.
        size = len(value.encode("utf-8", "surrogatepass"))
        if max_token_bytes and size > window * max_token_bytes:
            raise _too_long(window, size // max_token_bytes, "at least ")
        return encode_in_pieces(tokenizer.encode, value), value
    if not isinstance(value, list) or not value:
        raise bad("'prompt' must be a string or a non-empty list of token ids (one prompt per "
                  "request)", "prompt", "invalid_type")  # fmt: skip
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(f"'prompt[{i}]' must be a token id (one prompt per request)", f"prompt[{i}]",
                      "invalid_type")  # fmt: skip
        if not 0 <= t < vocab:
            raise bad(f"'prompt[{i}]' is not a token id of this model (0 to {vocab - 1}), got {t}",
                      f"prompt[{i}]")  # fmt: skip
    return list(value), tokenizer.decode(list(value))


def translate(body: Any, tokenizer, window: int, defaults: Mapping | None = None, *,
              max_token_bytes: int | None = None) -> CompletionRequest:  # fmt: skip
    """A completions request, checked; ApiError(400) naming the field. `max_token_bytes`
    (`Renderer.max_token_bytes`) lets a string prompt that cannot fit be refused untokenized."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported", "suffix", "unsupported")
    if body.get("best_of") not in (None, 1):
        raise bad("only best_of=1 is supported", "best_of", "unsupported_value")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("'echo' must be a boolean", "echo", "invalid_type")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):  # fmt: skip
        raise bad(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}", "logprobs")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise bad("'max_tokens' must be an integer", "max_tokens", "invalid_type")
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens' may be 0 only with echo (to score the prompt)", "max_tokens")
    if logprobs is not None and echo and max_tokens != 0:
        raise bad("'logprobs' with echo scores the prompt alone: set max_tokens to 0, or ask "
                  "for the generated tokens' logprobs without echo", "logprobs", "unsupported")  # fmt: skip
    origins = Origins({"messages": "prompt"})
    chat: dict = {"messages": [{"role": "user", "content": ""}], **sampling_fields(body)}
    for name in ("stop", "stream", "stream_options", "n", "logit_bias"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if max_tokens != 0:
        chat["max_tokens"] = max_tokens
        if logprobs is not None:  # the generated tokens', as the chat endpoint reports them
            chat["logprobs"], chat["top_logprobs"] = True, logprobs
    request = chat_request(chat, defaults, origins)
    check_logit_bias(request.params, tokenizer)
    vocab = tokenizer.vocab_size
    ids, text = _prompt_ids(body.get("prompt"), tokenizer, vocab, window, max_token_bytes)
    # One snapshot before the last token: the same prompt sent again (another sample, a retry)
    # resumes there; a prompt that extends it resumes after the answer as well.
    last = len(ids) - 1 if len(ids) > 1 else None
    prompt = Prompt(text, ids, [], 0, Boundaries(0, [], [], last))
    if max_tokens == 0:
        request.max_tokens = 0
        if len(ids) > window:
            raise _too_long(window, len(ids))
    else:
        try:
            request.max_tokens = output_budget(request, len(ids), window, DEFAULT_MAX_TOKENS,
                                               prompt="prompt")  # fmt: skip
        except ApiError as e:
            raise origins.error(e) from None
    return CompletionRequest(request, prompt, echo, logprobs)


# ----- on the model thread ------------------------------------------------------------------


Scored = list[tuple[float, list[tuple[int, float]]]]


def prompt_logprobs(engine, ids: list[int], top: int) -> Generator[object, None, Scored]:
    """For each position after the first: (log p(ids[t] | ids[:t]), the `top` most likely ids
    there with their log p, most likely first), from one forward pass on fresh caches (no
    reuse: cached prefixes keep no per-position logits).

    A generator for the model thread (`ModelThread.spawn`): it yields `WAIT` between chunks of
    `LOGPROB_CHUNK` positions, so the other requests' rows step between them and a cancelled
    job (the client left) stops there; it returns the list."""
    out: Scored = []
    caches = engine.model.make_caches()
    for start in range(0, len(ids) - 1, LOGPROB_CHUNK):
        if start:
            yield WAIT
        with engine.lock:
            piece = ids[start : start + LOGPROB_CHUNK]
            targets = mx.array(ids[start + 1 : start + 1 + len(piece)])
            logits = engine.model(mx.array([piece]), caches)[0, : targets.size]  # [T, V]
            chosen, best, best_lp = token_logprobs(logits.astype(mx.float32), targets, top)
            eval_caches(caches, chosen, best, best_lp)  # nothing lazy waits across a turn
            for lp, alternatives in zip(chosen.tolist(), zip(best.tolist(), best_lp.tolist())):
                out.append((lp, sorted(zip(*alternatives), key=lambda pair: -pair[1])))
    return out


def logprobs_body(tokenizer, ids: list[int], scored: list, top: int, *, unscored: int = 1
                  ) -> dict:  # fmt: skip
    """The legacy `logprobs` object: tokens, token_logprobs, top_logprobs ({token: logprob})
    and text_offset (characters into the text) of `ids`, whose first `unscored` tokens have
    no logprob (the prompt's first; none of generated tokens)."""
    detok, text, offsets, tokens = StreamDecoder(tokenizer), "", [], []
    for t in ids:
        offsets.append(len(text))
        text += detok.add(t)
        tokens.append(tokenizer.decode([t]))
    tops: list = [None] * unscored
    for _, alternatives in scored:
        tops.append({tokenizer.decode([i]): v for i, v in alternatives} if top else None)
    return {
        "tokens": tokens, "token_logprobs": [None] * unscored + [lp for lp, _ in scored],
        "top_logprobs": tops, "text_offset": offsets,
    }  # fmt: skip


def generated_logprobs_body(tokenizer, turn: Turn, top: int) -> dict:
    """The legacy `logprobs` object of a completion's generated tokens (the model's own
    distribution, as the chat endpoint reports it: see `runtime.sampling`)."""
    stream = StreamedLogprobs(tokenizer, top)
    stream.add(turn.logprobs or [])
    return stream.body()


class StreamedLogprobs:
    """The generated tokens' `logprobs` objects, chunk by chunk: `add` TokenLogprobs as they
    come, `body()` those not sent yet. Offsets count from the completion's first character, so
    the chunks' lists concatenate to the whole completion's object."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top
        self.detok, self.chars = StreamDecoder(tokenizer), 0
        self.pending: list = []

    def add(self, entries) -> None:
        self.pending += entries

    def body(self) -> dict:
        dec = self.tokenizer.decode
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in self.pending:
            out["tokens"].append(dec([lp.token]))
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({dec([i]): v for i, v in lp.top} if self.top else None)
            out["text_offset"].append(self.chars)
            self.chars += len(self.detok.add(lp.token))
        self.pending = []
        return out


# ----- the answer ---------------------------------------------------------------------------


def usage(prompt_tokens: int, cached: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }  # fmt: skip


def usage_of(turns: list[Turn]) -> dict:
    """The usage of a request's answers (its choices): they share the prompt, counted once."""
    s = turns[0].stats
    return usage(s.prompt_tokens, s.reused_tokens, sum(t.stats.generated_tokens for t in turns))


def completion(ident: str, created: int, model: str, answers: list[tuple], usage: dict) -> dict:
    """The response body; `answers` per choice: (text, finish_reason, logprobs object)."""
    choices = [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
               for i, (text, finish, logprobs) in enumerate(answers)]  # fmt: skip
    return {"id": ident, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}  # fmt: skip


def _chunk(ident: str, created: int, model: str, text: str, finish: str | None = None,
           usage: dict | None = None, logprobs: dict | None = None, index: int = 0) -> str:  # fmt: skip
    choices = [] if usage else [
        {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    ]  # fmt: skip
    body = {"id": ident, "object": "text_completion", "created": created, "model": model,
            "choices": choices}  # fmt: skip
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def collect(events: AsyncIterator[tuple]) -> tuple[str, Turn]:
    """The raw generated text (stop strings cut) and the Turn; raises the job's ApiError."""
    raw = ""
    async for event in events:
        if event[0] == "delta":
            raw += event[3]
        elif event[0] == "error":
            raise event[1]
        elif event[0] == "done":
            return raw, event[1]
    raise ApiError(500, "the generation ended without an answer", type="server_error")


async def stream(events: AsyncIterator[tuple[int, tuple]] | None, request: CompletionRequest,
                 ident: str, model: str, tokenizer, scored: list | None = None
                 ) -> AsyncIterator[str]:  # fmt: skip
    """SSE chunks: per choice the echoed prompt, then the raw text pieces as they come, each
    choice's finish, usage if asked, [DONE]. `events` are the choices' events tagged with their
    index (`server.merged`), None when nothing is generated (max_tokens 0); `scored` the
    prompt's logprobs then (see `prompt_logprobs`), sent with the echo. Generated tokens'
    logprobs go with the chunk of their text (those whose text is held back, with the finish)."""
    created = int(time.time())
    top, n = request.logprobs, request.chat.n
    if request.echo:
        echoed = None
        if scored is not None:
            echoed = logprobs_body(tokenizer, request.prompt.ids, scored, top)
        for i in range(n):
            yield _chunk(ident, created, model, request.prompt.text, logprobs=echoed, index=i)
    turns: list[Turn | None] = [None] * n
    lps = [StreamedLogprobs(tokenizer, top) if events is not None and top is not None else None
           for _ in range(n)]  # fmt: skip
    if events is not None:
        async for i, event in events:
            if event[0] == "logprobs" and lps[i] is not None:
                lps[i].add(event[1])
            elif event[0] == "delta" and event[3]:
                yield _chunk(ident, created, model, event[3], logprobs=lps[i] and lps[i].body(),
                             index=i)  # fmt: skip
            elif event[0] == "error":
                yield f"data: {json.dumps(event[1].body())}\n\n"
                return
            elif event[0] == "done":
                turns[i] = event[1]
                yield _chunk(ident, created, model, "", turns[i].finish_reason,
                             logprobs=lps[i] and lps[i].body(), index=i)  # fmt: skip
    else:
        for i in range(n):
            yield _chunk(ident, created, model, "", "length", index=i)
    if request.chat.include_usage:
        u = usage(len(request.prompt.ids), 0, 0) if events is None else usage_of(turns)
        yield _chunk(ident, created, model, "", usage=u)
    yield "data: [DONE]\n\n"
