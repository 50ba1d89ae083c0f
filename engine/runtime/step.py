"""One step of the model over rows: the mechanism every decoding feature plugs into.

A row is one sequence's share of a step: its caches and the tokens scheduled for it (1 to
decode, k+1 to verify a draft, a chunk to prefill). `forward` feeds every row's tokens in one
pass and returns, per row, the logits at the trailing positions the row asked for and a `Mark`:
what `rollback` needs to bring the row's caches back to the step's start or to any position
the row asked to keep. The attention KV cache rolls back by moving its offset; the Gated
DeltaNet conv tail and state cannot be rewound, so the step records them where asked, inside
one pass (`kernels.gated_delta_kept`). `accepted` is the acceptance rule: how many proposed
tokens stand.

Rows that each decode one token run as one batched pass (the scheduler in `batch.py` makes
such steps); any other mix of rows runs as one packed pass (`model.packed`: the tokens of all
rows end to end, the products once over all of them). Sharding wraps this function alone.
`run` adds the picks: a decode row carries its sampler, and the rows' next tokens are picked
together after the pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from .cache import RecurrentCache
from .sampling import Sampler, pick_rows


@dataclass
class Row:
    """One sequence's share of a step."""

    caches: list
    tokens: Sequence[int] | mx.array  # [n] ids to feed (an array may still be lazy)
    logits: int = 1  # trailing positions whose logits the row wants (0: none)
    keep: Iterable[int] = ()  # positions inside the step (relative, 0 < p < n) to keep states at
    # A prefill chunk: the runner may feed a prefix of `tokens` only (`cut`); the Mark's end
    # says how far it went. `left`: the prompt's tokens still to feed, this row's included.
    partial: bool = False
    left: int = 0
    # A decode row's sampler and the history its processors read: `run` picks the row's next
    # token from its last logits, with the picks of the other rows (`sampling.pick_rows`).
    sampler: Sampler | None = None
    history: Sequence[int] = ()

    @property
    def size(self) -> int:
        return self.tokens.size if isinstance(self.tokens, mx.array) else len(self.tokens)

    @property
    def ids(self) -> mx.array:
        """`tokens` as an array `[n]` (one already 1-D as it is: no node added to the step)."""
        t = self.tokens
        if not isinstance(t, mx.array):
            return mx.array(t)
        return t if t.ndim == 1 else t.reshape(-1)


def cut(row: Row, n: int) -> Row:
    """`row` with its first `n` tokens only (a partial row's): the positions it keeps inside
    them stay, and the logits it asked for (its last positions') are not reached."""
    if not row.partial or not 0 < n <= row.size:
        raise ValueError(f"cannot cut a {'partial' if row.partial else 'whole'} row of "
                         f"{row.size} tokens to {n}")  # fmt: skip
    return row if n == row.size else replace(row, tokens=row.tokens[:n], logits=0)


@dataclass
class Mark:
    """Where a row's caches were before a step, and the states kept inside it."""

    start: int
    end: int
    before: list  # per layer: cache.snapshot() before the step (KV: an offset)
    kept: dict[int, list] = field(default_factory=dict)  # absolute position -> per layer


def forward(model, rows: list[Row]) -> list[tuple[mx.array | None, Mark]]:
    """Run one step for `rows`; per row, (logits `[logits, V]` or None, its Mark).

    Logits are lazy: the caller evaluates them with whatever it builds on top (sampling), so
    the step and its pick are one graph. Rows that each decode one token (past their first)
    run as one batched pass (`model.decode_rows`); any other mix as one packed pass
    (`model.packed`); a model with neither (a pipeline's) runs them row by row.
    """
    if len(rows) > 1 and all(_decoding(row) for row in rows) and hasattr(model, "decode_rows"):
        return _batched(model, rows)
    if len(rows) > 1 and hasattr(model, "packed"):
        return _packed(model, rows)
    out, marks = [], []
    with _all_or_none(rows, marks):
        for row in rows:
            ids = row.ids
            mark, keep = _begin(row, ids.shape[0])
            marks.append(mark)
            try:
                h = model.hidden(ids[None], row.caches)
                logits = model.logits(h[:, -row.logits :])[0] if row.logits else None
                _take_kept(row, mark, keep)
            finally:
                _end_capture(row.caches)
            out.append((logits, mark))
    return out


def run(model, rows: list[Row]) -> list[tuple[mx.array | None, Mark, mx.array | None]]:
    """`forward`, then the next token of each row that carries a sampler, picked together
    (`sampling.pick_rows`): per row (logits, Mark, token or None), what a step coroutine is
    sent (`generate.run_steps`, `batch.Batch`). All or none: if a pick fails, every row goes
    back to the step's start, and no sampler has taken a pick."""
    results = forward(model, rows)
    with _all_or_none(rows, [mark for _, mark in results]):
        chosen = [i for i, row in enumerate(rows) if row.sampler is not None]
        picks = pick_rows([rows[i].sampler for i in chosen], [results[i][0][-1] for i in chosen],
                          [rows[i].history for i in chosen])  # fmt: skip
    tokens: list = [None] * len(rows)
    for i, token in zip(chosen, picks):
        tokens[i] = token
    return [(logits, mark, token) for (logits, mark), token in zip(results, tokens)]


@contextlib.contextmanager
def _all_or_none(rows: list[Row], marks: list[Mark]) -> Iterator[None]:
    """No row keeps half a step: if the pass fails, every row with a mark goes back to its
    start (the layers before the failure had already written their caches)."""
    try:
        yield
    except BaseException:
        for row, mark in zip(rows, marks):
            rollback(row.caches, mark, mark.start)
        raise


def _begin(row: Row, n: int) -> tuple[Mark, list[int]]:
    """The row's Mark for a step of `n` tokens, and the positions inside it to keep (set as
    its recurrent caches' `capture`: the pass records the states there)."""
    start = row.caches[0].offset
    mark = Mark(start, start + n, [c.snapshot() for c in row.caches])
    keep = sorted(p for p in row.keep if 0 < p < n)
    for c in row.caches:
        if isinstance(c, RecurrentCache):
            c.capture = keep
    return mark, keep


def _take_kept(row: Row, mark: Mark, keep: list[int]) -> None:
    """Put the states the pass recorded at `keep` into the row's mark."""
    for p in keep:
        mark.kept[mark.start + p] = [
            c.snapshot(mark.start + p) if isinstance(c, RecurrentCache) else None
            for c in row.caches
        ]


def _end_capture(caches: list) -> None:
    for c in caches:
        if isinstance(c, RecurrentCache):
            c.capture, c.captured = [], {}


def _decoding(row: Row) -> bool:
    return row.size == 1 and row.logits == 1 and row.caches[0].offset > 0


def _batched(model, rows: list[Row]) -> list[tuple[mx.array, Mark]]:
    """One decode step for every row in one pass: per row, logits `[1, V]` and its Mark."""
    ids = mx.concatenate([r.ids for r in rows])
    marks = [Mark(r.caches[0].offset, r.caches[0].offset + 1, [c.snapshot() for c in r.caches])
             for r in rows]  # fmt: skip
    with _all_or_none(rows, marks):
        logits = model.logits(model.decode_rows(ids, [r.caches for r in rows])[:, 0])
    return [(logits[i : i + 1], mark) for i, mark in enumerate(marks)]


def _packed(model, rows: list[Row]) -> list[tuple[mx.array | None, Mark]]:
    """Any mix of rows (prefill chunks, decode steps, verify passes) in one pass, their tokens
    packed end to end (`model.packed`): the products read the weights once for all of them."""
    ids = [r.ids for r in rows]
    spans, marks, keeps, at = [], [], [], 0
    for r, row_ids in zip(rows, ids):
        spans.append((at, at + row_ids.size))
        at += row_ids.size
        mark, keep = _begin(r, row_ids.size)
        marks.append(mark)
        keeps.append(keep)
    try:
        with _all_or_none(rows, marks):
            packed = mx.concatenate(ids)
            h = model.packed(packed, spans, [r.caches for r in rows])
            wanted = [(e, r.logits) for (_, e), r in zip(spans, rows) if r.logits]
            logits = None
            if wanted:  # the LM head over the positions the rows asked for only
                logits = model.logits(h[mx.concatenate([mx.arange(e - n, e) for e, n in wanted])])
            out, taken = [], 0
            for r, mark, keep in zip(rows, marks, keeps):
                _take_kept(r, mark, keep)
                row_logits = None
                if r.logits:
                    row_logits, taken = logits[taken : taken + r.logits], taken + r.logits
                out.append((row_logits, mark))
    finally:
        for r in rows:
            _end_capture(r.caches)
    return out


def rollback(caches: list, mark: Mark, pos: int) -> None:
    """Bring `caches` back to `pos`: the mark's start, a position it kept, or its end (a no-op)."""
    if pos == mark.end:
        return
    if pos == mark.start:
        for c, state in zip(caches, mark.before, strict=True):
            c.restore(state)
        return
    if pos not in mark.kept:
        raise ValueError(f"the step kept no state at {pos} (kept: {sorted(mark.kept)})")
    for c, state in zip(caches, mark.kept[pos], strict=True):
        c.restore(pos if state is None else state)  # KV layers: trim to pos


def accepted(proposed: Sequence[int], picked: Sequence[int], stop_ids: Iterable[int] = ()) -> int:
    """How many of `proposed` stand: the longest prefix the model agrees with (`picked[i]` is
    the model's token where `proposed[i]` stands), cut after the first stop token."""
    stops = set(stop_ids)
    n = 0
    for want, got in zip(proposed, picked):
        if want != got:
            break
        n += 1
        if want in stops:
            break
    return n
