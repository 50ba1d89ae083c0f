"""Per-layer caches behind one protocol.

- `KVCache` (full-attention layers): keys and values of every position seen. Trimmable: moving
  the offset back forgets the tail, so a snapshot never needs to copy it.
- `RecurrentCache` (Gated DeltaNet layers): the conv tail and the delta state after the last
  position. Fixed size and NOT trimmable: the only way back is to restore a saved copy.

Both expose `offset`, `nbytes`, `snapshot()` and `restore(snap)`. MLX arrays are immutable
values and `RecurrentCache` only ever rebinds its fields, so a snapshot is a pair of references
and costs nothing until the live cache moves on. `KVCache` writes into a preallocated buffer in
place, so its snapshot is just the offset (the rows before it are never overwritten while the
offset stays at or beyond it).
"""

from __future__ import annotations

import mlx.core as mx

KV_STEP = 256  # grow the KV buffer in blocks of this many positions


class KVCache:
    is_trimmable = True

    def __init__(self):
        self.keys: mx.array | None = None  # [B, Hkv, capacity, D]
        self.values: mx.array | None = None
        self.offset = 0

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append k, v `[B, Hkv, T, D]`; return all keys and values up to the new offset."""
        B, H, T, D = k.shape
        end = self.offset + T
        if self.keys is None or end > self.keys.shape[2]:
            capacity = ((end + KV_STEP - 1) // KV_STEP) * KV_STEP
            new_k = mx.zeros((B, H, capacity, D), dtype=k.dtype)
            new_v = mx.zeros((B, H, capacity, v.shape[-1]), dtype=v.dtype)
            if self.keys is not None and self.offset:
                new_k[:, :, : self.offset] = self.keys[:, :, : self.offset]
                new_v[:, :, : self.offset] = self.values[:, :, : self.offset]
            self.keys, self.values = new_k, new_v
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def snapshot(self) -> int:
        return self.offset

    def restore(self, offset: int) -> None:
        if offset > self.offset:
            raise ValueError(f"cannot restore KV to {offset}: only {self.offset} positions kept")
        self.offset = offset

    @property
    def state(self) -> tuple[mx.array, mx.array] | None:
        if self.keys is None:
            return None
        return self.keys[:, :, : self.offset], self.values[:, :, : self.offset]

    def load_state(self, keys: mx.array, values: mx.array) -> None:
        self.keys, self.values, self.offset = None, None, 0
        if keys.shape[2]:
            self.update(keys, values)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class RecurrentCache:
    is_trimmable = False

    def __init__(self):
        self.conv: mx.array | None = None  # [B, K-1, C]
        self.state: mx.array | None = None  # [B, Hv, Dv, Dk] float32
        self.offset = 0
        # Positions inside the next update (relative to its start) whose state the caller
        # wants, and what the layer recorded there (by absolute position): snapshots at
        # ChatML boundaries without splitting the forward pass at each of them.
        self.capture: list[int] = []
        self.captured: dict[int, tuple[mx.array, mx.array]] = {}

    def update(self, conv: mx.array, state: mx.array, n: int) -> None:
        self.conv, self.state = conv, state  # rebind, never write in place: snapshots share
        self.offset += n

    def record(self, at: int, conv: mx.array, state: mx.array) -> None:
        self.captured[self.offset + at] = (conv, state)

    def snapshot(self, pos: int | None = None) -> tuple[mx.array | None, mx.array | None, int]:
        """The state at `pos` (default: now): the live one or one recorded by `capture`."""
        if pos is None or pos == self.offset:
            return self.conv, self.state, self.offset
        if pos not in self.captured:
            raise ValueError(f"recurrent cache at {self.offset} has no state recorded at {pos}")
        return (*self.captured[pos], pos)

    def restore(self, snap: tuple[mx.array | None, mx.array | None, int]) -> None:
        self.conv, self.state, self.offset = snap

    def load_state(self, conv: mx.array | None, state: mx.array | None, offset: int) -> None:
        self.restore((conv, state, offset))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.state) if a is not None)


# How many rows the MTP head's cache may leave uncomputed (`MTPCache.lag`) before the pass
# that would exceed it computes them all: while drafting is off the head does not run per
# token, and this bounds what the lag costs (the target's hidden states it keeps, in the live
# cache and in each snapshot: 512 positions are ~2 MiB for the 0.8B build in float32, against
# ~18 MiB of recurrent state per snapshot).
MAX_LAG = 512


class MTPCache(RecurrentCache):
    """The cache of the MTP head (runtime.mtp): its attention layer's KV rows, and what the
    rows not yet computed are made of.

    Row j of `kv` pairs the target's final hidden state at position j with the embedding of
    token j+1 (RoPE position j); after `offset` tokens there are `offset - 1` such rows (the
    row of the last position needs the token after it, which the first draft step supplies).
    The head computes them lazily, so that plain decoding never runs it per token: `kv` holds
    the first `offset - L` rows, and the rest are kept as their inputs:

    - `state`: the target's hidden states `[B, L, H]` at positions `offset - L .. offset - 1`
      (L >= 1 once a token was seen; the last one is where a draft starts);
    - `ids`: the tokens `[B, L - 1]` (int32) at positions `offset - L + 1 .. offset - 1`,
      which those rows pair with; None when L == 1 (`lag` 0: the head is caught up).

    `MTPHead.catch_up` computes the pending rows in one batched pass; `MTPHead.advance` keeps
    the inputs in step with every target pass and catches up itself once the lag would pass
    `max_lag` (0: the head advances with every pass, as a reference). The hidden states
    cannot be recomputed without the target, so they are kept as a recurrent state is:
    `snapshot()` is `(ids, state, offset)` (the ids in the slot a recurrent cache keeps its
    conv tail in), captured inside a step where asked, and restoring one trims the rows to
    `offset - L` (valid while the live cache has not rewound below that, as for every KV
    cache: see runtime.snapshot; the rows only ever grow between rewinds).
    """

    def __init__(self, max_lag: int | None = None):
        super().__init__()
        self.kv = KVCache()
        self.ids: mx.array | None = None
        self.max_lag = MAX_LAG if max_lag is None else max_lag

    @property
    def lag(self) -> int:
        """Rows whose inputs are known but not computed yet."""
        return 0 if self.ids is None else self.ids.shape[1]

    def update(self, ids: mx.array | None, state: mx.array, n: int) -> None:
        """The pending inputs after `n` more positions (rows computed meanwhile are in `kv`)."""
        self.ids, self.state = ids, state
        self.offset += n

    def snapshot(self, pos: int | None = None) -> tuple[mx.array | None, mx.array | None, int]:
        if pos is None or pos == self.offset:
            return self.ids, self.state, self.offset
        return super().snapshot(pos)

    def restore(self, snap: tuple[mx.array | None, mx.array | None, int]) -> None:
        ids, state, offset = snap
        self.kv.restore(offset - _pending(state))
        self.conv, self.ids, self.state, self.offset = None, ids, state, offset

    def load_state(self, keys: mx.array | None, values: mx.array | None, ids: mx.array | None,
                   state: mx.array | None, offset: int) -> None:  # fmt: skip
        """Adopt rows `[B, Hkv, offset - L, D]` (None for none), the pending `ids` and the
        hidden states `state` (`[B, L, H]`)."""
        L, n_ids = _pending(state), 0 if ids is None else ids.shape[1]
        if (offset > 0) != (L > 0) or L > offset or n_ids != max(L - 1, 0):
            raise ValueError(f"an MTP cache at {offset} cannot hold {L} hidden states and "
                             f"{n_ids} pending ids")  # fmt: skip
        self.kv = KVCache()
        if keys is not None:
            self.kv.load_state(keys, values)
        if self.kv.offset != offset - L:
            raise ValueError(f"an MTP cache at {offset} with {L} hidden states needs "
                             f"{offset - L} rows, got {self.kv.offset}")  # fmt: skip
        self.conv, self.ids, self.state, self.offset = None, ids, state, offset

    @property
    def keys(self) -> mx.array | None:  # for generate.cache_arrays: evaluated with the rest
        return self.kv.keys

    @property
    def values(self) -> mx.array | None:
        return self.kv.values

    @property
    def rows(self) -> tuple[mx.array, mx.array] | None:
        """The computed rows `[B, Hkv, offset - L, D]` (keys, values), None if there are none."""
        return self.kv.state

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + sum(a.nbytes for a in (self.ids, self.state) if a is not None)


def _pending(state: mx.array | None) -> int:
    """How many positions an MTP cache's `state` covers (the rows it lacks, plus one)."""
    return 0 if state is None else state.shape[1]
