"""`Engine.chat(messages)`: stateless chat, and the one implementation under `chatml serve`.

The caller keeps the conversation and sends all of it on every call, as OpenAI clients do.
A request is checked and rendered on the caller's thread (the server's own checks:
`parse_request`, `Renderer`, `output_budget`), then runs on the engine's model thread, which
routes the prompt to the engine-wide `SequencePool` sequence that reuses the most, generates,
and afterwards prefills what the same conversation will most likely send next, while no other
work waits (idle-time warm-up). Nothing is dropped unless `max_exchanges` asks for a window
(then as a `Session` with that window would): past the context window is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from renderer import Prompt, PromptTooLong, SegmentCache, build_prompt, split_conversation

from .checkpoints.tokenizer import StreamDecoder
from .constraints import GrammarError, check_constraint, constraint_spec, make_sampler
from .runtime.batch import WAIT
from .runtime.pool import DEFAULT_SEQUENCES, PooledSequence, SequencePool, grid_points
from .runtime.sequence import Progress
from .runtime.worker import Job, WorkerStopped
from .serving.completion import (
    ApiError,
    ChatRequest,
    Message,
    OutputText,
    Renderer,
    _partial_suffix,
    check_body,
    check_logit_bias,
    choice,
    output_budget,
    parse_request,
)
from .session import resolve_window
from .turn import Turn, make_turn

log = logging.getLogger("chatml.server")

DEFAULT_MAX_TOKENS = 512  # when a call sets no max_tokens (capped by the context window)


class ChatError(ValueError):
    """A chat call that cannot run: bad input, or a conversation past the context window.

    `param` names the offending argument (e.g. "messages[2].content"), `code` says why.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class PreparedChat:
    """A checked and rendered request, ready for the model thread."""

    request: ChatRequest
    prompt: Prompt
    max_tokens: int
    window: int
    max_exchanges: int | None
    openai: bool  # the client resends answers as OpenAI messages (the server)
    t0: float
    renderer: Renderer  # what rendered it (the warm-up renders the next prompt the same way)
    spec: dict | None = None  # the grammar the answer must match (engine/constraints.py)


@dataclass
class ChatCounts:
    """What the pool's answered generations did so far (the server's /metrics); written on
    the model thread, read anywhere (each field a plain number)."""

    answered: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those reused from the cache
    generated_tokens: int = 0
    ttft_s: float = 0.0  # time to first token, summed
    cache_bytes: int = 0  # the pool's bytes after the last answer

    def add(self, turn: Turn) -> None:
        s = turn.stats
        self.prompt_tokens += s.prompt_tokens
        self.cached_tokens += s.reused_tokens
        self.generated_tokens += s.generated_tokens
        self.ttft_s += s.ttft_s
        self.cache_bytes = s.cache_bytes
        self.answered += 1


class StatelessChat:
    """One engine's stateless chat: its renderer and its pool of cached sequences.

    `prepare` runs on any thread; the generation runs on the engine's model thread, so
    several threads may chat at once (served one after another).
    """

    def __init__(self, engine, sequences: int = DEFAULT_SEQUENCES):
        self.engine = engine
        self.pool = SequencePool(engine, sequences)  # used on the model thread only
        self.renderer = Renderer(engine)
        self.completed = 0  # generations run (answered, failed or cancelled mid-way)
        self.warmed_tokens = 0  # prefilled by idle-time warm-ups
        self.counts = ChatCounts()
        self._segments = SegmentCache(4096)  # for windowed renders
        self._segments_lock = threading.Lock()

    @property
    def idle(self) -> threading.Event:
        """Set while the model thread waits for work (any warm-up done)."""
        return self.engine.worker.idle

    # ----- on the caller's thread ---------------------------------------------------------

    def prepare(
        self,
        request: ChatRequest,
        *,
        window: int | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_exchanges: int | None = None,
        openai: bool = False,
        renderer: Renderer | None = None,
    ) -> PreparedChat:
        """Render `request` and fix its output budget; ApiError(400) naming what is wrong.

        `renderer`: the server's own (its window check, its special-token mode)."""
        t0 = time.perf_counter()
        window = window or self.engine.entry.context_window
        renderer = renderer or self.renderer
        check_logit_bias(request.params, self.engine.tokenizer)
        prompt = renderer.render(request)  # checks every message, keeps them all
        if max_exchanges is None:
            max_tokens = output_budget(request, len(prompt.ids), window, default_max_tokens)
        else:
            max_tokens = request.max_tokens or default_max_tokens
            prompt = self._window(request, max_exchanges, window, max_tokens)
        spec = constraint_spec(self.engine, request.response_format, request.forced_tools)
        try:
            check_constraint(self.engine, spec)
        except GrammarError as e:
            param = "tools" if request.forced_tools else "response_format"
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None
        return PreparedChat(
            request, prompt, max_tokens, window, max_exchanges, openai, t0, renderer, spec
        )

    def _window(self, request: ChatRequest, max_exchanges: int, window: int, max_tokens: int):
        """The prompt with at most `max_exchanges` earlier exchanges, fewer to leave
        `max_tokens` for the answer: what a Session with that window renders."""
        system, history, current = split_conversation(request.messages)
        try:
            with self._segments_lock:
                return build_prompt(
                    self.engine.tokenizer.encode,
                    system=system,
                    history=history,
                    current=current,
                    max_exchanges=max_exchanges,
                    max_tokens=window - max_tokens,
                    variant=self.engine.entry.template,
                    enable_thinking=request.enable_thinking,
                    tools=request.tools,
                    preserve_thinking=request.preserve_thinking,
                    cache=self._segments,
                    text_spans=True,  # special tokens in message text are text (README)
                )
        except PromptTooLong as e:
            raise ApiError(
                400,
                f"{e} (context window {window} minus {max_tokens} tokens reserved for the answer)",
                param="messages",
                code="context_length_exceeded",
            ) from None

    def stream(self, prepared: PreparedChat, *, warm: bool = True) -> Iterator[str | Turn]:
        """Yield the answer's text pieces, then the Turn; runs at the caller's pace.

        Closing it early stops the generation at the next token (the pool keeps the valid
        state it reached).
        """
        events = self.engine.worker.iterate(lambda: self.generate(prepared, warm=warm))
        try:
            while True:
                try:
                    event = next(events)
                except StopIteration as done:
                    turn = done.value
                    break
                if event[0] == "delta" and event[3]:
                    yield event[3]
        finally:
            events.close()
        yield turn

    def choices(self, prepared: PreparedChat, *, warm: bool = True) -> list[Turn]:
        """The request's `n` answers, as the server's `n` runs them: the first prefills the
        prompt; the others start once its first token is in, so they fork from its snapshot at
        the generation start and decode in the same batched steps. Choice i takes the seed
        moved on by i (`completion.choice`); only the first warms the next request. Blocks
        until all are done; ChatError if one failed (the others are cancelled)."""
        n = prepared.request.n
        results: list = [None] * n
        ended = [threading.Event() for _ in range(n)]
        started = threading.Event()

        def emit(i: int) -> Callable[[tuple], None]:
            def put(event: tuple) -> None:
                if event[0] in ("done", "error"):
                    results[i] = event
                    ended[i].set()
                if i == 0 and event[0] in ("first", "done", "error"):
                    started.set()

            return put

        jobs = [self.submit(prepared, emit(0), warm=warm)]
        try:
            started.wait()
            if results[0] is None or results[0][0] == "done":
                for i, later in enumerate(later_choices(prepared), 1):
                    jobs.append(self.submit(later, emit(i), warm=False))
            for i in range(len(jobs)):
                ended[i].wait()
        except BaseException:  # (a KeyboardInterrupt while waiting)
            for job in jobs:
                job.cancel()
            raise
        for kind, value in results[: len(jobs)]:
            if kind == "error":
                for job in jobs:
                    job.cancel()
                if value.status >= 500:  # the engine failed, not the request
                    raise RuntimeError(value.message)
                raise ChatError(value.message, value.param, value.code)
        return [value for _, value in results]

    def submit(self, prepared: PreparedChat, emit: Callable[[tuple], None], *,
               warm: bool = True) -> Job:  # fmt: skip
        """Queue the generation, running ahead of the consumer; events go to `emit` (on the
        model thread): ("first", reused_tokens), ("delta", reasoning, content, raw), then ("done",
        Turn) or ("error", ApiError); with `logprobs` asked for, ("logprobs", [TokenLogprob])
        comes before the delta of the tokens it covers. `job.cancel()` stops it at the next
        token."""

        cancelled = ("error", ApiError(499, "the request was cancelled", code="cancelled"))

        def end(kind: str, value) -> None:
            if kind == "return":
                emit(("done", value))
            elif kind == "cancelled":  # the client went away; the generation has closed
                emit(cancelled)
            elif isinstance(value, GrammarError):  # the constraint, not the engine: a dead end
                param = "tools" if prepared.request.forced_tools else "response_format"
                emit(("error", ApiError(400, f"{param}: {value}", param=param,
                                        code="invalid_value")))  # fmt: skip
            else:  # keep serving; the sequence has rolled back
                if not isinstance(value, WorkerStopped):
                    log.error("generation failed", exc_info=value)
                emit(("error", ApiError(500, f"generation failed: {value}", type="server_error")))

        # Runs interleaved with the other requests: their decode steps are batched.
        return self.engine.worker.spawn(lambda: self.generate(prepared, warm=warm), emit, end)

    # ----- on the model thread ------------------------------------------------------------

    def generate(self, prepared: PreparedChat, *, warm: bool) -> Generator[tuple, None, Turn]:
        """Generate on the best pool sequence: yields ("first", reused_tokens) once the prompt
        is in, then ("delta", reasoning, content, raw) for new visible text; returns the Turn."""
        prompt, request = prepared.prompt, prepared.request
        b = prompt.boundaries
        seq = self.pool.acquire(prompt.ids, b.generation_start)
        warmed, seq.warmed = seq.warmed, (0, 0)
        progress = Progress()
        out = _Output(
            prompt.text.endswith("<think>\n"),
            request.stop,
            one_call=bool(request.tools) and not request.parallel_tool_calls,
        )
        detok = StreamDecoder(self.engine.tokenizer)
        sampler = make_sampler(
            self.engine, request.params, thinking=out.text.thinking, spec=prepared.spec,
            max_thinking_tokens=request.max_thinking_tokens,
            top_logprobs=request.top_logprobs_or_none,
        )  # fmt: skip
        stops = snapshot_points(prompt)
        branch = self.pool.branch_point(prompt.ids, stops | {seq.reusable(prompt.ids, own=True)})
        tokens = seq.generate(
            prompt.ids, stops=stops if branch is None else stops | {branch}, sampler=sampler,
            max_tokens=prepared.max_tokens, progress=progress,
        )  # fmt: skip
        sent = 0  # logprobs sent in events
        try:
            for token in tokens:
                if token is WAIT:  # its row waits for a batched step: others run
                    yield WAIT
                    continue
                if len(progress.tokens) == 1:
                    yield ("first", progress.reused)
                if request.logprobs:
                    new = sampler.recorded[sent : len(progress.tokens)]
                    sent += len(new)
                    yield ("logprobs", new)
                piece = detok.add(token)
                if piece and (delta := out.add(piece)):
                    yield delta
                if out.text.stopped:
                    break
            else:
                if delta := out.add(detok.flush()):
                    yield delta
        finally:
            tokens.close()  # settle the sequence at the valid state it reached
            self.completed += 1  # counted before the caller can see the outcome
        if delta := out.flush():
            yield delta
        if self.engine.disk is not None:  # its speed decides when a disk read beats a prefill
            self.engine.disk.observe_prefill(progress.prefilled, progress.prefill_s)
            # Where this conversation resumes, to disk now: a SIGKILL then loses little.
            self.engine.disk.keep_turn(seq, (b.system_end, b.generation_start))
        # The served sequence was exempt while it ran; now the budget holds for all.
        self.engine.budget.enforce()
        turn = make_turn(
            prompt, out.text.raw, progress, prepared.t0, cache_bytes=self.pool.cache_bytes,
            warm_tokens=max(0, min(progress.reused, warmed[1]) - warmed[0]),
            finish="stop" if out.text.stopped else None,
            logprobs=sampler.recorded if request.logprobs else None,
        )  # fmt: skip
        self.counts.add(turn)
        if warm:
            stamp = seq.stamp
            self.engine.worker.submit(
                Job(lambda job: self._warm(job, prepared, turn, seq, stamp), background=True)
            )
        return turn

    def _warm(self, job: Job, prepared: PreparedChat, turn: Turn, seq: PooledSequence,
              stamp: int) -> None:  # fmt: skip
        """Prefill what this conversation's next request starts with, while nothing waits.

        A client resends the conversation plus this answer and one new message; everything up
        to that message is known now (the answer as the template re-renders it). Any queued
        job interrupts the work at the next chunk; the next request reuses only what matches.
        """
        if seq.stamp != stamp or seq not in self.pool.sequences:
            return  # another request took the sequence over meanwhile
        if prepared.openai:
            answer: dict = {"role": "assistant", "content": turn.text}
            if turn.tool_calls:
                answer["tool_calls"] = openai_message(turn).openai_tool_calls()
        else:
            answer = turn.message()
        # The results continue this exchange, one per call (the request check insists).
        nxt = [{"role": "tool", "content": "x"} for _ in turn.tool_calls] or [
            {"role": "user", "content": "x"}
        ]
        request = dataclasses.replace(
            prepared.request, messages=[*prepared.request.messages, answer, *nxt]
        )
        try:
            if prepared.max_exchanges is None:
                prompt = prepared.renderer.render(request)
            else:
                prompt = self._window(request, prepared.max_exchanges, prepared.window,
                                      prepared.max_tokens)  # fmt: skip
        except ApiError:
            return  # nothing to prepare (e.g. the answer itself is not renderable)
        b = prompt.boundaries
        prefix = prompt.ids[: b.message_starts[-len(nxt)]]  # up to the first unknown message
        start, end = seq.extend(
            prefix, stops=b.points(),  # those past the prefix are ignored
            cancelled=lambda: job.cancelled.is_set() or self.engine.worker.should_yield(),
        )  # fmt: skip
        if end > start:
            seq.warmed = (start, end)
        self.warmed_tokens += end - start


class _Output:
    """OutputText plus the raw text as a Python caller sees it: every generated piece, less
    what may still turn into a stop string (and nothing from a stop string on)."""

    def __init__(self, thinking: bool, stop: list[str], one_call: bool = False):
        self.text = OutputText(thinking, stop, one_call)
        self.shown = 0

    def add(self, piece: str) -> tuple | None:
        return self._event(*self.text.add(piece), final=False)

    def flush(self) -> tuple | None:
        return self._event(*self.text.flush(), final=True)

    def _event(self, reasoning: str, content: str, final: bool) -> tuple | None:
        raw = self.text.raw
        if not final and not self.text.stopped:
            raw = raw[: len(raw) - _partial_suffix(raw, self.text.stop_strings)]
        new, self.shown = raw[self.shown :], max(self.shown, len(raw))
        if reasoning or content or new:
            return ("delta", reasoning, content, new)
        return None


def later_choices(prepared: PreparedChat) -> list[PreparedChat]:
    """Choices 1 to n-1 of an `n`-choice request (`completion.choice`), started once the
    first one's first token is in (`StatelessChat.choices`, the server's `_start_choices`)."""
    n = prepared.request.n
    return [dataclasses.replace(prepared, request=choice(prepared.request, i)) for i in range(1, n)]


def snapshot_points(prompt: Prompt) -> set[int]:
    """Where a request's prefill snapshots: the system block's end (a client that slides its
    window restarts there) and every boundary from the last user message on (an edit or a
    regeneration of it, the answer's start that the next request resumes at, the steps of a
    tool loop). Boundaries of older messages were snapshotted when each was the latest; met
    again only when a re-prefill passes them (after the client dropped an exchange, or a
    conversation's first request), where each costs tens of ms (BENCHMARKS.md) and the next
    slide makes it unreachable: those are skipped, and a branch there reuses the system block.
    A long system block and a long stretch past the last user message's start also snapshot
    on a grid (`pool.grid_points`; met again only below the reused prefix, so taken once):
    the next question on a pasted document, or the next conversation whose long system
    prompt (tools, instructions) differs only near its end (a date, a folder), resumes near
    the fork."""
    b = prompt.boundaries
    users = [i for i, m in enumerate(prompt.messages) if m.get("role") == "user"]
    starts = b.message_starts  # empty for a raw prompt (completions endpoint)
    first = starts[users[-1]] if users else starts[-1] if starts else 0
    end = b.generation_start or len(prompt.ids)
    return b.resume_points(first) | grid_points(0, b.system_end) | grid_points(first, end)


def openai_message(turn: Turn) -> Message:
    """The Turn as the server's assistant message."""
    return Message(turn.text, turn.reasoning, turn.tool_calls, turn.tool_call_error)


# ----- the Python API ----------------------------------------------------------------------


def chat_stream(engine, messages: list[dict], **options) -> Iterator[str | Turn]:
    """`Engine.chat_stream`: everything is checked here, before the generator is made."""
    prepared, warm = prepare_chat(engine, messages, **options)
    return engine.stateless.stream(prepared, warm=warm)


def chat_choices(engine, messages: list[dict], n: int, **options) -> list[Turn]:
    """`Engine.chat_choices`: checked here, then run (`StatelessChat.choices`)."""
    if not isinstance(n, int) or isinstance(n, bool):
        raise ChatError(f"n must be an integer, got {n!r}", "n", "invalid_type")
    prepared, warm = prepare_chat(engine, messages, n=n, **options)
    return engine.stateless.choices(prepared, warm=warm)


def prepare_chat(engine, messages: list[dict], *, tools=None, tool_choice=None, max_tokens=None,
                 temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                 presence_penalty=0.0, frequency_penalty=0.0, seed=None, stop=None,
                 logit_bias=None, enable_thinking=None, preserve_thinking=None,
                 max_exchanges=None, context_window=None, warm=True, response_format=None,
                 logprobs=None, top_logprobs=None, max_thinking_tokens=None,
                 reasoning_effort=None, n=1) -> tuple[PreparedChat, bool]:  # fmt: skip
    """The Python API's options as the server's request, checked and rendered (ChatError
    naming what is wrong), and whether to warm the next request."""
    if max_exchanges is not None and (isinstance(max_exchanges, bool)
                                      or not isinstance(max_exchanges, int) or max_exchanges < 0):  # fmt: skip
        raise ChatError(f"max_exchanges must be an integer >= 0 or None, got {max_exchanges!r}",
                        "max_exchanges", "invalid_value")  # fmt: skip
    try:
        resolve_window(engine, context_window)
    except (TypeError, ValueError) as e:
        raise ChatError(str(e), "context_window", "invalid_value") from None
    if not isinstance(warm, bool):
        raise ChatError(f"warm must be True or False, got {warm!r}", "warm", "invalid_type")
    kwargs = {"enable_thinking": enable_thinking, "preserve_thinking": preserve_thinking}
    body = {
        "messages": messages, "tools": tools, "tool_choice": tool_choice,
        "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "min_p": min_p, "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
        "seed": seed, "stop": stop, "logit_bias": _json_bias(logit_bias),
        "chat_template_kwargs": {k: v for k, v in kwargs.items() if v is not None},
        "response_format": response_format, "logprobs": logprobs, "top_logprobs": top_logprobs,
        "max_thinking_tokens": max_thinking_tokens, "reasoning_effort": reasoning_effort,
        "n": n,
    }  # fmt: skip
    body = {k: v for k, v in body.items() if v is not None}
    chat = engine.stateless
    try:
        check_body(body)  # what the server refuses in any body (surrogates, depth)
        request = parse_request(body)
        prepared = chat.prepare(request, window=context_window, max_exchanges=max_exchanges)
    except ApiError as e:
        raise ChatError(e.message, e.param, e.code) from None
    return prepared, warm


def _json_bias(bias):
    """A Python `logit_bias` ({token id: bias}) as the request body writes it (string keys);
    anything else is passed on for the request's check to name."""
    if isinstance(bias, dict) and all(type(k) is int and k >= 0 for k in bias):
        return {str(k): v for k, v in bias.items()}
    return bias


def last(stream: Iterator):
    """Run a stream to the end; its last item is the Turn."""
    return deque(stream, maxlen=1)[0]
