"""Continuous batching: the rows of every running generation decode together.

Each generation runs its own prefill and decode loops (`generate.prefill_steps` and
`decode_steps`, the loops every caller shares), as a task on the engine's model thread
(`worker.py`). When a loop needs a pass (a prefill chunk, a decode step) it files its row
here and its task yields `WAIT`; once every task has had its turn, the worker runs
`Batch.step`: one forward pass for all the rows filed (`step.forward` stacks rows that each
decode one token, and packs any other mix end to end), and each loop takes its logits and
goes on. Rows join the moment their prompt is in and leave when they finish, without waiting
for the others; a prompt's chunks are small while others decode, so they keep streaming, and
prompts that arrive together prefill in the same passes.

Every row keeps its own caches (a row's KV cache has its own length; each row's Gated
DeltaNet state is read and written as its own array by the fused CPU kernel, stacked for the
step and split back elsewhere), so reuse, snapshots and rollback stay per sequence exactly
as at batch 1. Sampling runs per row, with the row's own sampler.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass

import mlx.core as mx

from .cache import RecurrentCache
from .generate import decode_steps, settle
from .step import Mark, Row, forward, rollback

DEFAULT_MAX_BATCH = 8
BUSY_PREFILL_CHUNK = 128  # prefill chunk while other rows wait to decode (bounds their stall)


class _Wait:
    """Yielded by a task on the model thread: "nothing for my consumer yet; run the others"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()


@dataclass
class _Ticket:
    row: Row
    result: tuple[mx.array, Mark] | None = None
    error: BaseException | None = None  # the step failed for this row: raised in its loop


class Batch:
    """The rows waiting for the next decode step of one model. Model thread only."""

    def __init__(self, model, max_rows: int = DEFAULT_MAX_BATCH):
        if max_rows < 1:
            raise ValueError(f"a batch needs at least one row, got {max_rows}")
        self.model = model
        self.max_rows = max_rows
        self._waiting: list[_Ticket] = []
        self.steps = 0  # forward passes run
        self.rows = 0  # rows stepped in them (rows / steps: the mean batch size)
        self.widest = 0  # the largest batch stepped

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    def step(self) -> None:
        """One forward pass for the rows waiting (at most `max_rows`, first come first)."""
        tickets = self._waiting[: self.max_rows]
        del self._waiting[: len(tickets)]
        if not tickets:
            return
        try:
            results = forward(self.model, [t.row for t in tickets])
        except Exception as e:  # the rows are back where they were: find whose it is
            if len(tickets) == 1:
                tickets[0].error = e
                return
            results = []
            for ticket in tickets:  # a row's failure never fails the others
                try:
                    results.append(forward(self.model, [ticket.row])[0])
                except Exception as e:
                    ticket.error = e
                    results.append(None)
        for ticket, result in zip(tickets, results):
            if result is not None:
                ticket.result = result
        self.steps += 1
        self.rows += len(tickets)
        self.widest = max(self.widest, len(tickets))

    def decode(self, model, caches: list, logits: mx.array, sampler, **options) -> Iterator:
        """`generate.decode` (same arguments) with its steps batched: yields tokens, and
        `WAIT` while its row waits for a step. Closing it at any point leaves the caches
        consistent: a step that ran for a token nobody read is rolled back, and
        `caches[0].offset` says how many positions were fed."""
        if model is not self.model:
            raise ValueError("this batch steps another model")
        steps = decode_steps(caches, logits, sampler, **options)
        try:
            yield from self.serve(steps)
        finally:
            own_buffers(caches)
            settle(caches, sampler)

    def serve(self, steps: Generator) -> Generator:
        """Run a step coroutine (`generate.decode_steps`, `generate.prefill_steps`) with its
        passes in this batch's steps: yields its other items, and `WAIT` while its row waits
        for a step; returns what it returns. Closing it rolls back a step it was not given."""
        ticket = None
        try:
            item = next(steps)
            while True:
                if isinstance(item, Row):
                    ticket = _Ticket(item)
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
                    _, mark = ticket.result
                    rollback(ticket.row.caches, mark, mark.start)
            steps.close()


def own_buffers(caches: list) -> None:
    """Give each recurrent cache its own arrays: after a batched step the conv tails (and,
    off the fused CPU kernel, the states) are slices of the batch's stacked arrays, which
    would keep the whole batch's alive (and uncounted). Arrays already their own stay as is."""
    for c in caches:
        # (isinstance: a pipeline's remote layers hold handles, not arrays; see shard.py)
        if isinstance(c, RecurrentCache) and isinstance(c.state, mx.array):
            c.state = mx.contiguous(c.state)
            if c.conv is not None:
                c.conv = mx.contiguous(c.conv)
