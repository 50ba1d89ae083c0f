"""Pipeline parallelism over `mx.distributed`: one model's layers split across processes.

Each rank of a launched group (`mlx.launch -n N --backend ring -- ...`) holds a contiguous
range of layers and only their weights and caches. Rank 0 holds the last layers, the
embedding, the final norm and the LM head, and everything else the engine does (rendering,
reuse, sampling, the server). The others run `follower.Follower.serve`. A step goes around the ring:

    rank 0: embed -> rank N-1: first layers -> ... -> rank 1 -> rank 0: last layers, logits

Rank 0's model is `PipelineModel`, with the interface `step.forward` uses (`make_caches`,
`hidden`, `logits`), so the runtime above it does not know it is sharded. Its caches for
the remote layers are stand-ins (`RemoteKVCache`, `RemoteRecurrentCache`) that follow the
cache protocol exactly as the real ones would, holding `RemoteArray` handles where a real
cache holds arrays. Snapshots, restores and rollbacks are therefore plain Python on rank 0,
as in one process, and cost no message: every forward tells the followers the state each of
their layers starts from (a handle, or a KV offset) and the handles to store the new states
under. Lock-step holds by construction: a follower never keeps state rank 0 does not name.
A handle that rank 0 drops (snapshot evicted, sequence reset) is released on the follower
with the next message, so follower memory mirrors rank 0's budget.

States leave and enter the followers only for disk (persisted sessions, the disk tier of the
prefix cache): `PipelineModel.fetch` gathers the arrays some handles and KV rows stand for to
rank 0, `PipelineModel.upload` sends arrays to the followers under new handles. So a state
file is the same file one process writes, and holds the whole model's layers: it resumes
exactly under any split (another rank count, or none), and sits with the session's log on rank
0's disk (the other machines need no copy of the store). The price: every save moves the
followers' share of the state over the link once (a per-rank file would keep it local, but
tie the file to one layout and need every machine's store to be there on resume).

A rank that dies closes its sockets and the ring backend fails the others' pending transfer:
they exit with a message. A rank that hangs (a machine gone without closing its sockets) is
caught by a watchdog: no transfer waits longer than `CHATML_SHARD_TIMEOUT` seconds (default
120; each rank reads its own), and an idle rank 0 pings the followers at a fraction of the
shortest.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import hashlib
import itertools
import math
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.registry import Architecture
from .cache import KV_STEP, KVCache, RecurrentCache
from .model import DecoderLayer, LanguageHead, ModelOptions, RMSNorm

MODES = ("pipeline",)
PROTOCOL = 4  # 3: the ranks exchange their timeouts at `connect`; 4: OP_COPY
MAGIC = 0x63686D6C  # "chml": the first word of every message header
OP_FORWARD, OP_PING, OP_STOP, OP_FETCH, OP_STORE, OP_COPY = 1, 2, 3, 4, 5, 6
DTYPES = (mx.float32, mx.bfloat16, mx.float16)  # hidden states and cache states travel in these
HANDLE, KEYS, VALUES = 0, 1, 2  # what a fetched or uploaded array is (`Wanted.kind`)
ALIGN = 16  # bytes: each array of a packed buffer starts at a multiple of this
EXIT_LOST = 3  # exit status of a rank whose peer died or hung
DEFAULT_TIMEOUT = 120.0


class ShardError(RuntimeError):
    """The pipeline cannot go on: a peer rank died or hung, or the ranks disagree."""


def timeout() -> float:
    """The longest wait for a peer, in seconds (CHATML_SHARD_TIMEOUT; default 120)."""
    raw = os.environ.get("CHATML_SHARD_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise ShardError(f"CHATML_SHARD_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not (math.isfinite(value) and value > 0):  # NaN would disarm the watchdog
        raise ShardError(f"CHATML_SHARD_TIMEOUT must be a positive, finite number, got {raw!r}")
    return value


def plan(num_layers: int, size: int) -> list[range]:
    """Each rank's layers: contiguous, as even as possible, the first layers on the last rank
    and the last ones on rank 0 (which also holds the embedding and the head, so it gets
    the smaller share when the layers do not divide evenly)."""
    if size > num_layers:
        raise ShardError(
            f"the model has {num_layers} layers and cannot be split over {size} ranks "
            "(every rank needs at least one layer)"
        )
    base, extra = divmod(num_layers, size)
    counts = [base + (1 if r >= size - extra else 0) for r in range(size)]
    ranges, start = [None] * size, 0
    for r in reversed(range(size)):
        ranges[r] = range(start, start + counts[r])
        start += counts[r]
    return ranges


def describe(ranges: list[range]) -> str:
    return ", ".join(f"rank {r}: layers {x.start}-{x.stop - 1}" for r, x in enumerate(ranges))


class Link:
    """This rank's place in the ring: who it hears from, who it sends to, and the watchdog
    that bounds every wait on them."""

    def __init__(self, group, ranges: list[range], limit: float):
        self.group, self.ranges, self.limit = group, ranges, limit
        self.rank, self.size = group.rank(), group.size()
        self.src, self.dst = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.lock = threading.Lock()  # one message exchange at a time on this rank
        self.sent_bytes = self.received_bytes = 0  # headers and hidden states, this rank
        self.broken: str | None = None  # why the ring failed (then nothing more is sent)
        self.failed = threading.Event()  # set with `broken` (`chatml serve` then exits)
        self.shortest = limit  # the shortest timeout of any rank (`connect`): pings beat it
        self.last_sent = time.monotonic()
        self._deadline: float | None = None
        self._waiting_for, self._waiting_s = "", 0.0
        self._wake = threading.Event()
        threading.Thread(target=self._watch, name="chatml-shard-watchdog", daemon=True).start()

    # ----- bounded waits ----------------------------------------------------------------------

    def wait(self, what: str, seconds: float | None = None):
        """A context for a transfer that must end within the timeout (or the process exits)."""
        link = self

        class _Wait:
            def __enter__(self):
                link._waiting_for, link._waiting_s = what, seconds or link.limit
                link._deadline = time.monotonic() + link._waiting_s
                link._wake.set()

            def __exit__(self, kind, error, tb):
                link._deadline = None
                # Only transfers run in here: MLX fails them with a RuntimeError when a peer's
                # connection closes ("[ring] connection to a peer was lost").
                if isinstance(error, RuntimeError) and not isinstance(error, ShardError):
                    link.broken = f"{link.who()}: {what} failed: a peer rank is gone ({error})"
                    link.failed.set()
                    raise ShardError(link.broken)

        return _Wait()

    def who(self) -> str:
        return f"chatml shard rank {self.rank} of {self.size}"

    def _watch(self) -> None:
        while True:
            deadline = self._deadline
            if deadline is None:
                self._wake.wait()
                self._wake.clear()
                continue
            left = deadline - time.monotonic()
            if left > 0:
                self._wake.wait(min(left, 1.0))
                self._wake.clear()
                continue
            if self._deadline == deadline:  # still the same wait: the peer hangs
                fatal(
                    f"{self.who()}: waited {self._waiting_s:g} s {self._waiting_for}; the peer rank "
                    "hangs or its machine is unreachable (CHATML_SHARD_TIMEOUT sets the limit)"
                )

    # ----- transfers --------------------------------------------------------------------------

    def send(self, x: mx.array, dst: int | None = None) -> None:
        mx.eval(mx.distributed.send(x, self.dst if dst is None else dst, group=self.group))
        self.sent_bytes += x.nbytes
        self.last_sent = time.monotonic()

    def recv(self, shape, dtype, src: int | None = None) -> mx.array:
        x = mx.distributed.recv(shape, dtype, self.src if src is None else src, group=self.group)
        mx.eval(x)
        self.received_bytes += x.nbytes
        return x

    def send_message(self, op: int, seq: int, payload: list[int]) -> None:
        self.send(mx.array([MAGIC, op, len(payload), seq], dtype=mx.int64))
        if payload:
            self.send(mx.array(payload, dtype=mx.int64))

    def send_packed(self, meta: list[int], buf: mx.array | None) -> None:
        """Arrays from `pack`: their shapes, then their bytes in one transfer."""
        self.send(mx.array([len(meta)], dtype=mx.int64))
        if meta:
            self.send(mx.array(meta, dtype=mx.int64))
            self.send(buf)

    def recv_packed(self) -> tuple[list[int], mx.array | None]:
        (n,) = self.recv((1,), mx.int64).tolist()
        if not n:
            return [], None
        meta = self.recv((n,), mx.int64).tolist()
        return meta, self.recv((packed_nbytes(meta),), mx.uint8)

    def recv_message(self) -> tuple[int, int, list[int]]:
        magic, op, n, seq = self.recv((4,), mx.int64).tolist()
        if magic != MAGIC:
            raise ShardError(f"{self.who()}: garbled message from rank {self.src} ({magic:#x})")
        payload = self.recv((n,), mx.int64).tolist() if n else []
        return op, seq, payload


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(arrays: list[mx.array]) -> tuple[list[int], mx.array | None]:
    """Arrays as one byte buffer (one transfer, whatever their number) and what it holds:
    per array its dtype (an index into DTYPES), its rank and four dimensions."""
    meta, parts = [], []
    for a in arrays:
        if a.dtype not in DTYPES or a.ndim > 4:
            raise ShardError(f"a {a.dtype} array of shape {a.shape} cannot travel")
        meta += [DTYPES.index(a.dtype), a.ndim, *a.shape, *[0] * (4 - a.ndim)]
        raw = a.reshape(-1).view(mx.uint8)
        pad = _padded(raw.size) - raw.size
        parts += [raw, mx.zeros((pad,), mx.uint8)] if pad else [raw]
    return meta, mx.concatenate(parts) if parts else None


def _shapes(meta: list[int]):
    for j in range(0, len(meta), 6):
        dtype, ndim = DTYPES[meta[j]], meta[j + 1]
        yield dtype, tuple(meta[j + 2 : j + 2 + ndim])


def packed_nbytes(meta: list[int]) -> int:
    return sum(_padded(dtype.size * math.prod(shape)) for dtype, shape in _shapes(meta))


def unpack(meta: list[int], buf: mx.array | None) -> list[mx.array]:
    """The arrays `pack` packed, each its own copy (a view would keep the buffer alive)."""
    out, at = [], 0
    for dtype, shape in _shapes(meta):
        n = dtype.size * math.prod(shape)
        out.append(mx.contiguous(buf[at : at + n].view(dtype).reshape(shape)))
        at += _padded(n)
    return out


def fatal(message: str) -> None:
    """End this rank now with `message`: its peers are gone, nothing can be saved."""
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_LOST)


joined: Link | None = None  # this process's place in its group, once `connect` ran

JOIN_NOTICE_S = 5.0  # a rank still waiting for its peers after this says so


@functools.cache
def join_group() -> mx.distributed.Group:
    """This process's group (`mx.distributed.init`), joined within 10x CHATML_SHARD_TIMEOUT.

    MLX's ring backend waits for every rank of the hostfile to connect, forever and silently,
    holding the GIL: a rank started by hand whose peer never comes would hang with no word.
    A watch process (`join_watch.py`) says what the rank waits for after a few seconds, and
    past the bound (or at a Ctrl+C) says why it gives up and kills it (no thread of this
    process could)."""
    limit = 10 * timeout()
    who = _who_before_init()
    hosts = os.environ.get("MLX_HOSTFILE", "unset")
    waiting = f"{who}: waiting for the other ranks of the group to start (MLX_HOSTFILE {hosts})"
    gave_up = (
        f"{who}: the group did not form within {limit:g} s: start every rank of the hostfile "
        "(`mlx.launch` does) and check that they reach each other (10x CHATML_SHARD_TIMEOUT "
        "sets the limit); ending this rank"
    )
    interrupted = f"{who}: interrupted while waiting for the other ranks; ending this rank"
    # Started with SIGINT blocked (the mask is inherited): a Ctrl+C before its handler is in
    # place waits for it rather than killing the watch, which would leave the join unbounded.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        watch = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).with_name("join_watch.py")),
             str(os.getpid()), str(min(JOIN_NOTICE_S, limit)), str(limit), waiting, gave_up,
             interrupted],
            stdin=subprocess.PIPE,
        )  # fmt: skip
    except OSError as e:  # no interpreter to run it (an embedded Python): join all the same
        print(f"{who}: joining without a time limit (the watch did not start: {e})",
              file=sys.stderr, flush=True)  # fmt: skip
        return mx.distributed.init()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        return mx.distributed.init()
    finally:
        watch.stdin.close()  # joined (or failed): the watch ends
        watch.wait()


def _who_before_init() -> str:
    rank = os.environ.get("MLX_RANK")
    return f"chatml shard rank {rank}" if rank is not None else "chatml shard"


@functools.cache
def code_digest() -> str:
    """A digest of the engine's and the kernels' sources on this rank: two checkouts of one
    protocol with different layer code would run together and answer inexactly."""
    digest = hashlib.sha256()
    for package in ("engine", "kernels"):
        root = Path(__file__).resolve().parents[2] / package
        for file in sorted(root.rglob("*")):
            if file.suffix in (".py", ".cpp", ".h") and "__pycache__" not in file.parts:
                digest.update(file.relative_to(root.parent).as_posix().encode() + b"\0")
                digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def connect(ckpt, options: dict) -> Link:
    """Join the launched group, check every rank loads the same checkpoint with the same
    options, and plan the split. Raises ShardError on every rank when they disagree."""
    if not mx.distributed.is_available():
        raise ShardError("shard='pipeline' needs mlx.distributed, which this MLX build lacks")
    group = join_group()
    if group.size() < 2:
        raise ShardError(
            "shard='pipeline' runs in a launched group of 2 or more processes, and this one is "
            "alone: start it with `mlx.launch -n 2 --backend ring -- ...` (or a hostfile)"
        )
    arch = ckpt.entry.arch
    ranges = plan(arch.num_hidden_layers, group.size())
    global joined
    link = joined = Link(group, ranges, timeout())
    # 16 bytes of checkpoint fingerprint and 16 of the options' digest, from every rank.
    settings = repr(sorted(options.items())) + f"protocol={PROTOCOL} code={code_digest()}"
    mine = (
        ckpt.fingerprint.encode()[:16].ljust(16) + hashlib.sha256(settings.encode()).digest()[:16]
    )
    with link.wait("for every rank to join", max(10 * link.limit, 600.0)):
        everyone = mx.distributed.all_gather(mx.array(list(mine), dtype=mx.uint8), group=group)
        rows = bytes(everyone.tolist())
    rows = [rows[i : i + 32] for i in range(0, len(rows), 32)]
    prints = [r[:16].decode(errors="replace").strip() for r in rows]
    if len(set(prints)) > 1:
        have = ", ".join(f"rank {i}: {p}" for i, p in enumerate(prints))
        raise ShardError(
            f"the ranks disagree on the checkpoint ({have}): every rank must load the same "
            f"files (this rank loads {ckpt.path})"
        )
    if len({r[16:] for r in rows}) > 1:
        raise ShardError(
            "the ranks disagree on the load options (dtype, quantize, chunked_delta) or the "
            "engine's code: launch the same command from the same version on every rank (this "
            f"rank: {options}, code {code_digest()})"
        )
    # Each rank reads its own CHATML_SHARD_TIMEOUT: an idle rank 0 must ping within the
    # shortest, or a follower with a shorter one takes it for dead.
    with link.wait("for every rank's timeout", max(10 * link.limit, 600.0)):
        limits = mx.distributed.all_gather(mx.array([link.limit], dtype=mx.float32), group=group)
        link.shortest = min(link.limit, *limits.tolist())
    return link


def ready(link: Link) -> None:
    """Wait until every rank has loaded its weights (loading may take minutes: the bound is
    ten times the usual one, at least 10 minutes)."""
    with link.wait("for every rank to load its layers", max(10 * link.limit, 600.0)):
        mx.eval(mx.distributed.all_sum(mx.array(1), group=link.group))


def selector(link: Link):
    """Which checkpoint tensors (in the model's naming) this rank loads."""
    mine = link.ranges[link.rank]

    def select(key: str) -> bool:
        if key.startswith("layers."):
            return int(key.split(".", 2)[1]) in mine
        return link.rank == 0  # embedding, final norm, LM head

    return select


def layer_list(arch: Architecture, mine: range, options: ModelOptions) -> list:
    """The model's layer list with only `mine` present: checkpoint names keep their numbers."""
    kinds = arch.layer_types
    return [DecoderLayer(arch, kinds[i], options) if i in mine else None for i in range(len(kinds))]


# ----- rank 0 ---------------------------------------------------------------------------------


_released: collections.deque[int] = collections.deque()  # handles rank 0 no longer holds
_released_sets: collections.deque[int] = collections.deque()
_ids = itertools.count(1)
_count = {"made": 0, "released": 0}  # RemoteArrays made, and released in messages sent


class RemoteArray:
    """Stands for an array held by a follower rank (a recurrent cache's conv tail or state)."""

    __slots__ = ("id", "nbytes", "__weakref__")

    def __init__(self, nbytes: int):
        self.id, self.nbytes = next(_ids), nbytes
        _count["made"] += 1  # on the model thread only

    def __del__(self):
        _released.append(self.id)  # deque.append is atomic: any thread may drop the last ref


class _CacheSet:
    """One `make_caches()` call: its follower-side KV caches live as long as this does."""

    def __init__(self):
        self.id = next(_ids)
        weakref.finalize(self, _released_sets.append, self.id)


class RemoteKVCache(KVCache):
    """A follower's attention cache as rank 0 sees it: the offset and the buffer size."""

    def __init__(self, owner: _CacheSet, token_bytes: int):
        super().__init__()
        self.owner, self.token_bytes, self.capacity = owner, token_bytes, 0

    def advance(self, n: int) -> None:
        end = self.offset + n
        if end > self.capacity:  # grows as KVCache.update does
            self.capacity = ((end + KV_STEP - 1) // KV_STEP) * KV_STEP
        self.offset = end

    def update(self, k, v):
        raise ShardError("this layer's attention cache lives on another rank")

    def load_state(self, keys: mx.array, values: mx.array) -> None:
        """Stand for `keys.shape[2]` positions (the arrays go to the follower: `Upload`)."""
        self.offset = self.capacity = 0
        self.advance(keys.shape[2])

    @property
    def nbytes(self) -> int:
        return self.capacity * self.token_bytes


class RemoteRecurrentCache(RecurrentCache):
    """A follower's Gated DeltaNet cache as rank 0 sees it: `conv` and `state` are handles."""

    def __init__(self, owner: _CacheSet, conv_bytes: int, state_bytes: int):
        super().__init__()
        self.owner, self.conv_bytes, self.state_bytes = owner, conv_bytes, state_bytes


def _ref(a: RemoteArray | None) -> int:
    return 0 if a is None else a.id


@dataclass(frozen=True)
class Wanted:
    """An array a follower holds, asked for by rank 0 (`PipelineModel.fetch`): a recurrent
    array (`HANDLE`, `ref` a RemoteArray) or the first `rows` KV rows of an attention layer's
    cache (`KEYS` or `VALUES`, `ref` a RemoteKVCache)."""

    layer: int
    kind: int
    ref: RemoteArray | RemoteKVCache
    rows: int = 0

    def wire(self) -> list[int]:
        ref = self.ref.id if self.kind == HANDLE else self.ref.owner.id
        return [self.layer, self.kind, ref, self.rows]


class Upload:
    """Arrays bound for the followers' layers (a state read from disk), collected while the
    state is checked and sent at once by `PipelineModel.upload`: nothing travels for a state
    that turns out unusable (its handles are released with the next message)."""

    def __init__(self):
        self.items: list[tuple[int, int, int, mx.array]] = []  # layer, kind, ref, array

    def handle(self, layer: int, a: mx.array | None) -> RemoteArray | None:
        """A handle for `a`, which is to live on the rank holding `layer`."""
        if a is None:
            return None
        h = RemoteArray(a.nbytes)
        self.items.append((layer, HANDLE, h.id, a))
        return h

    def kv(self, layer: int, cache: RemoteKVCache, keys: mx.array, values: mx.array) -> None:
        cache.load_state(keys, values)
        self.items += [(layer, KEYS, cache.owner.id, keys), (layer, VALUES, cache.owner.id, values)]


class PipelineModel(LanguageHead, nn.Module):
    """Rank 0's model: the embedding, its layers, the norm and the head; the other layers
    run on the followers, reached through `hidden`. The interface of `model.Qwen35`."""

    def __init__(self, arch: Architecture, options: ModelOptions, link: Link, dtype: mx.Dtype):
        super().__init__()
        self.arch = arch
        self._link, self._dtype = link, dtype
        self._start = link.ranges[0].start  # layers before this are remote
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = layer_list(arch, link.ranges[0], options)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self._seq = itertools.count(1)
        self.steps = 0  # forward exchanges (a prefill chunk, a decode or verify step)
        self.decode_steps = self.decode_bytes = 0  # one-token steps, bytes rank 0 moved for them
        self.stopped = False

    @property
    def link(self) -> Link:
        return self._link

    def make_caches(self) -> list:
        a, itemsize = self.arch, self._dtype.size  # the dtype the followers' caches hold
        owner = _CacheSet()
        conv = (a.linear_conv_kernel_dim - 1) * a.linear_conv_dim * itemsize
        state = a.linear_num_value_heads * a.linear_value_head_dim * a.linear_key_head_dim * 4
        kv = 2 * a.num_key_value_heads * a.head_dim * itemsize
        caches = []
        for i, kind in enumerate(a.layer_types):
            if i >= self._start:
                caches.append(RecurrentCache() if kind == "linear_attention" else KVCache())
            elif kind == "linear_attention":
                caches.append(RemoteRecurrentCache(owner, conv, state))
            else:
                caches.append(RemoteKVCache(owner, kv))
        return caches

    def hidden(self, ids: mx.array, caches: list) -> mx.array:
        """Run every layer on ids `[1, T]` (the remote ones on their ranks); returns the
        final-normed hidden states `[1, T, H]`."""
        B, T = ids.shape
        if B != 1:
            raise ShardError("pipeline sharding runs one sequence per step (batch 1)")
        remote = caches[: self._start]
        x = self.embed_tokens(ids)  # [1, T, H]
        if x.dtype not in DTYPES:
            raise ShardError(f"hidden states in {x.dtype} cannot travel (one of {DTYPES})")
        payload, commit = self._forward_payload(remote, T, DTYPES.index(x.dtype))
        mx.eval(x)  # its inputs (a sampled token) are computed here, not inside a transfer
        with self._link.lock:
            self._check()
            moved = self._link.sent_bytes + self._link.received_bytes
            with self._link.wait("for the followers to take a step"):
                self._link.send_message(OP_FORWARD, next(self._seq), payload)
                self._link.send(x)
            with self._link.wait(f"for rank 1's hidden states ({T} positions)"):
                h = self._link.recv(x.shape, x.dtype)
        commit()
        self.steps += 1
        if T == 1:
            self.decode_steps += 1
            self.decode_bytes += self._link.sent_bytes + self._link.received_bytes - moved
        for layer, cache in zip(self.layers[self._start :], caches[self._start :]):
            h = layer(h, cache)
        return self.norm(h)

    def _forward_payload(self, remote: list, T: int, dtype: int):
        """The step's message for the followers, and what to do on rank 0 once it ran."""
        caps = sorted(
            {p for c in remote if isinstance(c, RecurrentCache) for p in c.capture if 0 < p < T}
        )
        owner = remote[0].owner if remote else None
        payload = _releases() + [_ref(owner), T, dtype, len(caps), *caps]
        after = []
        for c in remote:
            if isinstance(c, RemoteKVCache):
                payload.append(c.offset)
                continue
            payload += [c.offset, _ref(c.conv), _ref(c.state)]
            out = [(RemoteArray(c.conv_bytes), RemoteArray(c.state_bytes)) for _ in caps + [T]]
            payload += [r.id for pair in out for r in pair]
            after.append((c, out))

        def commit():
            for c in remote:
                if isinstance(c, RemoteKVCache):
                    c.advance(T)
            for c, out in after:
                for p, (conv, state) in zip(caps, out):
                    if p in c.capture:
                        c.record(p, conv, state)
                c.update(*out[-1], T)

        return payload, commit

    def _rank_of(self, layer: int) -> int:
        return next(r for r, mine in enumerate(self._link.ranges) if layer in mine)

    def fetch(self, wanted: list[Wanted]) -> list[mx.array]:
        """Copies of the arrays `wanted` names, from the followers holding them (to write a
        state file: see the module docstring). The followers answer along the ring, rank N-1's
        arrays first; each one's in the order asked."""
        order = sorted(range(len(wanted)), key=lambda j: -self._rank_of(wanted[j].layer))
        payload = _releases() + [len(wanted)] + [x for w in wanted for x in w.wire()]
        with self._link.lock:
            self._check()
            with self._link.wait("asking the followers for cache states"):
                self._link.send_message(OP_FETCH, next(self._seq), payload)
            with self._link.wait(f"for {len(wanted)} cache arrays from the followers"):
                meta, buf = self._link.recv_packed()
        arrays = unpack(meta, buf)
        if len(arrays) != len(wanted):
            raise ShardError(f"asked the followers for {len(wanted)} arrays, got {len(arrays)}")
        out: list = [None] * len(wanted)
        for j, a in zip(order, arrays):
            out[j] = a
        mx.eval(out)
        return out

    def upload(self, upload: Upload) -> None:
        """Send a state's arrays to the followers, under the handles `upload` made."""
        if not upload.items:
            return
        refs = [x for layer, kind, ref, _ in upload.items for x in (layer, kind, ref)]
        meta, buf = pack([a for *_, a in upload.items])
        mx.eval(buf)
        payload = _releases() + [len(upload.items), *refs]
        with self._link.lock:
            self._check()
            with self._link.wait(f"sending {buf.nbytes} bytes of cache states to the followers"):
                self._link.send_message(OP_STORE, next(self._seq), payload)
                self._link.send_packed(meta, buf)

    def fork_kv(self, src: list, dst: list, rows: int) -> None:
        """`dst`'s remote attention caches take the first `rows` rows of `src`'s (a pool fork:
        `pool.fork` copies the local ones): the followers copy them from one cache set to the
        other, in their buffers, before any later step moves `src` on."""
        pairs = [(s, d) for s, d in zip(src, dst) if isinstance(d, RemoteKVCache)]
        if not pairs:
            return
        payload = _releases() + [pairs[0][0].owner.id, pairs[0][1].owner.id, rows]
        with self._link.lock:
            self._check()
            with self._link.wait("asking the followers to copy attention caches"):
                self._link.send_message(OP_COPY, next(self._seq), payload)
        for _, d in pairs:
            d.offset = d.capacity = 0
            d.advance(rows)

    def ping(self) -> None:
        """An idle rank 0 tells the followers it lives (and what they may free)."""
        with self._link.lock:
            if self.stopped or self._link.broken:
                return
            with self._link.wait("sending a heartbeat"):
                self._link.send_message(OP_PING, next(self._seq), _releases())

    def stop(self) -> None:
        """Tell the followers to exit (rank 0 is done). Later steps raise ShardError."""
        with self._link.lock:
            if self.stopped or self._link.broken:
                return
            self.stopped = True
            # What rank 0 still names: a follower holding more has missed a release.
            payload = _releases() + [_count["made"] - _count["released"]]
            with self._link.wait("stopping the followers"):
                self._link.send_message(OP_STOP, next(self._seq), payload)

    def _check(self) -> None:
        if self._link.broken:
            raise ShardError(self._link.broken)
        if self.stopped:
            raise ShardError("the pipeline was stopped: its follower ranks have exited")


def _releases() -> list[int]:
    out = []
    for queue in (_released, _released_sets):
        items = []
        while queue:
            items.append(queue.popleft())
        out += [len(items), *items]
    _count["released"] += out[0]
    return out


def heartbeat(model: PipelineModel, worker_of) -> None:
    """Ping the followers from the engine's model thread whenever the link has been quiet for
    a while: `worker_of()` gives the engine's worker (None: the engine is gone). A ping is a
    plain job: it runs between the turns of open generations too (one whose consumer stalls
    included). Once the engine is collected while the process lives on, this thread pings
    itself (nothing else uses the model then), so the followers wait for the exit's stop."""
    from .worker import Job

    every = max(model.link.shortest / 8, 0.05)

    def ping():  # a job on the model thread, or a ping from here (no worker: None)
        worker = worker_of()  # not held across the sleeps: it would keep the engine alive
        if worker is None:
            with contextlib.suppress(ShardError):  # a broken link ends the loop
                model.ping()
            return None
        try:
            return worker.submit(Job(lambda job: model.ping()))
        except RuntimeError:  # the worker stopped (engine closed): a new one comes
            return None

    def loop():
        pending = None
        while not model.stopped and not model.link.broken:
            time.sleep(every)
            quiet = time.monotonic() - model.link.last_sent >= every
            if quiet and (pending is None or pending.done.is_set()):
                pending = ping()

    threading.Thread(target=loop, name="chatml-shard-heartbeat", daemon=True).start()


def attach(engine) -> None:
    """Rank 0's engine is ready: keep the followers alive while it idles, and tell them to
    exit when this process does."""
    model, ref = engine.model, weakref.ref(engine)

    def worker_of():
        eng = ref()
        return None if eng is None else eng.worker

    heartbeat(model, worker_of)
    atexit.register(_stop_at_exit, model, ref)
    _exit_on_sigterm()


def _exit_on_sigterm() -> None:
    """Let SIGTERM end rank 0 as an exit does, so `_stop_at_exit` tells the followers to stop
    (by default the signal kills the process at once: they would see a lost peer, exit 3).
    `chatml serve` installs its own handler around uvicorn (`serving.server._stop_signals`),
    which returns normally after closing the engine: a handler someone else installed is left
    alone, so this one covers the other entry points (`chatml chat`, the Python API)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))


def _stop_at_exit(model: PipelineModel, ref) -> None:
    eng = ref()
    worker = None if eng is None else eng._worker
    try:
        if worker is not None and worker.alive:
            worker.call(model.stop)  # the model thread owns MLX work while it lives
        else:
            model.stop()
    except Exception as e:  # the followers are gone already: they exit on their own
        print(f"{model.link.who()}: could not stop the followers ({e})", file=sys.stderr)
