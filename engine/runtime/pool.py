"""A pool of cached token sequences shared by stateless requests (`Engine.chat`, the server).

Every request carries its whole conversation, so reuse is found by token ids alone: a request
goes to the sequence that can restore the longest prefix of its prompt. A conversation that
continues (the previous prompt up to its answer's `<|im_start|>assistant\\n`) takes that
sequence over in place; a request that branches off earlier (another conversation with the
same system prompt, an edited message) gets a copy of the shared prefix in another slot, so the
conversation it branched from keeps its cache. All sequences count against `engine.budget`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from .cache import KVCache, MTPCache
from .generate import eval_caches
from .sequence import CachedSequence, common_prefix
from .shard import RemoteKVCache
from .snapshot import held_bytes, tick

# Conversations kept resumable. The byte budget is what bounds their memory (it evicts the
# least recently used snapshots and idle live caches first); this only caps the slots. Fewer
# than the clients a server has (e.g. 16 agents against a batch of 8) and each conversation's
# next turn finds its slot taken and prefills from scratch.
DEFAULT_SEQUENCES = 32

# A prompt that leaves a cached one this many tokens past the last snapshot below the fork
# snapshots there too (see `SequencePool.branch_point`): a third prompt on the same prefix
# resumes there. The snapshot costs tens of ms and its bytes under the budget; the prefill it
# spares costs more from a few dozen tokens on (BENCHMARKS.md, "Prefill").
BRANCH_MIN = 64

# Inside a long new message (a pasted document) or system block, a request also snapshots
# every `GRID` tokens of it, the last `GRID_POINTS` of those points before its end
# (`grid_points`, `stateless.snapshot_points`): the second prompt that forks inside it
# (another question on the document, an edit of the question under it, a system prompt with
# another date at its end) resumes at most `GRID` tokens before the fork instead of
# prefilling all of it. Each point costs a snapshot's bytes under the budget (the recurrent state:
# ~19 MB on the 0.8B) and a few ms; the points closest to the end are the ones a question
# after the document forks past.
GRID = 256
GRID_POINTS = 4


def grid_points(first: int, end: int) -> set[int]:
    """The last `GRID_POINTS` positions `first + GRID * i` (i >= 1) below `end`."""
    count = (end - first - 1) // GRID
    return {first + GRID * i for i in range(max(1, count - GRID_POINTS + 1), count + 1)}


class PooledSequence(CachedSequence):
    """A CachedSequence with the pool's bookkeeping."""

    spillable = True  # evicted state goes to the engine's disk cache, if it has one

    def __init__(self, engine):
        super().__init__(engine)
        self.stamp = 0  # pool recency (LRU among sequences)
        # End of the last served prompt's generation head: what lies beyond it is only that
        # prompt's answer, which the next turn of the same conversation re-renders anyway.
        self.protected = 0
        self.warmed = (0, 0)  # positions the last idle-time warm-up computed (for stats)


def fork(src: CachedSequence, pos: int, dst: CachedSequence) -> None:
    """Make `dst` hold `src`'s first `pos` tokens (a snapshot of `src` or its live end).

    The KV rows below `pos` are copied out of `src`'s buffer (still valid: `src` has not rewound
    below its snapshots); recurrent layers take the snapshot's immutable arrays by reference.
    `dst` shares `src`'s snapshots at or below `pos` (the budget counts each once).
    """
    if pos == len(src.tokens) and not src.busy:
        layers = [c.snapshot() for c in src.caches]
    else:
        layers = src.snapshots[pos].layers
        src.snapshots[pos].touch()  # used: recent for the budget's LRU
    dst.drop_cache()
    for d, s, layer in zip(dst.caches, src.caches, layers):
        if isinstance(d, RemoteKVCache):  # a pipeline's follower rank holds the rows
            continue
        if isinstance(d, KVCache):
            d.load_state(s.keys[:, :, :pos], s.values[:, :, :pos])
        elif isinstance(d, MTPCache):  # rows below pos - L, L hidden states (cache.MTPCache)
            ids, state, _ = layer
            n = pos - (0 if state is None else state.shape[1])
            rows = (s.keys[:, :, :n], s.values[:, :, :n]) if s.keys is not None and n else None
            d.load_state(*(rows or (None, None)), ids, state, pos)
        else:
            d.restore(layer)
    if any(isinstance(d, RemoteKVCache) for d in dst.caches):
        src.engine.model.fork_kv(src.caches, dst.caches, pos)
    eval_caches(dst.caches)  # materialize the copies now, before `src` moves on
    dst.tokens = src.prefix(pos)
    dst.snapshots = {p: snap for p, snap in src.snapshots.items() if p <= pos}


class SequencePool:
    """Up to `size` cached sequences; `acquire` routes a prompt to the best one.

    Not thread-safe: only the engine's model thread uses it.
    """

    def __init__(self, engine, size: int = DEFAULT_SEQUENCES):
        if size < 1:
            raise ValueError(f"the pool needs at least one sequence, got {size}")
        self.engine = engine
        self.size = size
        self.sequences: list[PooledSequence] = []
        self._clock = itertools.count(1)
        self.forks = 0
        self.restores = 0  # prefixes read back from the disk cache

    def acquire(self, ids: Sequence[int], generation_start: int | None) -> PooledSequence:
        """The sequence to generate `ids` on: the one reusing the most (ties: least recent).

        If nothing is reusable, a new slot or the least recently used one. If the best one would
        have to discard cached work beyond its last answer, its prefix is forked into another
        slot instead (when there is one).
        """
        best, reuse = None, 0
        for seq in sorted(self.sequences, key=lambda s: s.stamp):  # oldest first: ties -> LRU
            r = seq.reusable(ids)
            if r > reuse:
                best, reuse = seq, r
        disk = getattr(self.engine, "disk", None)
        entry = disk.lookup(ids, above=reuse) if disk is not None else None
        if entry is not None and (seq := self._from_disk(disk, entry, exclude=best)):
            pass
        elif best is None:
            seq = self._slot(exclude=None)
        elif reuse >= best.protected and not best.busy:
            seq = best
        else:
            seq = self._slot(exclude=best)
            if seq is not best:
                fork(best, reuse, seq)
                self.forks += 1
                self.engine.budget.enforce(active=seq)
        seq.stamp = next(self._clock)
        seq.protected = generation_start if generation_start is not None else len(ids)
        while len(self.sequences) > self.size:  # grown while all were busy: back to size
            idle = [s for s in self.sequences if s is not seq and not s.busy]
            if not idle:
                break
            self.sequences.remove(min(idle, key=lambda s: s.stamp))
        return seq

    def branch_point(self, ids: Sequence[int], points: Iterable[int]) -> int | None:
        """Where `ids` leaves the longest prefix any sequence holds, if no position of `points`
        (where the request restores or snapshots) lies within `BRANCH_MIN` tokens below it,
        and the prompt goes on past it; else None.

        Recurrent state cannot be rolled back, so two prompts sharing a long prefix inside a
        segment (a document with different questions, few-shot prompts) share nothing unless a
        snapshot lies at the fork: the second prompt prefills in full and leaves one there.
        """
        held = (s.filling if s.busy else s.tokens for s in self.sequences)
        fork = max((common_prefix(t, ids) for t in held), default=0)
        below = max((p for p in points if p <= fork), default=0)
        return fork if fork - below >= BRANCH_MIN and fork < len(ids) else None

    def _from_disk(self, disk, entry, exclude) -> PooledSequence | None:
        """A slot holding a disk entry's prefix (None if the entry failed its checks)."""
        restored = disk.restore(entry)
        if restored is None:
            return None
        seq = self._slot(exclude=exclude)
        disk.spill(seq, None)  # the slot's own state (if any) goes to disk, not away
        seq.drop_cache()
        seq.tokens, seq.caches = restored
        seq.last_used = tick()
        self.restores += 1
        self.engine.budget.enforce(active=seq)
        return seq

    def resize(self, size: int) -> None:
        """Keep at most `size` sequences from now on (the least recently used go first)."""
        if size < 1:
            raise ValueError(f"the pool needs at least one sequence, got {size}")
        self.size = size
        self.sequences = sorted(self.sequences, key=lambda s: s.stamp)[-size:]

    def _slot(self, exclude: PooledSequence | None) -> PooledSequence:
        """A new sequence while the pool has room, else the least recently used idle one
        (over `size` while every sequence is busy generating: `resize` trims them later)."""
        idle = [s for s in self.sequences if s is not exclude and not s.busy]
        if len(self.sequences) < self.size or not idle:
            seq = PooledSequence(self.engine)
            self.sequences.append(seq)
            return seq
        return min(idle, key=lambda s: s.stamp)

    @property
    def cache_bytes(self) -> int:
        return held_bytes(self.sequences)
