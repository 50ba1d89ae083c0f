"""The one thread that owns the model in `chatml serve`: jobs in order, then idle-time warm-up.

HTTP handlers (engine/server.py) check and render a request on any thread and queue a `Job`;
`ModelWorker` runs jobs one at a time under `engine.lock`, routing each prompt to the
`SequencePool` sequence that reuses the most, and reports back through `job.emit`. Between
jobs it prefills what the conversation it just answered will most likely send next.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from renderer import Prompt

from ..checkpoints.tokenizer import StreamDecoder
from ..runtime.sampling import Sampler
from ..runtime.sequence import Progress
from .completion import ApiError, ChatRequest, OutputText, Renderer
from .pool import DEFAULT_SEQUENCES, PooledSequence, SequencePool

log = logging.getLogger("chatml.server")


# Answers after which the conversation goes on, so its next prompt is worth preparing.
_WARM_AFTER = ("stop", "tool_calls", "length")


@dataclass
class Job:
    """One completion for the worker; `emit` hands events to the request's event loop."""

    prompt: Prompt
    request: ChatRequest
    max_tokens: int
    emit: Callable[[tuple], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Result:
    message: object  # completion.Message
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class ModelWorker:
    """The one thread that runs the model: jobs from a queue, in order, under `engine.lock`.

    Events sent through `job.emit`: ("first",) once the first token exists (the prompt is
    in), ("delta", reasoning, content) for visible text, then ("done", Result) or
    ("error", ApiError).
    """

    def __init__(self, engine, sequences: int = DEFAULT_SEQUENCES, renderer=None, warm=True):
        self.engine = engine
        self.pool = SequencePool(engine, sequences)
        self.renderer = renderer or Renderer(engine)
        self.warm = warm  # idle-time prefill of each answered conversation's next prompt
        self.warmed_tokens = 0
        self.idle = threading.Event()  # set while waiting for a job (after any warm-up)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.stopping = threading.Event()
        self.completed = 0  # jobs answered or failed, counted before the client hears
        self._thread = threading.Thread(target=self._loop, name="chatml-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping.set()  # the running job ends at its next token
        self.jobs.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def _next(self) -> Job | None:
        self.idle.set()
        job = self.jobs.get()
        self.idle.clear()
        return job

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            if job.cancelled.is_set() or self.stopping.is_set():
                job.emit(("error", ApiError(499, "the request was cancelled", code="cancelled")))
                continue
            try:
                with self.engine.lock:
                    result, seq = self._run(job)
                    # The active sequence was exempt while it ran; now the budget holds for all.
                    self.engine.budget.enforce()
                outcome = ("done", result)
            except Exception as e:  # keep serving; the sequence has rolled back
                log.exception("generation failed")
                outcome = ("error", ApiError(500, f"generation failed: {e}", type="server_error"))
            self.completed += 1  # before the client can see the answer
            job.emit(outcome)
            if self.warm and outcome[0] == "done" and result.finish_reason in _WARM_AFTER:
                self._warm(job, result, seq)

    def _warm(self, job: Job, result: Result, seq) -> None:
        """While no request waits, prefill what this conversation's next request starts with.

        A client resends the conversation plus this answer and one new message; everything up
        to that message is known now (the answer as the template re-renders it). A new job
        interrupts the work at the next chunk; the next request reuses only what matches.
        """
        m = result.message
        answer: dict = {"role": "assistant", "content": m.content or ""}
        if m.tool_calls:
            answer["tool_calls"] = m.openai_tool_calls()
            # The results continue this exchange: one per call (the request check insists).
            nxt = [{"role": "tool", "content": "x"} for _ in m.tool_calls]
        else:
            nxt = [{"role": "user", "content": "x"}]
        messages = [*job.request.messages, answer, *nxt]
        request = dataclasses.replace(job.request, messages=messages)
        try:
            prompt = self.renderer.render(request)
        except ApiError:
            return  # nothing to prepare (e.g. the answer itself is not renderable)
        b = prompt.boundaries
        prefix = prompt.ids[: b.message_starts[-len(nxt)]]  # up to the first unknown message
        stops = b.points()  # those past the prefix are ignored
        start, end = seq.extend(
            prefix, stops=stops,
            cancelled=lambda: not self.jobs.empty() or self.stopping.is_set(),
        )  # fmt: skip
        self.warmed_tokens += end - start

    def _run(self, job: Job) -> tuple[Result, PooledSequence]:
        prompt, request = job.prompt, job.request
        b = prompt.boundaries
        stops = b.points()
        seq = self.pool.acquire(prompt.ids, b.generation_start)
        progress = Progress()
        thinking = prompt.text.endswith("<think>\n")  # the generation prompt opened a think block
        out, detok = OutputText(thinking, request.stop), StreamDecoder(self.engine.tokenizer)
        tokens = seq.generate(
            prompt.ids, stops=stops, sampler=Sampler(request.params), max_tokens=job.max_tokens,
            progress=progress,
        )  # fmt: skip
        try:
            for token in tokens:
                if len(progress.tokens) == 1:
                    job.emit(("first",))
                piece = detok.add(token)
                if piece:
                    self._send(job, out.add(piece))
                if out.stopped or job.cancelled.is_set() or self.stopping.is_set():
                    tokens.close()  # an early finish keeps the prompt's cache (see generate)
                    break
            else:
                self._send(job, out.add(detok.flush()))
        finally:
            tokens.close()  # settle the sequence at the valid state it reached
        self._send(job, out.flush())
        message = out.message()
        finish = progress.finish
        if out.stopped:
            finish = "stop"
        elif message.tool_calls:
            finish = "tool_calls"
        elif job.cancelled.is_set():
            finish = "cancelled"
        return Result(message, finish, len(prompt.ids), len(progress.tokens), progress.reused), seq

    @staticmethod
    def _send(job: Job, delta: tuple[str, str]) -> None:
        if delta[0] or delta[1]:
            job.emit(("delta", *delta))
