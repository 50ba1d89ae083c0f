"""A conversation: its history, the chat window, and one cached token sequence.

Each turn renders the whole windowed prompt (the template re-renders earlier answers, and the
window may drop the oldest exchange) and hands the ids to the session's `CachedSequence`, which
reuses the longest cached prefix and prefills only the rest. Snapshots are kept where a later
turn of this conversation can resume: after the system block (a turn that trims the window),
and at the ChatML boundaries of the latest exchange: its message starts (edit, regenerate),
right after `<|im_start|>assistant\n` (the next turn: the answer is re-rendered from there)
and the prompt's end. Older boundaries are never a linear conversation's deepest match again,
so they are dropped (each costs a whole recurrent state). A turn that fails (an exception,
Ctrl+C, a rejected answer, an abandoned stream) leaves the history as it was and the cache at
its state before the turn, or at a snapshot of it. The exchange is recorded on the caller's
thread as the Turn is handed over, so a Ctrl+C that lands after the model thread finished it
(before the caller has it) still leaves no trace.

With a disk tier (`engine.load(..., cache_dir=...)`), a turn whose caches reuse less than an
entry on disk reads that entry instead of prefilling it, and each turn writes the point the
next one resumes from: a new process, with a session holding the same conversation, reuses
it from disk (engine/storage/disk_cache.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from inspect import signature

from renderer import PromptTooLong, SegmentCache, build_prompt
from renderer.validation import check_text_only, json_problem, validate_tools

from .checkpoints.tokenizer import StreamDecoder, check_special_mode
from .constraints import (
    check_constraint,
    constraint_spec,
    make_sampler,
    response_format_spec,
    thinking_budget,
)
from .runtime.batch import WAIT
from .runtime.pool import fork
from .runtime.sampling import MAX_TOP_LOGPROBS, Sampler, SamplingParams
from .runtime.sequence import CachedSequence, Progress
from .runtime.worker import Job, WorkerStopped
from .turn import Turn, make_turn

DEFAULT_MAX_TOKENS = 512
# What warm() assumes the next message costs when it predicts the window's token budget: the
# shortest message (the least a turn can trim), and a typical one.
_SHORTEST_MESSAGE = "x"
_TYPICAL_MESSAGE = "x " * 64


class TurnConflict(RuntimeError):
    """A turn that cannot run: another turn of the session is running (an open stream, or a
    turn on another thread), or its stream was made before the session's last turn (its
    prompt lacks that exchange)."""


_BUSY_STREAM = (
    "this session is still answering: a stream of it is open on this thread; finish or close "
    "that stream before the next turn"
)
_BUSY_THREAD = (
    "this session is still answering a turn started on another thread (a session answers one "
    "turn at a time): wait for it to end, or give each thread its own session"
)


def _check_options(system, tools, enable_thinking, preserve_thinking, max_exchanges, max_tokens
                   ) -> None:  # fmt: skip
    """Reject a session option of the wrong type or range when the session is made, not at
    its first turn."""
    if system is not None and not isinstance(system, str):
        raise TypeError(f"system must be a string or None, got {type(system).__name__}")
    if tools is not None and not isinstance(tools, list):
        raise TypeError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    _check_text(system, "system")
    _check_tools(tools)
    for name, flag in (("enable_thinking", enable_thinking),
                       ("preserve_thinking", preserve_thinking)):  # fmt: skip
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name} must be True, False or None, got {flag!r}")
    _check_count("max_exchanges", max_exchanges, 0)
    if max_tokens is not None:
        _check_count("max_tokens", max_tokens, 1)


def _check_text(value, where: str) -> None:
    """Reject what no tokenizer or template can take, a ValueError naming where: lone
    surrogates in any string or key inside `value` (what undecodable bytes become with
    surrogateescape: they have no UTF-8 form), nesting deeper than the server allows (the
    template's recursive code would fail) and integers of over a thousand digits."""
    problem = json_problem(value)  # iterative: any depth is safe to check
    if problem is None:
        return
    keys, reason = problem
    at = where + "".join(f"[{k!r}]" for k in keys)
    item = value
    for k in keys:
        item = item[k]
    if isinstance(item, str):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{at} is not valid text: lone surrogate {item[e.start]!r} at character "
                f"{e.start} (undecodable bytes?)"
            ) from None
    raise ValueError(f"{at}: {reason}")


def _check_tools(tools) -> None:
    """Tool definitions as Engine.chat and the server check them: a RenderError (ValueError)
    naming the bad part (``tools[0].function.name``)."""
    if tools is not None:
        _check_text(tools, "tools")
        validate_tools(tools)


def _check_fits(max_tokens: int, window: int) -> None:
    if max_tokens >= window:
        raise ValueError(
            f"max_tokens {max_tokens} {'exceeds' if max_tokens > window else 'fills'} the "
            f"context window ({window} tokens), which must hold the prompt and the answer"
        )


def resolve_window(engine, window: int | None) -> int:
    """The context window a session or request gets: `window`, or the model's by default. A
    window past the positions the model was trained for (its config's max_position_embeddings)
    is refused: attention there is out of distribution and answers degrade without warning."""
    if window is None:
        return engine.entry.context_window
    _check_count("context_window", window, 1)
    limit = engine.entry.arch.max_position_embeddings
    if window > limit:
        raise ValueError(f"context_window {window} is past {engine.entry.name}'s {limit} "
                         "positions (max_position_embeddings in its config)")  # fmt: skip
    return window


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


class Session:
    """One conversation on an engine; `Engine.session(...)` makes one."""

    def __init__(
        self,
        engine,
        system: str | None = None,
        *,
        max_exchanges: int = 6,
        enable_thinking: bool | None = None,
        preserve_thinking: bool | None = None,
        tools: list[dict] | None = None,
        max_tokens: int | None = None,
        context_window: int | None = None,
        special_tokens_in_content: str = "text",
    ):
        _check_options(system, tools, enable_thinking, preserve_thinking, max_exchanges,
                       max_tokens)  # fmt: skip
        # "text": special token strings in message text stay text (no role forgery); "parse":
        # they become control tokens, as in transformers (README: Special tokens in messages).
        self.special_tokens_in_content = check_special_mode(special_tokens_in_content)
        self.engine = engine
        self.system = system
        self.max_exchanges = max_exchanges
        self.enable_thinking = enable_thinking
        self.preserve_thinking = preserve_thinking
        self.tools = tools
        self.max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        self.context_window = resolve_window(engine, context_window)
        if max_tokens is not None:  # chosen (the default is checked where a turn uses it)
            _check_fits(max_tokens, self.context_window)
        self.history: list[list[dict]] = []  # completed exchanges
        self.pending: list[dict] = []  # the current exchange while tool calls are open
        self.seq = CachedSequence(engine)
        self.seq.spillable = True  # with a disk tier, evicted state goes there (and comes back)
        self.segments = SegmentCache()  # token ids of rendered segments, reused across turns
        # A warm-up whose predicted window drops exchanges the caches hold goes to this second
        # sequence, so that a next turn that does not trim (a shorter message, a regenerate)
        # still finds the conversation in `seq`; the turn takes whichever reuses more.
        self._spare: CachedSequence | None = None
        self._warmed: dict = {}  # sequence -> (start, end) warm() computed there (turn stats)
        self._warming: Job | None = None  # a queued or running warm_in_background()
        self._answering = threading.Lock()  # held while a turn runs (an open stream)
        self._answerer: int | None = None  # the thread whose turn holds it (for the message)
        self._recorded = 0  # turns recorded and resets: a stream made before the last is stale

    # ----- public API -------------------------------------------------------------------

    def send(self, text, **kwargs) -> Turn:
        """Ask `text`; returns the finished Turn (see `stream` for the options)."""
        return _last(self.stream(text, **kwargs))

    def stream(
        self,
        text,
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        tools: list[dict] | None = None,
        validate: Callable[[Turn], None] | None = None,
        ignore_eos: bool = False,
        response_format: dict | None = None,
        tool_choice: str | dict | None = None,
        max_thinking_tokens: int | None = None,
        reasoning_effort: str | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> Iterator[str | Turn]:
        """Yield the answer's text pieces (valid UTF-8), then the Turn.

        `tools` (function definitions) become the session's tools once the turn succeeds.
        `validate(turn)` may raise to reject the answer: the turn is then rolled back like any
        other failure. A new message while tool calls are open abandons them. `ignore_eos`
        always generates `max_tokens` tokens (for benchmarks). Sampling is greedy unless told
        otherwise (the checkpoint's generation_config.json is for the CLI and the server; see
        `SamplingParams` for each option, `Engine.sampling_defaults` for the model's values;
        `logit_bias` maps token ids to amounts from -100 to 100 added to their logits).

        Constrained decoding: `response_format` (OpenAI's json_object / json_schema, or a
        regex / lark spec of engine/runtime/grammar.py) makes the answer match it;
        `tool_choice` "required" or {"type": "function", "function": {"name": ...}} forces
        one well-formed call of the tools. `max_thinking_tokens` (or `reasoning_effort`
        low/medium/high) closes the think block after that many tokens. `logprobs` fills
        `Turn.logprobs` (the model's distribution) with `top_logprobs` alternatives.
        """
        options = {k: v for k, v in locals().items() if k not in ("self", "text")}
        return self._start([{"role": "user", "content": text}], **options)

    def send_tool_results(self, results: Sequence, **options) -> Turn:
        """Answer the last turn's tool calls; returns the Turn (`stream_tool_results`)."""
        return _last(self.stream_tool_results(results, **options))

    def stream_tool_results(self, results: Sequence, **options) -> Iterator[str | Turn]:
        """Answer the last turn's tool calls (strings, or dicts with `content`), one result per
        call in order; continues the turn. Takes every option of `stream` (a TypeError names
        any other)."""
        signature(Session.stream).bind(self, "", **options)
        self._check_idle()
        if not self.pending:
            raise ValueError("no tool calls are waiting for results")
        if isinstance(results, (str, dict)) or not results:
            raise ValueError("results must be a non-empty list of strings or dicts")
        calls = len(self.pending[-1].get("tool_calls") or [])
        if len(results) != calls:  # as Engine.chat and the server insist
            raise ValueError(f"{len(results)} tool results for {calls} tool call"
                             f"{'s' * (calls != 1)} (one result per call, in order)")  # fmt: skip
        tool_msgs = []
        for i, r in enumerate(results):
            if isinstance(r, str):
                r = {"content": r}
            if not isinstance(r, dict) or not isinstance(r.get("content"), str):
                raise ValueError(f"results[{i}] must be a string or a dict with string 'content'")
            if r.get("role", "tool") != "tool":
                raise ValueError(f"results[{i}]['role'] must be 'tool' (or left out), got "
                                 f"{r['role']!r}")  # fmt: skip
            tool_msgs.append({**r, "role": "tool"})
        return self._start(self.pending + tool_msgs, **options)

    def _start(self, current: list[dict], *, tools=None, validate=None, ignore_eos=False,
               max_tokens=None, response_format=None, tool_choice=None,
               max_thinking_tokens=None, reasoning_effort=None, logprobs=False,
               top_logprobs=0, **sampling) -> Iterator[str | Turn]:  # fmt: skip
        """The turn that adds `current` to the conversation, with `stream`'s options."""
        _check_tools(tools)  # before tool_choice reads them
        if validate is not None and not callable(validate):
            raise TypeError(f"validate must be a callable taking the Turn, or None, got "
                            f"{validate!r}")  # fmt: skip
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {ignore_eos!r}")
        params = SamplingParams(**sampling)
        params.check_vocabulary(self.engine.tokenizer.vocab_size)
        options = _constraint_options(self.tools if tools is None else tools, response_format,
                                      tool_choice, max_thinking_tokens, reasoning_effort,
                                      logprobs, top_logprobs)  # fmt: skip
        return self._turn(current, params, max_tokens, validate, ignore_eos, tools, options)

    def regenerate(self, **kwargs) -> Turn:
        """Answer the last question again (rolls back to before it; restored on failure); with
        tool calls pending, that is their question (see `edit_last`)."""
        return self.edit_last(None, **kwargs)

    def edit_last(self, text, **kwargs) -> Turn:
        """Replace the last question by `text` (None keeps it) and answer it afresh.

        While tool calls wait for results, the last question is the pending one: its exchange
        (the calls, any results so far) is redone from the question. On failure the
        conversation is as it was, the redone exchange in its place once."""
        self._check_idle()
        if not (self.pending or self.history):
            raise ValueError("there is no exchange to redo")
        self.stop_warm()
        before = self._state()
        if self.pending:
            last, self.pending = self.pending, []
        else:
            last = self.history.pop()
        try:
            return self.send(last[0]["content"] if text is None else text, **kwargs)
        except BaseException:
            self._set_state(before)
            raise

    def warm(self, cancelled: Callable[[], bool] | None = None) -> int:
        """Do the next turn's work that does not depend on the next message; returns tokens prefilled.

        The next prompt is this conversation as the template will re-render it (previous answer
        without its think block; on a turn that trims, the re-windowed history) up to where the
        new user message starts. Prefilling it now leaves only the new message for the wait.
        A re-windowed history is prefilled beside the cached conversation, not over it, so a
        turn that does not trim after all (a shorter message than predicted, a regenerate)
        prefills no more than without the warm-up.
        Exact: the next turn reuses only what matches its prompt. Runs on the engine's model
        thread and stops at a chunk boundary when other work is queued for the model, or when
        `cancelled()` (called on that thread) is true.
        """
        self._check_idle()
        if self.pending:
            return 0  # tool results come next: the prompt already ends at a boundary

        def work(job: Job) -> int:
            return self._warm(lambda: job.cancelled.is_set() or bool(cancelled and cancelled()))

        return self.engine.worker.run(Job(work, background=True))

    def _warm(self, cancelled: Callable[[], bool]) -> int:
        """`warm`'s work, on the model thread.

        The window the next prompt gets depends on the next message's length (the token
        budget), so two are predicted: with the shortest message and with a typical one.
        A prefix that continues the cached conversation is prefilled in place; one whose
        window drops exchanges the caches hold would overwrite them (a shorter message or a
        regenerate would then prefill everything again), so it is prefilled in the spare
        sequence, started from the system block. A warm-up never makes a turn prefill more
        than it would without it. A predicted prompt that cannot fit the window (the session's
        max_tokens fills it, or the message does not fit beside the system block) is skipped:
        no turn like it can run."""
        if self.pending or self._answering.locked() or cancelled():
            return 0  # a stream began first: it needs no warm-up

        def stop() -> bool:
            return self.engine.background_should_yield() or cancelled()

        done, spared = 0, False
        for message in (_SHORTEST_MESSAGE, _TYPICAL_MESSAGE):
            try:
                prompt = self.render([{"role": "user", "content": message}], self.max_tokens)
            except PromptTooLong:
                continue  # no such turn fits the window: nothing to prepare for it
            b = prompt.boundaries
            prefix = prompt.ids[: b.message_starts[-1]]  # up to the new user message
            seq, at = self.seq, self.seq.reusable(prefix, need_logits=False, own=True)
            if at <= b.system_end < len(seq.tokens):  # a window without what seq holds
                if spared or at >= len(prefix):
                    continue  # the spare holds the shortest message's, or there is no work
                seq, spared = self._spare_for(prefix, at), True
            # The next turn resumes at the prefix's end if its window is the predicted one,
            # else right after the system block.
            start, end = seq.extend(prefix, stops={b.system_end, len(prefix)}, cancelled=stop)
            if end > start:
                self._warmed[seq] = (start, end)
            done += end - start
            if stop():
                break
        return done

    def _spare_for(self, prefix: list[int], at: int) -> CachedSequence:
        """The spare sequence, holding at least `seq`'s first `at` tokens of `prefix` (a copy of
        its system block, or more from an earlier warm-up)."""
        spare = self._spare
        if spare is None:
            spare = self._spare = CachedSequence(self.engine)
            spare.spillable = True
        if spare.reusable(prefix, need_logits=False, own=True) < at:
            fork(self.seq, at, spare)  # `at` is a snapshot of seq (or its live end)
            self.engine.budget.enforce(active=spare)
        return spare

    def warm_in_background(self) -> Job:
        """Queue `warm()` as idle-time work on the engine's model thread; returns its job.

        Any other work for the model (this session's next turn included) stops it at a chunk.
        """
        self._check_idle()
        self.stop_warm()
        job = Job(lambda job: self._warm(job.cancelled.is_set), background=True)
        self._warming = self.engine.worker.submit(job)
        return job

    def stop_warm(self, timeout: float | None = None) -> None:
        """Stop a background warm-up at its next chunk and wait for it."""
        if self._warming is not None:
            job, self._warming = self._warming, None
            job.cancel()
            if job.started:  # one that has not started sees the flag and does nothing
                job.wait(timeout)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays); refused while a turn runs."""
        self._check_idle()
        self.stop_warm()
        self.history, self.pending = [], []
        self.seq.drop_cache()
        self._spare, self._warmed = None, {}
        self._recorded += 1  # a stream made before now renders the forgotten history: stale

    @property
    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [m for ex in self.history for m in ex] + self.pending

    @property
    def tokens(self) -> list[int]:
        """The ids the session's caches hold (prompt and answer of the last turn)."""
        return self.seq.tokens

    def _check_idle(self) -> None:
        """Refuse to change the session while one of its streams is open (mid-turn)."""
        if self._answering.locked():
            raise TurnConflict(self._busy())

    def _busy(self) -> str:
        return _BUSY_STREAM if self._answerer == threading.get_ident() else _BUSY_THREAD

    # ----- one turn ---------------------------------------------------------------------

    def render(self, current: list[dict], max_tokens: int, tools: list[dict] | None = None):
        """The prompt for `current` after the history, windowed to fit `max_tokens` of output."""
        budget = self.context_window - max_tokens
        try:
            return self._build(current, budget, self.tools if tools is None else tools)
        except PromptTooLong as e:
            e.args = (f"{e} (context window {self.context_window} minus {max_tokens} tokens "
                      f"reserved for the answer)",)  # fmt: skip
            raise

    def _build(self, current: list[dict], budget: int, tools: list[dict] | None):
        return build_prompt(
            self.engine.tokenizer.encode,
            system=self.system,
            history=self.history,
            current=current,
            max_exchanges=self.max_exchanges,
            max_tokens=budget,
            variant=self.engine.entry.template,
            enable_thinking=self.enable_thinking,
            tools=tools,
            preserve_thinking=self.preserve_thinking,
            cache=self.segments,
            text_spans=self.special_tokens_in_content == "text",
        )

    def _turn(self, current, params, max_tokens, validate, ignore_eos, tools,
              options: dict | None = None) -> Iterator:  # fmt: skip
        # Everything that can reject the input runs here, before the generator starts, so a
        # bad message raises at the call and touches nothing.
        t0 = time.perf_counter()
        self._check_idle()
        self.stop_warm()  # our own warm-up: stop it before reading the history it reads
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        _check_count("max_tokens", max_tokens, 1)
        _check_fits(max_tokens, self.context_window)
        _check_text(current, "messages")
        check_text_only(current)  # no vision tower: image/video placeholders would read nothing
        prompt = self.render(current, max_tokens, tools)
        if options:
            spec = constraint_spec(self.engine, options["format"], options["forced"])
            check_constraint(self.engine, spec)  # a GrammarError (ValueError) names it
            sampler = make_sampler(
                self.engine, params, thinking=prompt.text.endswith("<think>\n"), spec=spec,
                max_thinking_tokens=options["budget"], top_logprobs=options["top"],
            )  # fmt: skip
        else:
            sampler = Sampler(params)
        return self._run(
            self._recorded, prompt, current, sampler, max_tokens, validate, ignore_eos,
            tools, t0,
        )  # fmt: skip

    def _run(self, recorded: int, prompt, current, sampler, max_tokens, validate, ignore_eos,
             tools, t0) -> Iterator:  # fmt: skip
        if not self._answering.acquire(blocking=False):
            raise TurnConflict(self._busy())
        self._answerer = threading.get_ident()
        finished: list = []  # the model thread's turn, once its job has returned (`_answer`)
        before = self._state()
        try:
            if recorded != self._recorded:  # its prompt lacks the turns answered since
                raise TurnConflict(
                    "this stream was made before the session's last turn (or reset): make a new one"
                )
            self.stop_warm()  # one started since this stream was made: it would move the caches
            # The turn runs on the engine's model thread, one piece per `next` here: closing
            # this generator closes that one there (rolling back) before it returns.
            args = (prompt, current, sampler, max_tokens, validate, ignore_eos, t0, finished)
            turn = yield from self.engine.worker.iterate(lambda: self._answer(*args))
            # Recorded here, on the caller's thread, as the turn is handed over: a caller that
            # fails first (Ctrl+C while the model thread returns) has it taken back below.
            self._record(current, turn, tools)
            self._spare, self._warmed = None, {}  # a warm-up for the turn now answered
        except BaseException:
            self._set_state(before)  # the conversation, and which sequence holds it
            if finished:  # the model thread had finished the turn: its caches go back too
                self._take_back(*finished[0])
            raise
        finally:
            self._answerer = None
            self._answering.release()
        yield turn

    def _answer(self, prompt, current, sampler, max_tokens, validate, ignore_eos, t0,
                finished: list) -> Iterator:  # fmt: skip
        stops = _resume_points(prompt, len(current))
        progress = Progress()
        detok, pieces = StreamDecoder(self.engine.tokenizer), []
        # On the model thread (see `_run`), which holds the model across the yields.
        with self.engine.foreground():
            spare = self._spare
            if spare is not None and spare.reusable(prompt.ids, own=True) > self.seq.reusable(
                prompt.ids, own=True
            ):  # the warm-up predicted this turn's window: answer there (`_warm`)
                self.seq, self._spare = spare, self.seq
            disk = getattr(self.engine, "disk", None)
            if disk is not None:
                self._from_disk(disk, prompt.ids)
            tokens = self.seq.generate(
                prompt.ids, stops=stops, sampler=sampler, max_tokens=max_tokens,
                progress=progress, ignore_eos=ignore_eos,
            )  # fmt: skip
            try:
                for token in tokens:
                    if token is WAIT:  # its row waits for a batched step: others run
                        yield WAIT
                        continue
                    piece = detok.add(token)
                    if piece:
                        pieces.append(piece)
                        yield piece
                tail = detok.flush()
                if tail:
                    pieces.append(tail)
                    yield tail
                turn = self._make_turn(prompt, "".join(pieces), progress, t0, sampler)
                if validate is not None:
                    validate(turn)
            except BaseException:
                tokens.close()  # settle the sequence first (a no-op if it already finished)
                if progress.undo is not None:
                    self.seq.rollback(progress.undo)  # a failed turn leaves no trace
                raise
            self.seq.keep_snapshots(stops | {len(prompt.ids)})
            if disk is not None:  # where the next turn resumes, kept across a restart
                b = prompt.boundaries
                disk.observe_prefill(progress.prefilled, progress.prefill_s)
                disk.keep_turn(self.seq, (b.system_end, b.generation_start))
        # What `_take_back` needs to undo the turn if the caller fails before it has it.
        finished.append((self.seq, progress.undo, self.seq.caches, list(self.seq.tokens)))
        return turn

    def _take_back(self, seq, undo, caches, tokens) -> None:
        """Return `seq` to its state before a turn the model thread finished on it but the
        caller never received, unless other work has moved it since (then it is left:
        whatever it holds is valid)."""

        def work() -> None:
            if undo is not None and seq.caches is caches and seq.tokens == tokens:
                seq.rollback(undo)
                self.engine.budget.enforce(active=seq)

        with contextlib.suppress(WorkerStopped):  # the engine closed: nothing to keep
            self.engine.worker.call(work)

    def _from_disk(self, disk, ids: list[int]) -> None:
        """Take the longest prefix of `ids` the engine's disk tier holds, if it is longer than
        what the caches can reuse and reading it beats prefilling (`DiskCache.lookup`)."""
        entry = disk.lookup(ids, above=self.seq.reusable(ids))
        restored = disk.restore(entry) if entry is not None else None
        if restored is not None:  # None: it failed its checks (deleted); the turn prefills
            self.seq.drop_cache()
            self.seq.tokens, self.seq.caches = restored

    def _make_turn(self, prompt, raw: str, p: Progress, t0: float, sampler: Sampler) -> Turn:
        start, end = self._warmed.get(self.seq, (0, 0))
        warm_tokens = max(0, min(p.reused, end) - start)
        recorded = getattr(sampler, "top_logprobs", None) is not None  # scripted samplers: none
        logprobs = sampler.recorded if recorded else None
        return make_turn(prompt, raw, p, t0, cache_bytes=self.seq.cache_bytes,
                         warm_tokens=warm_tokens, logprobs=logprobs)  # fmt: skip

    def _record(self, current: list[dict], turn: Turn, tools: list[dict] | None) -> None:
        self._recorded += 1
        exchange = current + [turn.message()]
        if turn.tool_calls:
            self.pending = exchange  # the exchange goes on with the tool results
        else:
            self.pending = []
            self.history.append(exchange)
        if tools is not None:
            self.tools = tools  # the session's tools from now on

    def _state(self) -> tuple:
        """What a turn changes but the caches' contents, for `_set_state`: the conversation,
        and which sequence holds it (`_answer` may take the spare)."""
        return (list(self.history), list(self.pending), self.tools, self._recorded, self.seq,
                self._spare, dict(self._warmed))  # fmt: skip

    def _set_state(self, state: tuple) -> None:
        history, pending, self.tools, self._recorded, self.seq, self._spare, self._warmed = state
        self.history[:] = history  # in place: a caller may hold the list
        self.pending = list(pending)


def _resume_points(prompt, n_current: int) -> set[int]:
    """Where a later turn of a conversation can resume: the system block's end, and every
    boundary from the first of the `n_current` messages this turn adds (see the docstring)."""
    b = prompt.boundaries
    return b.resume_points(b.message_starts[-n_current])


def _constraint_options(tools, response_format, tool_choice, max_thinking_tokens,
                        reasoning_effort, logprobs, top_logprobs) -> dict | None:  # fmt: skip
    """The turn's constraint options, checked (ValueError naming the bad one); None if none."""
    if not isinstance(logprobs, bool):
        raise TypeError(f"logprobs must be True or False, got {logprobs!r}")
    if (
        isinstance(top_logprobs, bool)
        or not isinstance(top_logprobs, int)
        or not (0 <= top_logprobs <= MAX_TOP_LOGPROBS)
    ):
        raise ValueError(f"top_logprobs must be an integer from 0 to 20, got {top_logprobs!r}")
    if top_logprobs and not logprobs:  # as Engine.chat and the server say
        raise ValueError("top_logprobs needs logprobs=True")
    if (
        response_format is None
        and tool_choice in (None, "auto")
        and not logprobs
        and (max_thinking_tokens is None and reasoning_effort is None)
    ):
        return None
    from .serving.completion import ApiError, forced_tools_of

    fmt = response_format_spec(response_format)
    try:
        forced = forced_tools_of(tool_choice, tools)
    except ApiError as e:
        raise ValueError(e.message) from None
    if forced and fmt is not None:
        raise ValueError("a forced tool_choice and a response_format cannot be combined")
    budget = thinking_budget(max_thinking_tokens, reasoning_effort)
    top = top_logprobs if logprobs else None
    return {"format": fmt, "forced": forced, "budget": budget, "top": top}


def _last(stream: Iterator):
    """Run a turn's stream to the end; its last item is the Turn."""
    return deque(stream, maxlen=1)[0]
