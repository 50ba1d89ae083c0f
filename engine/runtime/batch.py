"""Continuous batching: the rows of every running generation decode together.

Each generation runs its own prefill and decode loops (`generate.prefill_steps` and
`decode_steps`, the loops every caller shares), as a task on the engine's model thread
(`worker.py`); a speculative answer's loop (`speculative.speculate_steps`) too. When a loop
needs a pass (a prefill chunk, a decode step, a verify of drafts) it files its row here and
its task yields `WAIT`; once every task has had its turn, the worker runs
`Batch.step`: one forward pass for all the rows filed (`step.forward` stacks rows that each
decode one token, and packs any other mix end to end), and each loop takes its logits and
goes on. Rows join the moment their prompt is in and leave when they finish, without waiting
for the others. A pass runs at most `pass_tokens` tokens: the decode rows, then prompts'
chunks cut to the room left (`Batch._take`), so rows keep streaming while a long prompt is
prefilled, each stalled for one bounded pass at a time, and prompts that arrive together
prefill in the same passes.

Every row keeps its own caches (a row's KV cache has its own length; each row's Gated
DeltaNet state is read and written as its own array by the fused CPU kernel, stacked for the
step and split back elsewhere), so reuse, snapshots and rollback stay per sequence exactly
as at batch 1. The rows' next tokens are picked together after the pass (`step.run`), each
with its own sampler: one draw per group of rows that share their cuts.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .cache import RecurrentCache
from .generate import decode_steps, settle
from .step import Mark, Row, cut, rollback, run

DEFAULT_MAX_BATCH = 8
# Tokens in one pass at most: a pass that prefills stalls every row decoding beside it, for
# as long as its tokens take (256: ~1.9 s for the 0.8B float32 on 2 CPU cores, within 2% of
# the best prefill speed, which 512-token chunks reach; see BENCHMARKS "The pass budget").
DEFAULT_PASS_TOKENS = 256
MIN_CUT = 32  # a prefill chunk cut shorter than this waits for the next pass instead
PATIENCE = 8  # passes a prompt waits while others with less left go first; then it goes first


class _Wait:
    """Yielded by a task on the model thread: "nothing for my consumer yet; run the others"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()


@dataclass
class _Arrival:
    """One step coroutine's place in the batch's queue, shared by all its rows' tickets."""

    order: int  # when it came: of prompts with as much left, the older goes first
    passed_over: int = 0  # passes in a row that ran without its waiting prefill chunk


@dataclass
class _Ticket:
    row: Row
    arrival: _Arrival
    result: tuple[mx.array | None, Mark, mx.array | None] | None = None  # `step.run`'s
    error: BaseException | None = None  # the step failed for this row: raised in its loop


class Batch:
    """The rows waiting for the next decode step of one model. Model thread only."""

    def __init__(self, model, max_rows: int = DEFAULT_MAX_BATCH,
                 pass_tokens: int = DEFAULT_PASS_TOKENS):  # fmt: skip
        if max_rows < 1:
            raise ValueError(f"a batch needs at least one row, got {max_rows}")
        if pass_tokens < 1:
            raise ValueError(f"a pass needs at least one token, got {pass_tokens}")
        self.model = model
        self.max_rows = max_rows
        self.pass_tokens = pass_tokens
        self._waiting: list[_Ticket] = []
        self._arrivals = itertools.count()
        self.steps = 0  # forward passes run
        self.rows = 0  # rows stepped in them (rows / steps: the mean batch size)
        self.widest = 0  # the largest batch stepped
        self.tokens = 0  # tokens run in them
        self.longest = 0  # the most tokens in one pass

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    def step(self) -> None:
        """One forward pass for the rows waiting (see `_take`)."""
        tickets = self._take()
        if not tickets:
            return
        try:
            results = run(self.model, [t.row for t in tickets])
        except Exception as e:  # the rows are back where they were: find whose it is
            if len(tickets) == 1:
                tickets[0].error = e
                return
            results = []
            for ticket in tickets:  # a row's failure never fails the others
                try:
                    results.append(run(self.model, [ticket.row])[0])
                except Exception as e:
                    ticket.error = e
                    results.append(None)
        for ticket, result in zip(tickets, results):
            if result is not None:
                ticket.result = result
        self.steps += 1
        self.rows += len(tickets)
        self.widest = max(self.widest, len(tickets))
        size = sum(t.row.size for t in tickets)
        self.tokens += size
        self.longest = max(self.longest, size)

    def _take(self) -> list[_Ticket]:
        """The next pass's rows, at most `max_rows` and `pass_tokens` tokens: first the rows
        that decode or verify (a token or a few each: the rows a long pass would stall), then
        the prefill chunks in the room left, the prompt with the fewest tokens left first
        (then the oldest): prompts that arrive together finish one by one, not all of them
        late, and a short prompt is not held behind a long one. A prompt passed over
        `PATIENCE` passes in a row goes first, so short ones arriving without end do not
        starve a long one. The last chunk taken is cut to fit (`step.cut`); what does not
        fit waits for the next pass. The first chunk gets at least `MIN_CUT` tokens whatever
        the other rows take: prefills always progress."""
        taken = [t for t in self._waiting if not t.row.partial][: self.max_rows]
        room = self.pass_tokens - sum(t.row.size for t in taken)
        first = True
        prefills = sorted((t for t in self._waiting if t.row.partial), key=lambda t: (
            t.arrival.passed_over < PATIENCE, t.row.left, t.arrival.order))  # fmt: skip
        for t in prefills:
            if first:
                room, first = max(room, min(MIN_CUT, self.pass_tokens)), False
            elif room < min(MIN_CUT, t.row.size):
                break
            if len(taken) == self.max_rows:
                break
            if t.row.size > room:
                t.row = cut(t.row, room)
            room -= t.row.size
            taken.append(t)
        chosen = set(map(id, taken))
        self._waiting = [t for t in self._waiting if id(t) not in chosen]
        for t in prefills:
            t.arrival.passed_over = 0 if id(t) in chosen else t.arrival.passed_over + 1
        return taken

    def decode(self, model, caches: list, logits: mx.array, sampler, **options) -> Iterator:
        """`generate.decode` (same arguments) with its steps batched: yields tokens, and
        `WAIT` while its row waits for a step. Closing it at any point leaves the caches
        consistent: a step that ran for a token nobody read is rolled back, and
        `caches[0].offset` says how many positions were fed."""
        if model is not self.model:
            raise ValueError("this batch steps another model")
        return self.loop(decode_steps(caches, logits, sampler, **options), caches, sampler)

    def loop(self, steps: Generator, caches: list, sampler) -> Iterator:
        """A decode loop's step coroutine on `caches` (`generate.decode_steps`,
        `speculative.speculate_steps`) served in this batch's passes (`serve`); on every way
        out the caches own their arrays and nothing lazy is left (`settle`)."""
        try:
            yield from self.serve(steps)
        finally:
            own_buffers(caches)
            settle(caches, sampler)

    def serve(self, steps: Generator) -> Generator:
        """Run a step coroutine (`generate.decode_steps`, `generate.prefill_steps`) with its
        passes in this batch's steps: yields its other items, and `WAIT` while its row waits
        for a step; returns what it returns. Closing it rolls back a step it was not given."""
        ticket, arrival = None, _Arrival(next(self._arrivals))
        try:
            item = next(steps)
            while True:
                if isinstance(item, Row):
                    ticket = _Ticket(item, arrival)
                    self._waiting.append(ticket)
                    while ticket.result is None and ticket.error is None:
                        yield WAIT
                    if ticket.error is not None:
                        error, ticket = ticket.error, None
                        raise error
                    result, ticket = ticket.result, None
                    item = steps.send(result)
                else:
                    yield item
                    item = next(steps)
        except StopIteration as done:
            return done.value
        finally:
            if ticket is not None:  # closed while its row waited for, or had, a step
                if ticket.result is None:
                    if ticket in self._waiting:
                        self._waiting.remove(ticket)
                else:
                    mark = ticket.result[1]
                    rollback(ticket.row.caches, mark, mark.start)
            steps.close()


def own_buffers(caches: list) -> None:
    """Give each recurrent cache its own arrays: after a batched step off the native CPU
    kernels the conv tails and states are slices of the batch's stacked arrays, which would
    keep the whole batch's alive (and uncounted). Arrays already their own stay as they are,
    the same objects: a snapshot holding one is then seen to share it (snapshot.held_bytes)."""
    # (isinstance: a pipeline's remote layers hold handles, not arrays; see shard.py)
    layers = [c for c in caches if isinstance(c, RecurrentCache) and isinstance(c.state, mx.array)]
    copies = [(mx.contiguous(c.state), None if c.conv is None else mx.contiguous(c.conv))
              for c in layers]  # fmt: skip
    mx.eval(copies)
    for c, (state, conv) in zip(layers, copies):
        c.state = _same_or(c.state, state)
        if conv is not None:
            c.conv = _same_or(c.conv, conv)


def _same_or(a: mx.array, copy: mx.array) -> mx.array:
    """`a` where `mx.contiguous` shared its buffer (it copies only a view into a larger one),
    else the copy: the buffer's address tells (reading it through the buffer protocol takes
    ~1 us and copies nothing; a strided view has none to read, and is copied)."""
    try:
        shared = np.frombuffer(a, np.uint8).ctypes.data == np.frombuffer(copy, np.uint8).ctypes.data
    except BufferError:
        return copy
    return a if shared else copy
