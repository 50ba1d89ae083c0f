"""The cache state of a conversation as one safetensors file: write, check, read back.

`capture_state` copies a `CachedSequence` out of MLX (its token ids, the live KV and recurrent
caches, and the recurrent arrays of a few snapshots); `CapturedState.encode` serializes it.
`decode_state` gives it back only if everything checks out: same format and version, same
weights (fingerprint) and dtype, the token ids the caller expects (`state_key`), a
whole-content checksum, and layers and positions that fit the model. Anything else raises
`StateError`: the caller then rebuilds from its log, never trusting a damaged or stale state.

A pipeline's rank 0 (runtime/shard.py) writes and reads the same file: the followers' layers
are gathered into it (`PipelineModel.fetch`) and sent back out of it (`PipelineModel.upload`),
so a file holds every layer whichever split wrote it, and resumes under any split or none.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..runtime.cache import KVCache, MTPCache, RecurrentCache
from ..runtime.generate import cache_arrays
from ..runtime.shard import (
    HANDLE,
    KEYS,
    VALUES,
    RemoteArray,
    RemoteKVCache,
    RemoteRecurrentCache,
    Upload,
    Wanted,
)
from ..runtime.snapshot import Snapshot

FORMAT = "chatml-session"
# 2: an MTP cache may hold fewer rows and more hidden states (and `ids`) than one per position
# (runtime.cache.MTPCache). Version 1 files are read too: their MTP caches never lag.
# 3: the checksum covers the metadata (which says how to read the tensors) too.
VERSION = 3
READABLE = ("1", "2", "3")
# Snapshots written to disk: the first (after the system prompt: survives window trimming) and
# the last few (the last turn's message and answer starts: the next turn, /regenerate). Every
# one of them costs the full recurrent state, so saving all would grow the file every turn.
SNAPSHOTS_KEPT = 4
# numpy has no bfloat16: such arrays travel as their raw 16-bit patterns
_VIEWS = {mx.bfloat16: mx.uint16}
_DTYPE_NAMES = {"bfloat16": mx.bfloat16}


class StateError(Exception):
    """Why a state file cannot be used (it is then ignored, never trusted)."""


def state_key(tokens) -> str:
    """Names a token sequence: ties a state file to the log record it belongs to."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()[:32]


def _to_numpy(a: mx.array) -> tuple[np.ndarray, str | None]:
    view = _VIEWS.get(a.dtype)
    if view is None:
        return np.array(a), None
    return np.array(a.view(view)), str(a.dtype).rsplit(".", 1)[-1]


def _to_mlx(a: np.ndarray, dtype: str | None) -> mx.array:
    arr = mx.array(a)
    return arr.view(_DTYPE_NAMES[dtype]) if dtype else arr


def _digest(tensors: dict[str, np.ndarray], meta: dict[str, str] | None) -> str:
    """The checksum of the tensors and (version 3 on) the metadata but its own entry."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{t.dtype.str}|{t.shape}|".encode())
        h.update(memoryview(t).cast("B"))
    if meta is not None:
        h.update(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True)
                 .encode())  # fmt: skip
    return h.hexdigest()


@dataclass
class CapturedState:
    """Caches copied out of MLX into numpy: independent of the live sequence from then on, so
    checksumming, serializing and writing can run on any thread while the model moves on."""

    tensors: dict[str, np.ndarray]
    meta: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def encode(self) -> bytes:
        """The safetensors bytes, with a checksum over every tensor and the metadata."""
        from safetensors.numpy import save

        return save(
            self.tensors, metadata={**self.meta, "sha256": _digest(self.tensors, self.meta)}
        )


def capture_state(seq, engine, pos: int | None = None) -> CapturedState:
    """Copy a CachedSequence's tokens, live caches and kept snapshots (call with the model held).

    With `pos` (a snapshot position, or the live end): only the prefix of `pos` tokens, with
    no snapshots: its KV rows below `pos` (still valid, see runtime.snapshot) and the
    snapshot's recurrent state. That is one entry of the server's disk cache. A pipeline's
    remote layers are fetched from their ranks, all in one exchange.
    """
    prefix = None
    if pos is not None and pos != len(seq.tokens):
        prefix = seq.snapshots[pos].layers
    tokens = seq.tokens if pos is None else seq.prefix(pos)
    found: dict[str, mx.array | Wanted] = {}  # tensor name -> array, or what a follower holds

    def put(name: str, layer: int, a) -> None:
        if a is not None:
            found[name] = Wanted(layer, HANDLE, a) if isinstance(a, RemoteArray) else a

    kinds, offsets = [], []
    for i, c in enumerate(seq.caches):
        if isinstance(c, RemoteKVCache):
            kinds.append("kv")
            offsets.append(len(tokens))
            if c.capacity:  # as c.state is not None for a KVCache that held rows
                found[f"kv.{i}.keys"] = Wanted(i, KEYS, c, len(tokens))
                found[f"kv.{i}.values"] = Wanted(i, VALUES, c, len(tokens))
        elif isinstance(c, KVCache):
            kinds.append("kv")
            offsets.append(len(tokens))
            if c.state is not None:
                put(f"kv.{i}.keys", i, c.state[0][:, :, : len(tokens)])
                put(f"kv.{i}.values", i, c.state[1][:, :, : len(tokens)])
        elif isinstance(c, MTPCache):  # the MTP head's rows, and the inputs of those pending
            kinds.append("mtp")
            offsets.append(len(tokens))
            ids, state, _ = c.snapshot() if prefix is None else prefix[i]
            rows = len(tokens) - (0 if state is None else state.shape[1])
            if c.rows is not None and rows:
                put(f"mtp.{i}.keys", i, c.rows[0][:, :, :rows])
                put(f"mtp.{i}.values", i, c.rows[1][:, :, :rows])
            put(f"mtp.{i}.ids", i, ids)
            put(f"mtp.{i}.state", i, state)
        else:
            kinds.append("rec")
            conv, state, offset = (c.conv, c.state, c.offset) if prefix is None else prefix[i]
            offsets.append(offset)
            put(f"rec.{i}.conv", i, conv)
            put(f"rec.{i}.state", i, state)
    positions = sorted(p for p in seq.snapshots if 0 < p <= len(seq.tokens))
    positions = sorted(set(positions[:1] + positions[-SNAPSHOTS_KEPT:])) if pos is None else []
    for p in positions:
        for i, layer in enumerate(seq.snapshots[p].layers):
            if layer is not None:  # (an MTP cache's pending ids ride in the conv slot)
                put(f"snap.{p}.{i}.conv", i, layer[0])
                put(f"snap.{p}.{i}.state", i, layer[1])
    remote = [name for name, a in found.items() if isinstance(a, Wanted)]
    if remote:
        found.update(zip(remote, engine.model.fetch([found[name] for name in remote])))
    tensors: dict[str, np.ndarray] = {"tokens": np.asarray(tokens, dtype=np.int32)}
    views: dict[str, str] = {}
    for name, a in found.items():
        tensors[name], view = _to_numpy(a)
        if view:
            views[name] = view
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "fingerprint": engine.fingerprint,
        "dtype": str(engine.dtype),
        "key": state_key(tokens),
        "kinds": json.dumps(kinds),
        "offsets": json.dumps(offsets),
        "snapshots": json.dumps(positions),
        "views": json.dumps(views),
    }
    return CapturedState(tensors, meta)


def _kind(c) -> str:
    return "kv" if isinstance(c, KVCache) else "mtp" if isinstance(c, MTPCache) else "rec"


def read_header(data: bytes) -> dict:
    """The metadata of a state file's bytes (raises StateError if there is none)."""
    if len(data) < 8:
        raise StateError("file too short")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise StateError("header runs past the end of the file")
    try:
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except (ValueError, AttributeError, RecursionError) as e:  # junk can nest deep
        raise StateError(f"unreadable header ({e})") from e
    if not isinstance(meta, dict):
        raise StateError("unreadable header (its metadata is not an object)")
    return meta


def decode_state(data: bytes, engine, expected_key: str | None):
    """(tokens, caches, snapshots) from `CapturedState.encode` bytes; raises StateError if unusable."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    meta = read_header(data)
    _check_meta(meta, engine, expected_key)
    try:
        tensors = load(data)
    except SafetensorError as e:
        raise StateError(f"unreadable ({e})") from e
    if _digest(tensors, None if meta["version"] in ("1", "2") else meta) != meta.get("sha256"):
        raise StateError("checksum mismatch")
    return _rebuild(tensors, meta, engine, expected_key)


def restore_captured(captured: CapturedState, engine, expected_key: str):
    """(tokens, caches, snapshots) of a capture not yet written (the disk cache's queue),
    with the checks of `decode_state` but the checksum (the arrays never left this process).
    The caches are copies: the writer may still be encoding `captured` on its thread."""
    _check_meta(captured.meta, engine, expected_key)
    return _rebuild(captured.tensors, captured.meta, engine, expected_key)


def _check_meta(meta: dict, engine, expected_key: str | None) -> None:
    if meta.get("format") != FORMAT or meta.get("version") not in READABLE:
        raise StateError("not a chatml-engine state file of this version")
    if meta.get("fingerprint") != engine.fingerprint or meta.get("dtype") != str(engine.dtype):
        raise StateError("made by other weights or another dtype")
    if expected_key is None or meta.get("key") != expected_key:
        raise StateError("stale: it does not belong to the last turn in the log")


def _rebuild(tensors: dict[str, np.ndarray], meta: dict, engine, expected_key: str | None):
    """Caches from checked tensors: token ids against their key, layers and shapes."""
    try:
        kinds, offsets = json.loads(meta["kinds"]), json.loads(meta["offsets"])
        positions, views = json.loads(meta["snapshots"]), json.loads(meta["views"])
    except (ValueError, KeyError) as e:
        raise StateError(f"unreadable ({e})") from e
    tokens = [int(t) for t in tensors["tokens"]]
    n = len(tokens)
    if state_key(tokens) != expected_key:
        raise StateError("token ids do not match their key")
    caches = engine.model.make_caches()
    expect = [_kind(c) for c in caches]
    if kinds != expect or len(offsets) != len(caches) or any(o != n for o in offsets):
        raise StateError("layers or positions do not match this model and these tokens")

    def get(name: str) -> mx.array | None:
        return _to_mlx(tensors[name], views.get(name)) if name in tensors else None

    remote = Upload()  # a pipeline's remote layers: sent to their ranks once all is checked

    def place(i: int, a: mx.array | None):
        """A recurrent array of layer i as its cache holds it: here, or a follower's handle."""
        return remote.handle(i, a) if isinstance(caches[i], RemoteRecurrentCache) else a

    for i, c in enumerate(caches):
        if isinstance(c, KVCache):
            k, v = get(f"kv.{i}.keys"), get(f"kv.{i}.values")
            if k is None or v is None or k.shape[2] != n or v.shape[2] != n:
                raise StateError(f"layer {i}: KV cache does not hold {n} positions")
            if isinstance(c, RemoteKVCache):
                remote.kv(i, c, k, v)
            else:
                c.load_state(k, v)
        elif isinstance(c, MTPCache):
            k, v, st = get(f"mtp.{i}.keys"), get(f"mtp.{i}.values"), get(f"mtp.{i}.state")
            rows = k.shape[2] if k is not None and v is not None else 0
            if st is None or (v is not None and v.shape[2] != rows):
                raise StateError(f"layer {i}: MTP cache does not hold {n} positions")
            try:
                c.load_state(k, v, get(f"mtp.{i}.ids"), st, n)
            except ValueError as e:
                raise StateError(f"layer {i}: {e}") from e
        else:
            conv, st = get(f"rec.{i}.conv"), get(f"rec.{i}.state")
            if st is None:
                raise StateError(f"layer {i}: recurrent state missing")
            c.load_state(place(i, conv), place(i, st), n)
    snapshots = {}
    for p in positions:
        if not isinstance(p, int) or not 0 < p <= n:
            raise StateError(f"snapshot at {p!r} outside the {n} tokens")
        layers, nbytes = [], 0
        for i, c in enumerate(caches):
            if isinstance(c, RecurrentCache):
                conv, st = get(f"snap.{p}.{i}.conv"), get(f"snap.{p}.{i}.state")
                if st is None:
                    raise StateError(f"snapshot {p}, layer {i}: recurrent state missing")
                if isinstance(c, MTPCache) and not _mtp_snapshot_fits(c, conv, st, p):
                    raise StateError(f"snapshot {p}, layer {i}: MTP rows and pending inputs "
                                     "do not fit")  # fmt: skip
                nbytes += sum(a.nbytes for a in (conv, st) if a is not None)
                layers.append((place(i, conv), place(i, st), p))
            else:
                layers.append(None)
        snapshots[p] = Snapshot(p, layers, nbytes)
    # Evaluated here, on the thread that made them (the bfloat16 `.view`s and KV writes are
    # lazy): a lazy array fails when another thread's stream evaluates it.
    arrays = [a for s in snapshots.values() for layer in s.layers if layer for a in layer[:2]]
    mx.eval([a for a in cache_arrays(caches) + arrays if isinstance(a, mx.array)])
    if remote.items:
        engine.model.upload(remote)
    return tokens, caches, snapshots


def _mtp_snapshot_fits(c: MTPCache, ids, state, p: int) -> bool:
    """Whether an MTP snapshot at `p` with pending `ids` and hidden `state` restores from the
    live cache `c`: its rows (p - L) lie within the live ones, its ids number L - 1."""
    L, n_ids = state.shape[1], 0 if ids is None else ids.shape[1]
    return 1 <= L <= p and p - L <= c.kv.offset and n_ids == L - 1
