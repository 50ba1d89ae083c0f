"""The one thread per engine that does all MLX work; other threads submit jobs to it.

MLX gives each thread its own default stream: a lazy array made on one thread cannot be
evaluated on another, and a thread's stream is never freed (on Metal each is a command queue).
So every computation on an engine's model (session turns, warm-up, the server's requests,
state capture for the disk) runs as a `Job` on its `ModelThread`, under `engine.lock`;
callers get Python values back (token ids, text, numpy arrays).

Four ways in: `call` runs a function and returns its result; `submit` queues a job whose
function reports by itself; `iterate` runs a generator there step by step for a consumer on
another thread (the consumer's pace, so closing it stops the work at the next item); `spawn`
runs a generator there at the thread's own pace, handing each item to a callback (the server).

Generators run as tasks, interleaved: each gets a turn in order, and runs until it yields
`batch.WAIT` (its row, a decode step or a prefill chunk, waits for a pass), ends, or its
consumer takes no more items, handing over at most `ITEMS_PER_TURN` items. After every round
the thread runs one pass for all the rows waiting (`batch.Batch`), so concurrent generations
prefill and decode together. (A turn that ended at the first item would leave a
task that hands over more items for some token, such as its first or one that completes no
text, a turn behind the others: its row would miss their step, and from then on the rows
would step alone, in turns.) At most `max_tasks` run at once; more wait in
order. A plain job runs whole when its turn comes; a background job (idle-time warm-up) waits
until no task runs, and yields at its next chunk to any queued job: `should_yield()`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import mlx.core as mx

from kernels import subnormals

DEFAULT_MAX_TASKS = 8  # generations interleaved at once (the batch width they can reach)
# Items a task may hand over in one turn before the others get theirs: a token brings at most
# a few (its text, logprobs, the first-token notice); a generator that yields items without
# WAITs (one that runs its passes itself) lets the others in this often.
ITEMS_PER_TURN = 4
# How long a batched step waits for the rows of generations whose consumers (other threads,
# one item at a time: `iterate`) are taking their last item: a thread that holds the GIL can
# keep them from asking until it blocks; a consumer slower than this is stepped next time.
GATHER_S = 0.002

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class WorkerStopped(RuntimeError):
    """The engine's model thread has stopped (the engine was closed, or the process exits)."""


class Job:
    """One unit of work for the model thread: `fn(job)`, its outcome, its cancel flag."""

    def __init__(self, fn: Callable[[Job], Any], *, background: bool = False):
        self.fn = fn
        self.background = background  # idle-time work: yields to any queued job
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.started = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.on_drop: Callable[[BaseException], None] | None = None  # told if never run
        self.wake: Callable[[], None] | None = None  # wakes the thread it was submitted to

    def drop(self, error: BaseException) -> None:
        """End a job that will never run (the thread stopped first)."""
        self.error = error
        try:
            if self.on_drop is not None:
                self.on_drop(error)
        except Exception:  # the caller's callback: the other jobs must still hear it
            log.exception("a dropped job's callback failed")
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Ask the job to stop: it checks at its next token or chunk (or skips if not started)."""
        self.cancelled.set()
        if self.wake is not None:
            self.wake()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    join = wait  # a warm-up handle used to be a Thread

    def is_alive(self) -> bool:
        return not self.done.is_set()

    def outcome(self):
        """The result, or the job's exception re-raised on the caller's thread."""
        if self.error is not None:
            raise self.error
        return self.result


class ModelThread:
    """Runs jobs one at a time on one long-lived daemon thread, under `lock`.

    Holds no reference to the engine (only its lock), so an engine that goes away can stop it
    from a finalizer.
    """

    def __init__(self, lock: threading.RLock, name: str = "chatml-model", *, batch=None,
                 max_tasks: int = DEFAULT_MAX_TASKS):  # fmt: skip
        if max_tasks < 1:
            raise ValueError(f"max_tasks must be at least 1, got {max_tasks}")
        self.lock = lock
        self.batch = batch  # batch.Batch: the decode rows the tasks file (None: no batching)
        self.max_tasks = max_tasks
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.idle = threading.Event()  # set while waiting for a job with none queued
        self.stopping = threading.Event()
        self._wake = threading.Event()  # something to do: a job, a consumer's request, a stop
        # Held by `submit` from its check to its put, and by the stopped thread for its last
        # look at the queue: a job is either refused, or queued before that look (dropped).
        self._gate = threading.Lock()
        self._tasks: list[_Task] = []  # running generators, in turn order
        self._waiting: deque[_Task] = deque()  # started by their callers, over max_tasks
        self._later: deque[Job] = deque()  # background jobs, until no task runs
        self._stream_owners: set[int] = set()  # threads consuming an open `iterate`
        self._turn: _Task | None = None  # the task whose turn it is
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ----- state --------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.stopping.is_set()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def queued(self) -> int:
        """Jobs waiting to start (not counting those running)."""
        return self.jobs.qsize() + len(self._waiting)

    def running(self) -> int:
        """Generators running now (interleaved)."""
        return len(self._tasks)

    def should_yield(self) -> bool:
        """True when background work should stop at its next chunk: a job waits, a task
        runs, or we stop."""
        return not self.jobs.empty() or bool(self._tasks) or self.stopping.is_set()

    # ----- submitting -----------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        if self.stopping.is_set():
            raise WorkerStopped("the engine's model thread has stopped (engine closed)")
        if threading.get_ident() in self._stream_owners:
            # Work behind its own open stream would see the model mid-answer (or, for a job
            # that waits, never run before the stream moves on).
            raise RuntimeError(
                "this thread has an unfinished stream on the engine: finish or close it before "
                "starting other work on the model"
            )
        job.wake = self._wake.set
        with self._gate:
            if self.stopping.is_set():  # stopped since the check above
                raise WorkerStopped("the engine's model thread has stopped (engine closed)")
            self.jobs.put(job)
        self._wake.set()
        return job

    def call(self, fn: Callable[..., R], *args, **kwargs) -> R:
        """Run `fn(*args, **kwargs)` on the model thread and return its result (or raise)."""
        return self.run(Job(lambda job: fn(*args, **kwargs)))

    def run(self, job: Job):
        """Run `job` on the model thread, wait for it and return its result (or raise)."""
        if self.on_thread():
            return job.fn(job)
        self.submit(job)
        try:
            job.wait()
        except BaseException:  # Ctrl+C while waiting: the job stops at its next check
            job.cancel()
            raise
        return job.outcome()

    def iterate(self, make: Callable[[], Generator[T, None, R]]) -> Generator[T, None, R]:
        """Run the generator `make()` on the model thread, one item per `next` of the caller.

        Yields what it yields and returns what it returns; its exceptions are re-raised here.
        Closing this generator (or an exception in the caller while it waits) closes the one
        on the model thread before returning, so its cleanup has run when the caller goes on.
        """
        if self.on_thread():
            return (yield from self._inline(make()))
        link = _Link(self)
        job = _Task(make, link.ready, link.reply, link.end)
        job.on_drop = lambda error: link.replies.put(("raise", error))
        owner = threading.get_ident()
        self.submit(job)
        self._stream_owners.add(owner)
        try:
            while True:
                kind, value = link.ask()
                if kind == "yield":
                    yield value
                elif kind == "return":
                    return value
                else:
                    raise value
        finally:
            self._stream_owners.discard(owner)
            link.finish(job)

    def spawn(self, make: Callable[[], Generator], on_item: Callable[[Any], None],
              on_end: Callable[[str, Any], None]) -> Job:  # fmt: skip
        """Run the generator `make()` on the model thread at the thread's pace: `on_item(x)`
        for each item, then `on_end("return", value)`, `on_end("raise", error)` or, after
        `job.cancel()`, `on_end("cancelled", None)` (its cleanup has run). Both are called on
        the model thread."""
        job = _Task(make, lambda: True, on_item, on_end)
        job.on_drop = lambda error: on_end("raise", error)
        return self.submit(job)

    # ----- lifetime -------------------------------------------------------------------------

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the running job (background work yields at once); queued jobs are
        dropped, and running generators are closed (their consumers hear WorkerStopped)."""
        self.stopping.set()
        self.jobs.put(None)
        self._wake.set()
        if not self.on_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        # Before the first MLX call: the stream thread MLX starts for this thread, which runs its
        # CPU ops, copies this thread's floating-point mode (kernels/subnormals.py).
        subnormals.flush_on_this_thread()
        try:
            self._serve()
        finally:
            # Free this thread's MLX streams before the thread ends: a stream left behind
            # leaks (a command queue on Metal) and can abort the process at exit.
            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            self._wake.clear()  # before looking: a request that comes after wakes the wait
            busy = self._take_jobs()
            busy |= self._advance_all()
            if self.batch is not None and self.batch.pending:
                self._gather([t for t in self._tasks if t.behind])
                with self.lock:
                    self.batch.step()  # a failed row's error goes to its task, not here
                busy = True
            if not self._tasks and self._later and self.jobs.empty():
                self._run(self._later.popleft())
                busy = True
            if not busy:
                if not (self._tasks or self._waiting or self._later):
                    self.idle.set()  # nothing started and nothing left: truly idle
                self._wake.wait()
                self.idle.clear()
        for task in self._tasks:  # stopped under running generators: close them there
            with self.lock:
                task.close(WorkerStopped("the engine's model thread stopped"))
        # Jobs queued behind the stop never run: tell their callers. (Past the gate, no
        # submit is half-way: any later one sees `stopping` and is refused.)
        dropped = [*self._waiting, *self._later]
        with self._gate:
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    dropped.append(job)
        for job in dropped:
            job.drop(WorkerStopped("the engine's model thread stopped before this job ran"))

    def _advance_all(self) -> bool:
        """One round of the running tasks. A method of its own so that no loop variable in
        `_serve` holds the last task while the thread waits: that task's closure holds its
        engine, which then could never be collected (nor this thread stopped by its finalizer)."""
        busy = False
        for task in list(self._tasks):
            busy |= self._advance(task)
        return busy

    def _take_jobs(self) -> bool:
        """Start what was submitted: tasks join the round (up to max_tasks), plain jobs run
        now, background jobs wait for a moment without tasks. True if anything started."""
        started = False
        for task in [t for t in self._waiting if t.cancelled.is_set()]:
            self._waiting.remove(task)  # its consumer left before it started: end it now
            self._start(task)
        while self._waiting and len(self._tasks) < self.max_tasks:
            started |= self._start(self._waiting.popleft())
        while not self.stopping.is_set():
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                break
            if isinstance(job, _Task):
                if len(self._tasks) < self.max_tasks:
                    started |= self._start(job)
                else:
                    self._waiting.append(job)
            elif job.background and (self._tasks or self._waiting):
                self._later.append(job)
            else:
                self._run(job)
                started = True
        return started

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # its caller gave up before it started (`cancel`): skip
            job.done.set()
            return
        job.started = True
        with self.lock:
            try:
                job.result = job.fn(job)
            except BaseException as e:  # handed to the caller; the thread keeps serving
                job.error = e
        job.done.set()

    def _start(self, task: _Task) -> bool:
        task.started = True
        with self.lock:
            self._turn = task
            try:
                began = task.begin()
            finally:
                self._turn = None
        if began:
            self._tasks.append(task)
        return began

    def _inline(self, gen: Generator) -> Generator:
        """A generator run inside the running job: its WAITs are served here."""
        from .batch import WAIT

        with contextlib.closing(gen):
            try:
                item = next(gen)
                while True:
                    if item is WAIT:
                        if self.batch is not None and self.batch.pending:
                            self.batch.step()
                        item = next(gen)
                    else:
                        item = gen.send((yield item))
            except StopIteration as stop:
                return stop.value

    def in_task(self) -> bool:
        """True inside a task's turn on this thread: work there may yield `batch.WAIT`."""
        return self._turn is not None and self.on_thread()

    def _gather(self, behind: list[_Task]) -> None:
        """Before a batched step: give the tasks `behind` (their consumers, on other threads,
        are taking the item just handed over) up to GATHER_S to ask for the next one, and
        their turns, so that their rows join this step rather than each stepping alone. A
        consumer that asked already (during a later task's turn, which may have waited for
        the last pass to compute) gets its turn at once: left out, its row would wait a
        whole pass, and with a prefill's chunk always waiting, decoders took turns."""
        deadline = time.monotonic() + GATHER_S
        while behind and not self.stopping.is_set():
            for task in [t for t in behind if t.ready() or t.cancelled.is_set()]:
                behind.remove(task)
                if task in self._tasks:
                    self._advance(task)
                    if task.behind and not task.ready():
                        behind.append(task)  # handed over another item
            left = deadline - time.monotonic()
            if not behind:
                return
            if left <= 0:
                for task in behind:  # away longer: not waited for again until it comes back
                    task.behind = False
                return
            self._wake.clear()  # an ask after this wakes the wait (asks set it)
            if not any(t.ready() for t in behind):
                self._wake.wait(left)

    def _advance(self, task: _Task) -> bool:
        """Give `task` its turn (see the module's docstring); True if it did anything."""
        progressed = False
        with self.lock:
            self._turn = task
            try:
                for _ in range(ITEMS_PER_TURN):
                    state = task.advance()
                    progressed |= state != "idle"
                    if state != "idle":
                        task.behind = state == "item"
                    if state != "item":
                        break
            finally:
                self._turn = None
        if state == "end":
            self._tasks.remove(task)
        return progressed


_STOPPED = "the stream was closed"


class _Task(Job):
    """A generator run on the model thread a piece at a time, interleaved with other tasks.

    `ready()` says whether its consumer wants an item; `deliver(item)` hands one over;
    `end(kind, value)` reports how it ended ("return", "raise" or "cancelled").
    """

    def __init__(self, make, ready, deliver, end):
        super().__init__(lambda job: None)
        self.make, self.ready, self.deliver, self.end = make, ready, deliver, end
        self.gen: Generator | None = None
        # Its last move handed over an item (not a WAIT): its consumer may be about to ask
        # for the next, and a batched step waits a moment for it (`ModelThread._gather`).
        self.behind = False

    def begin(self) -> bool:
        """Make the generator; False if the task ended before it began."""
        if self.cancelled.is_set():
            self._finish("cancelled", None)
            return False
        try:
            self.gen = self.make()
        except BaseException as e:
            self._finish("raise", e)
            return False
        return True

    def advance(self) -> str:
        """Run until an item is delivered ("item"), a WAIT ("wait") or the end ("end");
        "idle" if its consumer wants no item now."""
        from .batch import WAIT

        if self.cancelled.is_set():
            self.close(None)
            return "end"
        if not self.ready():
            return "idle"
        try:
            item = next(self.gen)
        except StopIteration as stop:
            self._finish("return", stop.value)
            return "end"
        except BaseException as e:
            self._finish("raise", e)
            return "end"
        if item is WAIT:
            return "wait"
        try:
            self.deliver(item)
        except BaseException as e:  # the consumer's callback failed: the task ends with it
            self.close(e)
            return "end"
        return "item"

    def close(self, error: BaseException | None) -> None:
        """Close the generator here (its cleanup runs on this thread) and report the end."""
        try:
            if self.gen is not None:
                self.gen.close()
        except BaseException as e:  # the generator's cleanup failed
            self._finish("raise", e)
            return
        self._finish("cancelled" if error is None else "raise", error)

    def _finish(self, kind: str, value) -> None:
        if self.done.is_set():
            return
        if kind == "return":
            self.result = value
        elif kind == "raise":
            self.error = value
        try:
            self.end(kind, value)
        except Exception:  # the caller's callback (`spawn`): it ends this task, not the thread
            log.exception("a task's end callback failed")
        finally:
            self.done.set()


class _Link:
    """The two queues between a generator on the model thread and its consumer elsewhere."""

    def __init__(self, worker: ModelThread):
        self.worker = worker
        self.asked = threading.Event()  # the consumer waits for an item
        self.replies: queue.Queue[tuple[str, Any]] = queue.Queue()

    def ask(self) -> tuple[str, Any]:
        self.asked.set()
        self.worker._wake.set()
        return self.replies.get()

    def ready(self) -> bool:
        return self.asked.is_set()

    def reply(self, item) -> None:
        self.asked.clear()  # before the reply: the consumer's next ask comes after it
        self.replies.put(("yield", item))

    def end(self, kind: str, value) -> None:
        if kind == "return":
            self.replies.put(("return", value))
        elif kind == "raise":
            self.replies.put(("raise", value))
        else:  # a consumer that asks again (the thread was stopped under it) hears so
            self.replies.put(("raise", WorkerStopped(_STOPPED)))

    def finish(self, job: _Task) -> None:
        """The consumer is done: close the generator there (if still open) and wait for it."""
        job.cancel()
        self.worker._wake.set()
        if not self.worker.on_thread():
            job.wait()
