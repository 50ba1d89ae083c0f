"""Snapshots of a session's caches at token positions, and the byte budget over all of them.

A snapshot at position p holds the recurrent caches' (conv, state) as of p and nothing for the
KV caches: while the live KV cache has not been rewound below p, trimming it back to p recovers
exactly the keys and values of positions < p. So a snapshot stays valid until the session
rewinds below it, and `Session` drops the ones above every rewind point.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field

from .cache import KVCache, RecurrentCache

_clock = itertools.count()  # one recency clock for snapshots and live caches (the LRU order)


def tick() -> int:
    return next(_clock)


@dataclass
class Snapshot:
    pos: int
    layers: list  # per layer: RecurrentCache.snapshot() or None for KV layers
    nbytes: int
    last_used: int = field(default_factory=tick)

    def touch(self) -> None:
        self.last_used = tick()


def take(caches: list, pos: int, layers: list | None = None) -> Snapshot:
    """A snapshot at `pos`: the live state, or `layers` (per layer: a recurrent state kept by
    the step that passed `pos`, None for KV layers)."""
    if layers is None:
        layers = [c.snapshot() if isinstance(c, RecurrentCache) else None for c in caches]
    nbytes = sum(a.nbytes for layer in layers if layer is not None for a in layer[:2]
                 if a is not None)  # fmt: skip
    return Snapshot(pos, layers, nbytes)


def restore(caches: list, snap: Snapshot) -> None:
    for c, s in zip(caches, snap.layers):
        if isinstance(c, KVCache):
            c.restore(snap.pos)
        else:
            c.restore(s)
    snap.touch()


def default_budget() -> int:
    """Without a model to account for: half of the memory MLX may use (runtime.memory)."""
    from . import memory

    return memory.default_budget(0, memory.device_memory())


def held_bytes(sequences) -> int:
    """What `sequences` hold, each snapshot counted once: forked sequences share the snapshots
    below the fork (`pool.fork`), and a live cache restored to a snapshot, or at the snapshot
    taken at its end, holds that snapshot's arrays until it moves on."""
    total, counted = 0, set()
    for s in sequences:
        total += s.live_bytes
        end = s.snapshots.get(len(s.tokens))
        if end is not None and _shares_live(s.caches, end):
            counted.add(id(end))
    for s in sequences:
        for snap in s.snapshots.values():
            if id(snap) not in counted:
                counted.add(id(snap))
                total += snap.nbytes
    return total


def _shares_live(caches: list, snap: Snapshot) -> bool:
    """Whether the live recurrent caches hold `snap`'s arrays (one layer tells: they are
    restored and updated together)."""
    for c, layer in zip(caches, snap.layers):
        if layer is not None:
            return isinstance(c, RecurrentCache) and c.snapshot()[1] is layer[1]
    return False


class CacheBudget:
    """Engine-wide LRU over every sequence's snapshots and live caches, bounded in bytes.

    One recency order covers both: the least recently used item goes first. Evicting a snapshot
    only costs a longer prefill later; evicting an idle sequence's live cache drops that
    sequence's snapshots too (their KV part lived there), and its next prompt is prefilled
    from scratch. The sequences being served (`active`, and every `busy` one: batched
    generations) keep their live caches: a single conversation larger than the budget still
    runs, with no snapshots.
    """

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = default_budget() if max_bytes is None else max_bytes
        self._sequences: weakref.WeakSet = weakref.WeakSet()
        # Sessions are made on any thread while the model thread walks the set.
        self._lock = threading.Lock()
        self.evictions = 0
        # Called as spill(sequence, pos) before evicting its snapshot at pos (None: its live
        # cache): the disk tier (engine/storage/disk_cache.py) keeps a copy there.
        self.spill = None

    def register(self, sequence) -> None:
        with self._lock:
            self._sequences.add(sequence)

    def _all(self) -> list:
        with self._lock:
            return list(self._sequences)

    def used(self) -> int:
        return held_bytes(self._all())

    def enforce(self, active=None) -> None:
        used = self.used()
        while used > self.max_bytes:
            sequences = self._all()
            items = [(snap.last_used, s, pos) for s in sequences
                     for pos, snap in s.snapshots.items()]  # fmt: skip
            items += [(s.last_used, s, None) for s in sequences
                      if s is not active and not getattr(s, "busy", False) and s.live_bytes]  # fmt: skip
            if not items:
                return
            _, seq, pos = min(items, key=lambda item: item[0])
            if self.spill is not None:
                self.spill(seq, pos)
            if pos is None:
                used -= seq.cache_bytes
                seq.drop_cache()
            else:
                used -= seq.snapshots.pop(pos).nbytes
            self.evictions += 1
            if used <= self.max_bytes:  # counted as if unshared: what another holder shares
                used = self.used()  # is not freed yet, so count exactly before stopping
