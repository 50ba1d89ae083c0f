"""The generation loop shared by the Python API, the CLI, the server and the benchmarks.

Both run on `step.forward`. `prefill` feeds prompt ids through the model in chunks (evaluating
the caches after each, so memory stays bounded and work can stop at a chunk boundary) and
computes logits only for the last position. `decode` samples one token at a time until a stop
token or the length limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence

import mlx.core as mx

from kernels.choice import device_kind

from .memory import clear_between_chunks
from .model import Qwen35
from .sampling import Sampler
from .step import Row, rollback, run

PREFILL_CHUNK = 512


def cache_arrays(caches: list) -> list[mx.array]:
    """Every array the caches hold (an MTP cache's pending `ids` too)."""
    return [a for c in caches for a in (getattr(c, "keys", None), getattr(c, "values", None),
            getattr(c, "conv", None), getattr(c, "state", None), getattr(c, "ids", None))
            if isinstance(a, mx.array)]  # fmt: skip


def eval_caches(caches: list, *extra) -> None:
    """Evaluate the caches (and `extra` arrays or nested lists of them) on this thread. MLX
    streams are per thread: an array left lazy here fails when another thread evaluates it
    ("There is no Stream(cpu, 0) in current thread")."""
    mx.eval(cache_arrays(caches), *extra)


def prefill(model: Qwen35, caches: list, ids: Sequence[int], start: int, **options
            ) -> tuple[mx.array | None, int]:  # fmt: skip
    """Feed `ids[start:]` (see `prefill_steps`), each chunk's pass at once, alone; returns
    (last logits or None, position)."""
    chunks = run_steps(model, prefill_steps(caches, ids, start, **options))
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value


def prefill_steps(
    caches: list,
    ids: Sequence[int],
    start: int,
    *,
    stops: Sequence[int] = (),
    on_stop: Callable[[int, list | None], None] | None = None,
    logits: bool = True,
    cancelled: Callable[[], bool] | None = None,
    chunk: int = PREFILL_CHUNK,
) -> Generator[Row | int, tuple, tuple[mx.array | None, int]]:
    """Feed `ids[start:]`; call `on_stop(pos, layers)` after reaching each position in `stops`.

    A coroutine as `decode_steps` is: it yields a `Row` per chunk (and is sent back the row's
    `(logits, Mark, None)`: whoever runs it serves the pass, alone or packed with other rows), and
    yields the position reached after each chunk but the last, so a caller can let other work
    run between chunks. The rows are partial: a batch may feed a prefix of a chunk only, to
    keep its pass within budget (`batch.Batch`), and the next chunk starts where it stopped.
    `layers` is the per-layer state kept at `pos` inside a chunk (None: `pos` is the chunk's
    end, the live state). `cancelled()` is checked before each chunk: background work stops
    at a chunk boundary, with the caches consistent at the position reached. Returns the
    logits `[V]` of the last position (None if `logits` is False or the work was cancelled)
    and that position.
    """
    pos = start
    clear = clear_between_chunks(device_kind())
    out = None
    while pos < len(ids):
        if cancelled is not None and cancelled():
            return None, pos
        end = min(len(ids), pos + chunk)
        row = Row(caches, ids[pos:end], logits=int(end == len(ids) and logits),
                  keep=[s - pos for s in stops if pos < s < end], partial=True,
                  left=len(ids) - pos)  # fmt: skip
        step_logits, mark, _ = yield row
        end = pos + mark.end - mark.start  # where the pass stopped (a cut row: before `end`)
        inside = sorted(s for s in stops if pos < s <= end)
        if step_logits is not None:
            out = step_logits[-1]
        eval_caches(caches, list(mark.kept.values()), [] if out is None else out)
        if end < len(ids) and clear:
            mx.clear_cache()  # the next chunk allocates afresh; see memory.clear_between_chunks
        pos = end
        if on_stop is not None:
            for s in inside:
                on_stop(s, mark.kept.get(s))
        if pos < len(ids):
            yield pos
    return out, pos


def decode(
    model: Qwen35,
    caches: list,
    logits: mx.array,
    sampler: Sampler,
    *,
    max_tokens: int,
    stop_ids: Sequence[int],
    history: list[int],
) -> Iterator[int]:
    """Yield sampled tokens; each non-stop token is fed back before the next is sampled.

    The stop token is yielded (so callers can see why it ended) but never fed, and a token at
    which the consumer stops reading is not fed either. `history` (the prompt ids) is extended
    in place with the generated tokens, which the sampler's processors read; every token read
    is passed to `sampler.accept`, if it has one (stateful processors advance by it).

    Pipelined as mlx-lm's loop is: the next step is built on the sampled token while it is
    still being computed, and queued before the token is read, so building a step (a few ms of
    Python per token) overlaps the previous step's compute. When that token turns out to end
    the answer, the step is rolled back to its start (`step.rollback`). The first token is read
    before anything is queued behind it: it is the time to first token. A sampler whose pick
    depends on the tokens read on the host (`reads_history`: a grammar) runs one step at a time;
    the penalties keep their state on the device and run ahead.

    Every step's caches are queued with its token, and on every way out the caches are
    evaluated here, on the thread that built them: nothing lazy outlives the call. The steps
    run at once, at batch 1; `batch.Batch.decode` runs the same loop with other rows.
    """
    steps = decode_steps(caches, logits, sampler, max_tokens=max_tokens, stop_ids=stop_ids,
                         history=history)  # fmt: skip
    return run_loop(model, steps, caches, sampler)


def run_loop(model, steps: Generator, caches: list, sampler) -> Iterator[int]:
    """A decode loop's step coroutine on `caches` (`decode_steps`,
    `speculative.speculate_steps`) run at once, alone (`run_steps`); on every way out nothing
    lazy is left (`settle`). `batch.Batch.loop` is its batched twin."""
    try:
        yield from run_steps(model, steps)
    finally:
        settle(caches, sampler)


def run_steps(model, steps: Generator) -> Generator:
    """Serve a step coroutine's (`decode_steps`, `prefill_steps`) passes at once, alone,
    yielding its other items (tokens, positions); returns what it returns."""
    with contextlib.closing(steps):
        try:
            item = next(steps)
            while True:
                if isinstance(item, Row):
                    item = steps.send(run(model, [item])[0])
                else:
                    yield item  # a consumer that stops here closes `steps` at its token
                    item = next(steps)
        except StopIteration as done:
            return done.value


def settle(caches: list, sampler) -> None:
    """Evaluate what a decode loop leaves lazy (the caches, the sampler's random key) on this
    thread, on every way out of the loop: nothing lazy outlives it."""
    eval_caches(caches)
    if isinstance(getattr(sampler, "key", None), mx.array):
        mx.eval(sampler.key)


def decode_steps(caches, logits, sampler, *, max_tokens, stop_ids, history) -> Generator:
    """The decode loop as a coroutine: it yields a `Row` when it needs a step (and is sent
    back that row's `(logits, Mark, token)`), and yields each token (an int) as it is read.
    Whoever runs it decides how steps are served: at once (`run_steps`) or batched with other
    rows. A `Sampler` rides on the row, and the runner picks its token with the other rows'
    (`step.run`); any other callable `sampler(logits, history)` picks here."""
    ahead = not getattr(sampler, "reads_history", True)
    accept = getattr(sampler, "accept", None)
    shared = sampler if isinstance(sampler, Sampler) else None

    def step(ids) -> Generator:
        """A step for `ids`; returns (the next token, queued with the caches, the Mark)."""
        step_logits, mark, token = yield Row(caches, ids, sampler=shared, history=history)
        if token is None:
            token = sampler(step_logits[-1], history)
        mx.async_eval(token, *cache_arrays(caches))
        return token, mark

    y = sampler(logits, history)
    for i in range(max_tokens):
        last = i == max_tokens - 1
        mark = None
        if ahead and 0 < i and not last:
            next_y, mark = yield from step(y.reshape(1))
        token = y.item()
        history.append(token)
        if accept is not None:
            accept((token,))
        try:
            yield token
        except GeneratorExit:  # the consumer stopped at this token: it was not fed
            if mark is not None:
                rollback(caches, mark, mark.start)
            raise
        if token in stop_ids or last:
            if mark is not None:
                rollback(caches, mark, mark.start)
            return
        if mark is None:
            y, _ = yield from step((token,))
        else:
            y = next_y
