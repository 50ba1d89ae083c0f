"""A follower rank of a pipeline (engine/runtime/shard.py): its layers, run for rank 0.

`engine.load(..., shard="pipeline")` on a rank other than 0 loads a `Stage` (only that rank's
layers, numbered as in the checkpoint) and calls `follow`, which serves rank 0's messages
until it says stop and then exits the process. Every state a follower keeps is one rank 0
named: recurrent states under the handles its messages give, attention caches per cache set.
"""

from __future__ import annotations

import signal
import sys
import threading

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.registry import Architecture
from .cache import KVCache, RecurrentCache
from .model import ModelOptions
from .shard import (
    DTYPES,
    HANDLE,
    KEYS,
    OP_COPY,
    OP_FETCH,
    OP_FORWARD,
    OP_STOP,
    OP_STORE,
    Link,
    ShardError,
    fatal,
    layer_list,
    pack,
    unpack,
)


class Stage(nn.Module):
    """A follower's layers (numbered as in the checkpoint; the others are None)."""

    def __init__(self, arch: Architecture, options: ModelOptions, link: Link):
        super().__init__()
        self.arch = arch
        self.layers = layer_list(arch, link.ranges[link.rank], options)


class Follower:
    """Runs rank r's layers for rank 0 until told to stop: every state it keeps is named by
    rank 0 (handles in `store`, attention caches per cache set in `kv`)."""

    def __init__(self, stage: Stage, link: Link):
        self.stage, self.link = stage, link
        self.mine = link.ranges[link.rank]
        self.remote = range(0, link.ranges[0].start)  # the layers rank 0's message describes
        kinds = stage.arch.layer_types
        self.linear = {i for i in self.remote if kinds[i] == "linear_attention"}
        self.store: dict[int, mx.array] = {}
        self.kv: dict[int, dict[int, KVCache]] = {}
        self.expected = 1

    def serve(self) -> None:
        """The follower loop; returns when rank 0 says stop (ShardError on a broken link)."""
        link = self.link
        while True:
            with link.wait("for rank 0 (no step nor heartbeat came)"):
                op, seq, payload = link.recv_message()
            if seq != self.expected:
                raise ShardError(f"{link.who()}: message {seq} arrived, {self.expected} expected")
            self.expected += 1
            if link.dst != 0:  # pass it along the ring first: the next rank starts waiting
                with link.wait(f"passing message {seq} to rank {link.dst}"):
                    link.send_message(op, seq, payload)
            rest = self._release(payload)
            if op == OP_STOP:
                return self._check_held(rest[0])
            if op == OP_FORWARD:
                self._forward(rest)
            elif op == OP_FETCH:
                self._fetch(rest)
            elif op == OP_STORE:
                self._store(rest)
            elif op == OP_COPY:
                self._copy(rest)

    def _check_held(self, named: int) -> None:
        """At the end, this rank holds exactly the states rank 0 still names (and its share
        of them: with more ranks, each holds its layers' handles)."""
        mine = sum(1 for layer in self.mine if layer in self.linear) * 2
        total = sum(1 for layer in self.remote if layer in self.linear) * 2
        if len(self.store) * total != named * mine:
            raise ShardError(
                f"{self.link.who()}: holds {len(self.store)} states at the end where rank 0 "
                f"names {named * mine // max(total, 1)}: a release was lost"
            )

    def _release(self, payload: list[int]) -> list[int]:
        n = payload[0]
        for i in payload[1 : 1 + n]:
            self.store.pop(i, None)
        m = payload[1 + n]
        for s in payload[2 + n : 2 + n + m]:
            self.kv.pop(s, None)
        return payload[2 + n + m :]

    def _forward(self, p: list[int]) -> None:
        owner, T, dtype, ncap = p[:4]
        caps, i = p[4 : 4 + ncap], 4 + ncap
        kinds = self.stage.arch.layer_types
        kv = self.kv.setdefault(owner, {})
        caches, outs = [], []
        for layer in self.remote:
            if kinds[layer] == "full_attention":
                offset, i = p[i], i + 1
                if layer in self.mine:
                    c = kv.setdefault(layer, KVCache())
                    if offset > c.offset:
                        raise ShardError(
                            f"{self.link.who()}: layer {layer} holds {c.offset} positions, "
                            f"rank 0 resumes at {offset}"
                        )
                    c.restore(offset)
                    caches.append(c)
                continue
            offset, conv, state = p[i : i + 3]
            ids = p[i + 3 : i + 3 + 2 * (ncap + 1)]
            i += 3 + 2 * (ncap + 1)
            if layer in self.mine:
                c = RecurrentCache()
                c.restore((self.store.get(conv), self.store.get(state), offset))
                if (conv and conv not in self.store) or (state and state not in self.store):
                    raise ShardError(f"{self.link.who()}: layer {layer}: unknown state handle")
                c.capture = list(caps)
                caches.append(c)
                outs.append((c, ids))
        with self.link.wait(f"for the hidden states of a {T}-position step"):
            x = self.link.recv((1, T, self.stage.arch.hidden_size), DTYPES[dtype])
        for layer, c in zip(self.mine, caches):
            x = self.stage.layers[layer](x, c)
        kept = []
        for c, ids in outs:
            start = c.offset - T
            states = [c.captured[start + q] for q in caps] + [(c.conv, c.state)]
            for (conv, state), (a, b) in zip(states, zip(ids[::2], ids[1::2])):
                self.store[a], self.store[b] = conv, state
                kept += [conv, state]
            c.capture, c.captured = [], {}
        arrays = [a for c in kv.values() for a in (c.keys, c.values) if a is not None]
        mx.eval(x, kept, arrays)
        with self.link.wait(f"sending a {T}-position step to rank {self.link.dst}"):
            self.link.send(x)

    def _fetch(self, p: list[int]) -> None:
        """Send rank 0 copies of the arrays it asks for that this rank holds, after those of
        the ranks before it on the ring (rank N-1 starts, rank 1 ends at rank 0)."""
        wanted = [p[1 + 4 * j : 5 + 4 * j] for j in range(p[0])]
        mine = [self._held(*w) for w in wanted if w[0] in self.mine]
        meta, buf = [], None
        if self.link.src != 0:
            with self.link.wait(f"for rank {self.link.src}'s cache states"):
                meta, buf = self.link.recv_packed()
        more, extra = pack(mine)
        mx.eval(extra)
        if more:
            meta, buf = meta + more, extra if buf is None else mx.concatenate([buf, extra])
        with self.link.wait(f"sending cache states to rank {self.link.dst}"):
            self.link.send_packed(meta, buf)

    def _held(self, layer: int, kind: int, ref: int, rows: int) -> mx.array:
        if kind == HANDLE:
            if ref not in self.store:
                raise ShardError(f"{self.link.who()}: layer {layer}: unknown state handle {ref}")
            return self.store[ref]
        c = self.kv.get(ref, {}).get(layer)
        if c is None or c.keys is None or c.offset < rows:
            held = 0 if c is None else c.offset
            raise ShardError(
                f"{self.link.who()}: layer {layer} holds {held} positions, rank 0 asks for {rows}"
            )
        return (c.keys if kind == KEYS else c.values)[:, :, :rows]

    def _copy(self, p: list[int]) -> None:
        """A pool fork on rank 0: cache set `dst`'s attention caches (of this rank's layers)
        become copies of the first `rows` rows of cache set `src`'s, as `pool.fork` copies
        them from a buffer (rows below a snapshot stay valid beyond a trimmed offset)."""
        src, dst, rows = p[:3]
        kinds, held = self.stage.arch.layer_types, self.kv.get(src, {})
        copies, kept = self.kv.setdefault(dst, {}), []
        for layer in self.mine:
            if kinds[layer] != "full_attention":
                continue
            c, new = held.get(layer), KVCache()
            if rows:
                if c is None or c.keys is None or c.keys.shape[2] < rows:
                    have = 0 if c is None or c.keys is None else c.keys.shape[2]
                    raise ShardError(f"{self.link.who()}: layer {layer} holds {have} rows, "
                                     f"rank 0 copies {rows}")  # fmt: skip
                new.load_state(c.keys[:, :, :rows], c.values[:, :, :rows])
                kept += [new.keys, new.values]
            copies[layer] = new
        mx.eval(kept)

    def _store(self, p: list[int]) -> None:
        """Take the arrays of rank 0's upload meant for this rank's layers (passing all of
        them on to the next follower first)."""
        items = [p[1 + 3 * j : 4 + 3 * j] for j in range(p[0])]
        with self.link.wait("for cache states from rank 0"):
            meta, buf = self.link.recv_packed()
        if self.link.dst != 0:
            with self.link.wait(f"passing cache states to rank {self.link.dst}"):
                self.link.send_packed(meta, buf)
        arrays = unpack(meta, buf)
        if len(arrays) != len(items):
            raise ShardError(f"{self.link.who()}: {len(items)} cache states named, "
                             f"{len(arrays)} sent")  # fmt: skip
        rows: dict[tuple[int, int], list] = {}
        kept = []
        for (layer, kind, ref), a in zip(items, arrays):
            if layer not in self.mine:
                continue
            if kind == HANDLE:
                self.store[ref] = a
                kept.append(a)
            else:
                rows.setdefault((ref, layer), [None, None])[kind - KEYS] = a
        for (owner, layer), (keys, values) in rows.items():
            c = self.kv.setdefault(owner, {})[layer] = KVCache()
            c.load_state(keys, values)
            kept += [a for a in (c.keys, c.values) if a is not None]
        mx.eval(kept)


def follow(stage: Stage, link: Link) -> None:
    """A follower rank's life: serve rank 0, then exit the process (0 when told to stop).

    Ctrl+C is rank 0's: under `mlx.launch` the ranks on one machine share the terminal's
    process group, so the follower gets it too, where it would end the group in the middle of
    what rank 0 does with it (interrupt one answer, write the pool before stopping). A
    follower ignores it and exits when rank 0 says stop, or its link breaks."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        Follower(stage, link).serve()
    except ShardError as e:
        fatal(f"{link.who()}: {e}" if not str(e).startswith("chatml shard") else str(e))
    sys.stdout.flush()
    raise SystemExit(0)
