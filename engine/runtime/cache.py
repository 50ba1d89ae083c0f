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


class MTPCache(RecurrentCache):
    """The cache of the MTP head (runtime.mtp): its attention layer's KV rows, and the
    target's hidden state after the last position.

    Row j of `kv` pairs the target's final hidden state at position j with the embedding of
    token j+1 (RoPE position j), so after `offset` tokens it holds `offset - 1` rows: the row
    of the last position needs the token after it, which the first draft step supplies.
    `state` is the target's hidden state `[B, 1, H]` at position `offset - 1`. The rows trim
    like any KV cache; the hidden state cannot be recomputed without the target, so it is
    kept as a recurrent state is: `snapshot()` is `(None, state, offset)`, captured inside a
    step where asked, and restoring one trims the rows to `offset - 1` (valid while the live
    cache has not rewound below it, as for every KV cache: see runtime.snapshot).
    """

    def __init__(self):
        super().__init__()
        self.kv = KVCache()

    def restore(self, snap: tuple[mx.array | None, mx.array | None, int]) -> None:
        _, state, offset = snap
        self.kv.restore(max(offset - 1, 0))
        self.conv, self.state, self.offset = None, state, offset

    def load_state(self, keys: mx.array | None, values: mx.array | None, state: mx.array | None,
                   offset: int) -> None:  # fmt: skip
        """Adopt rows `[B, Hkv, offset - 1, D]` (None for none) and the hidden state."""
        self.kv = KVCache()
        if keys is not None:
            self.kv.load_state(keys, values)
        if self.kv.offset != max(offset - 1, 0):
            raise ValueError(f"an MTP cache at {offset} needs {max(offset - 1, 0)} rows, "
                             f"got {self.kv.offset}")  # fmt: skip
        self.conv, self.state, self.offset = None, state, offset

    @property
    def keys(self) -> mx.array | None:  # for generate.cache_arrays: evaluated with the rest
        return self.kv.keys

    @property
    def values(self) -> mx.array | None:
        return self.kv.values

    @property
    def rows(self) -> tuple[mx.array, mx.array] | None:
        """The valid rows `[B, Hkv, offset - 1, D]` (keys, values), None if there are none."""
        return self.kv.state

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.state.nbytes if self.state is not None else 0)
