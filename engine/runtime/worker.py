"""The one thread per engine that does all MLX work; other threads submit jobs to it.

MLX gives each thread its own default stream: a lazy array made on one thread cannot be
evaluated on another, and a thread's stream is never freed (on Metal each is a command queue).
So every computation on an engine's model (session turns, warm-up, the server's requests,
state capture for the disk) runs as a `Job` on its `ModelThread`, in order, under
`engine.lock`; callers get Python values back (token ids, text, numpy arrays).

Three ways in: `call` runs a function and returns its result; `iterate` runs a generator there
step by step for a consumer on another thread (the consumer's pace, so closing it stops the
work at the next item); `submit` queues a job whose function reports by itself (the server).
A job marked background (idle-time warm-up) yields at its next chunk to any queued job:
`should_yield()`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import mlx.core as mx

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

    def drop(self, error: BaseException) -> None:
        """End a job that will never run (the thread stopped first)."""
        self.error = error
        if self.on_drop is not None:
            self.on_drop(error)
        self.done.set()

    def cancel(self) -> None:
        """Ask the job to stop: it checks at its next token or chunk (or skips if not started)."""
        self.cancelled.set()

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

    def __init__(self, lock: threading.RLock, name: str = "chatml-model"):
        self.lock = lock
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.idle = threading.Event()  # set while waiting for a job with none queued
        self.stopping = threading.Event()
        self._stream_owner: int | None = None  # the thread consuming the running `iterate`
        self._link: _Link | None = None  # the running `iterate`'s link (stop closes it)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ----- state --------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.stopping.is_set()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def queued(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return self.jobs.qsize()

    def should_yield(self) -> bool:
        """True when background work should stop at its next chunk: a job waits, or we stop."""
        return not self.jobs.empty() or self.stopping.is_set()

    # ----- submitting -----------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        if self.stopping.is_set():
            raise WorkerStopped("the engine's model thread has stopped (engine closed)")
        if self._stream_owner == threading.get_ident():
            # Its open stream holds the model thread, waiting for this thread: a deadlock.
            raise RuntimeError(
                "this thread has an unfinished stream on the engine: finish or close it before "
                "starting other work on the model"
            )
        self.jobs.put(job)
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
            return (yield from make())
        link = _Link(make, threading.get_ident(), self)
        job = Job(link.serve)
        job.on_drop = lambda error: link.replies.put(("raise", error))
        self.submit(job)
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
            link.finish(job)

    # ----- lifetime -------------------------------------------------------------------------

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the running job (background work yields at once); queued jobs are dropped."""
        self.stopping.set()
        self.jobs.put(None)
        link = self._link
        if link is not None:  # an open stream whose consumer is gone (exit): close it
            link.requests.put("close")
        if not self.on_thread():
            self._thread.join(timeout)

    def _next(self) -> Job | None:
        if self.jobs.empty():
            self.idle.set()
        job = self.jobs.get()
        self.idle.clear()
        return job

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            # Free this thread's MLX streams before the thread ends: a stream left behind
            # leaks (a command queue on Metal) and can abort the process at exit.
            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            if self.stopping.is_set():
                job.drop(WorkerStopped("the engine's model thread stopped before this job ran"))
                continue
            job.started = True
            with self.lock:
                try:
                    job.result = job.fn(job)
                except BaseException as e:  # handed to the caller; the thread keeps serving
                    job.error = e
            job.done.set()
        # Jobs queued behind the stop never run: tell their callers.
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.drop(WorkerStopped("the engine's model thread stopped before this job ran"))


class _Link:
    """The two queues between a generator on the model thread and its consumer elsewhere."""

    def __init__(self, make: Callable[[], Generator], owner: int, worker: ModelThread):
        self.make, self.owner, self.worker = make, owner, worker
        self.requests: queue.Queue[str] = queue.Queue()
        self.replies: queue.Queue[tuple[str, Any]] = queue.Queue()

    def ask(self) -> tuple[str, Any]:
        self.requests.put("next")
        return self.replies.get()

    def finish(self, job: Job) -> None:
        """The consumer is done: close the generator there (if still open) and wait for it."""
        job.cancel()
        self.requests.put("close")
        if not self.worker.on_thread():
            job.wait()

    def serve(self, job: Job) -> None:
        """On the model thread: advance the generator when asked, until it ends or is closed."""
        if job.cancelled.is_set():
            return  # the consumer left before the job started
        self.worker._stream_owner, self.worker._link = self.owner, self
        try:
            gen = self.make()
            while True:
                if self.requests.get() == "close" or job.cancelled.is_set():
                    gen.close()  # its cleanup (a rollback) runs here, on the model thread
                    # A consumer that asks again (the thread was stopped under it) hears so.
                    self.replies.put(("raise", WorkerStopped("the stream was closed")))
                    return
                try:
                    item = next(gen)
                except StopIteration as stop:
                    self.replies.put(("return", stop.value))
                    return
                except BaseException as e:
                    self.replies.put(("raise", e))
                    return
                self.replies.put(("yield", item))
        except BaseException as e:  # `make()` failed, or the generator's cleanup did
            self.replies.put(("raise", e))
        finally:
            self.worker._stream_owner, self.worker._link = None, None
