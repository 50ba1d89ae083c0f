"""A token sequence held in live caches, with snapshots along it: the unit of reuse.

`CachedSequence.generate(ids, ...)` is the one place a prompt meets the model: it finds the
longest prefix of `ids` the caches already hold, restores the deepest snapshot within it,
prefills only the rest (snapshotting at the given positions), then decodes. A session owns one
sequence; the server keeps a pool of them and routes each request to the best one.

Gated DeltaNet state cannot be rewound, so every rewind goes through a snapshot; the attention
KV cache is trimmed to the same position. If generation fails or is abandoned, the sequence
rolls back to its state before the call (or to a snapshot of it), never to an invalid one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from . import snapshot
from .batch import WAIT
from .generate import decode, eval_caches, prefill, prefill_steps, run_steps
from .sampling import Sampler
from .speculative import SpeculationStats, speculative_decode


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _Undo:
    tokens: list[int]
    snapshots: dict
    live: snapshot.Snapshot | None
    restored_at: int | None = None


@dataclass
class Progress:
    """Filled in by `generate` as it goes: positions and timings of the call."""

    reused: int = 0
    prefilled: int = 0
    prefill_s: float = 0.0
    first_token_at: float | None = None
    decode_s: float = 0.0
    finish: str = "length"
    tokens: list[int] = field(default_factory=list)  # generated, without the stop token
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    undo: _Undo | None = None  # the state before the call, for a caller's later rollback


class CachedSequence:
    def __init__(self, engine):
        self.engine = engine
        self.tokens: list[int] = []  # exactly the ids the live caches have consumed
        self.caches = engine.model.make_caches()
        self.snapshots: dict[int, snapshot.Snapshot] = {}
        self.filling: list[int] = []  # the ids being prefilled: snapshots past `tokens` lie on them
        # Generating now (batched with others): its live caches run ahead of `tokens`, so only
        # its snapshots may be shared, and the budget leaves its live caches alone.
        self.busy = False
        self.last_used = snapshot.tick()
        engine.budget.register(self)

    @property
    def live_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def cache_bytes(self) -> int:
        return self.live_bytes + sum(s.nbytes for s in self.snapshots.values())

    def load(self, tokens: list[int], caches: list, snapshots: dict) -> None:
        """Adopt a saved state (engine/storage/store.py): `caches` must hold exactly `tokens`."""
        with self.engine.foreground():
            self.tokens, self.caches, self.snapshots = list(tokens), caches, dict(snapshots)
            self.last_used = snapshot.tick()
            self.engine.budget.enforce(active=self)

    def prefix(self, pos: int) -> list[int]:
        """The ids up to a snapshot position or the live end (mid-prefill ones included)."""
        return list(self.tokens[:pos] if pos <= len(self.tokens) else self.filling[:pos])

    def drop_cache(self) -> None:
        self.tokens, self.snapshots = [], {}
        self.caches = self.engine.model.make_caches()

    def keep_snapshots(self, positions: Iterable[int]) -> None:
        """Drop every snapshot not at `positions` (an owner that knows which it will use)."""
        keep = set(positions)
        self.snapshots = {p: s for p, s in self.snapshots.items() if p in keep}

    def reusable(self, ids: Sequence[int], *, need_logits: bool = True, own: bool = False
                 ) -> int:  # fmt: skip
        """How many leading tokens of `ids` this sequence could restore without compute.

        With `need_logits`, the last token is always recomputed: its logits start the answer.
        To others (not `own`), a busy sequence offers its snapshots only: its live caches are
        moving, and its snapshots lie on the prompt it is answering.
        """
        shared = self.busy and not own
        target = common_prefix(self.filling if shared else self.tokens, ids)
        if need_logits:
            target = min(target, len(ids) - 1)
        if len(self.tokens) <= target and not shared:
            return len(self.tokens)
        return max((p for p in self.snapshots if p <= target), default=0)

    def generate(
        self,
        ids: list[int],
        *,
        stops: Iterable[int],
        sampler: Sampler,
        max_tokens: int,
        progress: Progress,
        ignore_eos: bool = False,
    ) -> Iterator[int]:
        """Yield generated token ids (stop token excluded); snapshot at `stops` on the way.

        `ignore_eos` generates exactly `max_tokens` tokens (benchmarks: equal work per engine).
        """
        engine = self.engine
        if self.busy:
            raise RuntimeError("this sequence is generating already")
        with engine.lock, self._busy():
            undo = progress.undo = _Undo(list(self.tokens), dict(self.snapshots), self._live())
            try:
                progress.reused = undo.restored_at = self._restore(ids)
                self.filling = ids
                progress.prefilled = len(ids) - progress.reused
                t = time.perf_counter()
                stops = sorted({p for p in stops if 0 < p <= len(ids)} | {len(ids)})
                # A task on the model thread files its chunks with the batch: they run packed
                # with the other rows' steps, and others run while it waits. Alone, the chunks
                # run at once, with a WAIT between them.
                batch = engine.batch_here()
                steps = prefill_steps(self.caches, ids, progress.reused, stops=stops,
                                      on_stop=self._snapshot)  # fmt: skip
                chunks = run_steps(engine.model, steps) if batch is None else batch.serve(steps)
                with contextlib.closing(chunks):  # closed mid-prefill: no chunk left filed
                    while True:
                        try:
                            item = next(chunks)
                        except StopIteration as done:
                            logits, _ = done.value
                            break
                        if batch is None or item is WAIT:
                            yield WAIT
                self.tokens = list(ids)
                progress.prefill_s = time.perf_counter() - t
                history = list(ids)
                stop_ids = () if ignore_eos else engine.stop_ids
                # Closed on every way out, before the bookkeeping below: decode undoes the
                # step it ran ahead on a token that is not fed (see `decode`).
                spec = getattr(engine, "speculative", None)
                if spec is not None and spec.applies(sampler):
                    loop = speculative_decode(
                        engine.model, self.caches, logits, sampler, max_tokens=max_tokens,
                        stop_ids=stop_ids, history=history, drafter=spec.drafter(),
                        policy=spec.policy, stats=progress.speculation, batch=batch,
                    )  # fmt: skip
                else:
                    run = decode if batch is None else batch.decode
                    loop = run(engine.model, self.caches, logits, sampler,
                               max_tokens=max_tokens, stop_ids=stop_ids, history=history)  # fmt: skip
                with contextlib.closing(loop) as steps:
                    for token in steps:
                        if token is WAIT:
                            yield WAIT
                            continue
                        now = time.perf_counter()
                        if progress.first_token_at is None:
                            progress.first_token_at, t = now, now
                        if token in stop_ids:
                            progress.finish = "stop"
                            break
                        progress.tokens.append(token)
                        yield token
                progress.decode_s = time.perf_counter() - t
                # Nothing lazy outlives the call: arrays are evaluated on the thread that made
                # them (the last step's conv tails otherwise abort the process at exit).
                eval_caches(self.caches)
                # The caches hold every generated token but the last one (never fed back).
                self.tokens = self._held(ids, progress.tokens)
            except GeneratorExit:
                # The consumer stopped reading mid-answer (a stop string, a disconnect), or
                # mid-prefill. That is not a failure: the caches hold what they were fed, all
                # valid. Callers that want no trace roll back with `progress.undo`.
                self.tokens = self._held(ids, progress.tokens)
                progress.finish = "cancelled"
                eval_caches(self.caches)
                self.last_used = snapshot.tick()
                engine.budget.enforce(active=self)
                raise
            except BaseException:
                self.rollback(undo)
                engine.budget.enforce(active=self)
                raise
            self.last_used = snapshot.tick()
            engine.budget.enforce(active=self)

    @contextlib.contextmanager
    def _busy(self):
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def _held(self, ids: list[int], generated: list[int]) -> list[int]:
        """The ids the caches hold: as many of the prompt and the answer as they were fed
        (a prefill stops at a chunk's end; the last token read is never fed back)."""
        return (list(ids) + generated)[: self.caches[0].offset]

    def extend(
        self,
        ids: list[int],
        *,
        stops: Iterable[int],
        cancelled: Callable[[], bool] | None = None,
        chunk: int = 128,
    ) -> tuple[int, int]:
        """Bring the caches to hold `ids` (no logits, no decoding): idle-time work.

        Stops early, consistent, when `cancelled()` turns true at a chunk boundary. Returns
        the (start, end) positions it computed.
        """
        with self.engine.lock:
            start = self._restore(ids, need_logits=False)
            self.filling = ids
            stops = sorted({p for p in stops if 0 < p <= len(ids)} | {len(ids)})
            try:
                _, end = prefill(
                    self.engine.model, self.caches, ids, start, stops=stops,
                    on_stop=self._snapshot, logits=False, cancelled=cancelled, chunk=chunk,
                )  # fmt: skip
            except BaseException:
                # A chunk died half-way: resume from the last snapshot, all of which lie on `ids`.
                pos = max(self.snapshots, default=0)
                if pos:
                    snapshot.restore(self.caches, self.snapshots[pos])
                else:
                    self.caches = self.engine.model.make_caches()
                self.tokens = list(ids[:pos])
                raise
            self.tokens = list(ids[:end])
            self.last_used = snapshot.tick()
            self.engine.budget.enforce(active=self)
            return start, end

    def rollback(self, undo: _Undo) -> None:
        """Return to the state recorded in `undo`, or to a snapshot of it.

        If the failed work went on from the old live position, nothing before the old end was
        rewritten and the old live state comes back whole. If it rewound to a snapshot at p,
        the cache above p now holds other tokens: the sequence resumes from p, with the
        snapshots at or below it. Either way the next call sees a valid cache.
        """
        p = undo.restored_at
        if p is None or p == len(undo.tokens):
            if undo.live is not None:
                snapshot.restore(self.caches, undo.live)
            else:
                self.caches = self.engine.model.make_caches()
            self.tokens, self.snapshots = undo.tokens, undo.snapshots
            return
        self.snapshots = {q: s for q, s in undo.snapshots.items() if q <= p}
        if p:
            snapshot.restore(self.caches, self.snapshots[p])
        else:
            self.caches = self.engine.model.make_caches()
        self.tokens = undo.tokens[:p]

    def _live(self) -> snapshot.Snapshot | None:
        return snapshot.take(self.caches, len(self.tokens)) if self.tokens else None

    def _snapshot(self, pos: int, layers: list | None = None) -> None:
        self.snapshots[pos] = snapshot.take(self.caches, pos, layers)
        self.engine.budget.enforce(active=self)

    def _restore(self, ids: list[int], need_logits: bool = True) -> int:
        """Bring the caches to the deepest reusable position of `ids`; returns it."""
        pos = self.reusable(ids, need_logits=need_logits, own=True)
        if pos < len(self.tokens):
            if pos:
                snapshot.restore(self.caches, self.snapshots[pos])
            else:
                self.caches = self.engine.model.make_caches()
        self.tokens = self.tokens[:pos]
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= pos}
        return pos
