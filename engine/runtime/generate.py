"""The generation loop shared by the Python API, the CLI, the server and the benchmarks.

`prefill` feeds prompt ids through the model in chunks (evaluating the caches after each, so
memory stays bounded and work can stop at a chunk boundary) and computes logits only for the
last position. `decode` samples one token at a time until a stop token or the length limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx

from kernels.choice import device_kind

from .cache import RecurrentCache
from .memory import clear_between_chunks
from .model import Qwen35
from .sampling import Sampler

PREFILL_CHUNK = 512


def cache_arrays(caches: list) -> list[mx.array]:
    """Every array the caches hold, recorded states included."""
    arrays = []
    for c in caches:
        for a in (getattr(c, "keys", None), getattr(c, "values", None),
                  getattr(c, "conv", None), getattr(c, "state", None)):  # fmt: skip
            if isinstance(a, mx.array):
                arrays.append(a)
        for recorded in getattr(c, "captured", {}).values():
            arrays.extend(a for a in recorded if a is not None)
    return arrays


def eval_caches(caches: list) -> None:
    """Evaluate the caches on this thread. MLX streams are per thread: an array left lazy here
    fails when another thread evaluates it ("There is no Stream(cpu, 0) in current thread")."""
    mx.eval(cache_arrays(caches))


def chunk_ends(start: int, end: int, chunk: int = PREFILL_CHUNK) -> list[int]:
    """Chunk end positions covering (start, end], at most `chunk` apart."""
    return list(range(start + chunk, end, chunk)) + ([end] if end > start else [])


def prefill(
    model: Qwen35,
    caches: list,
    ids: Sequence[int],
    start: int,
    *,
    stops: Sequence[int] = (),
    on_stop: Callable[[int], None] | None = None,
    logits: bool = True,
    cancelled: Callable[[], bool] | None = None,
    chunk: int = PREFILL_CHUNK,
) -> tuple[mx.array | None, int]:
    """Feed `ids[start:]`; call `on_stop(pos)` after reaching each position in `stops`.

    `cancelled()` is checked before each chunk: background work stops at a chunk boundary,
    with the caches consistent at the position reached. Returns the logits `[V]` of the last
    position (None if `logits` is False or the work was cancelled) and that position.
    """
    pos = start
    recurrent = [c for c in caches if isinstance(c, RecurrentCache)]
    clear = clear_between_chunks(device_kind())
    out = None
    for end in chunk_ends(start, len(ids), chunk):
        if cancelled is not None and cancelled():
            return None, pos
        inside = sorted(s for s in stops if pos < s <= end)
        try:
            for c in recurrent:  # record the states at the stops inside this chunk
                c.capture = [s - pos for s in inside if s < end]
            x = mx.array([ids[pos:end]])
            if end == len(ids) and logits:
                out = model(x, caches, last_only=True)[0, -1]
                mx.eval(out)
            else:
                model.hidden(x, caches)  # no logits for positions nobody reads
            eval_caches(caches)
            if end < len(ids) and clear:
                mx.clear_cache()  # the next chunk allocates afresh; see memory.clear_between_chunks
            pos = end
            if on_stop is not None:
                for s in inside:
                    on_stop(s)
        finally:
            for c in recurrent:
                c.capture, c.captured = [], {}
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
    in place with the generated tokens, for the repetition penalty.

    Pipelined as mlx-lm's loop is: the next step's graph is built on the sampled token while it
    is still being computed, and queued before the token is read, so building a step (a few ms
    of Python per token) overlaps the previous step's compute. When that token turns out to end
    the answer, the step is undone (the KV offsets and recurrent arrays it replaced are put
    back; MLX arrays are immutable, so keeping them costs nothing). The first token is read
    before anything is queued behind it: it is the time to first token. A sampler that reads
    the token history (the repetition penalty) runs one step at a time.

    Every step's caches are queued with its token, and on every way out the caches are
    evaluated here, on the thread that built them: nothing lazy outlives the call.
    """
    try:
        yield from _decode(model, caches, logits, sampler, max_tokens, stop_ids, history)
    finally:
        eval_caches(caches)
        if isinstance(getattr(sampler, "key", None), mx.array):
            mx.eval(sampler.key)


def _decode(model, caches, logits, sampler, max_tokens, stop_ids, history) -> Iterator[int]:
    ahead = not getattr(sampler, "reads_history", True)
    y = sampler(logits, history)
    for i in range(max_tokens):
        last = i == max_tokens - 1
        undo = None
        if ahead and 0 < i and not last:
            undo = [c.snapshot() for c in caches]
            next_y = sampler(model(y.reshape(1, 1), caches)[0, -1], history)
            mx.async_eval(next_y, *cache_arrays(caches))
        token = y.item()
        history.append(token)
        try:
            yield token
        except GeneratorExit:  # the consumer stopped at this token: it was not fed
            _undo(caches, undo)
            raise
        if token in stop_ids or last:
            _undo(caches, undo)
            return
        if undo is None:
            y = sampler(model(mx.array([[token]]), caches)[0, -1], history)
            mx.async_eval(y, *cache_arrays(caches))
        else:
            y = next_y


def _undo(caches: list, saved: list | None) -> None:
    """Put back the caches' state from before a step fed ahead of time (None: none was)."""
    if saved is not None:
        for c, state in zip(caches, saved, strict=True):
            c.restore(state)
