"""`Engine`: one loaded model (weights, tokenizer, registry entry) shared by its sessions."""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .checkpoints.loader import (
    Checkpoint,
    CheckpointError,
    inspect,
    load_tokenizer,
    load_weights,
    resolve,
    weights_nbytes,
)
from .checkpoints.registry import DEFAULT_MODEL, ModelEntry
from .checkpoints.tokenizer import Tokenizer
from .runtime import memory
from .runtime.batch import DEFAULT_MAX_BATCH, DEFAULT_PASS_TOKENS, Batch
from .runtime.dense import use_dense_kernels
from .runtime.draft import DraftModel
from .runtime.fused import join_projections
from .runtime.model import ModelOptions, Qwen35
from .runtime.mtp import MTPDrafter
from .runtime.quantized import quantize_model, use_cpu_kernels
from .runtime.snapshot import CacheBudget
from .runtime.speculative import LookupDrafter, Speculation
from .runtime.worker import ModelThread

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def backend() -> str:
    """'gpu' when MLX computes on a GPU (Metal or CUDA), else 'cpu'."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


@dataclass
class Engine:
    model: Qwen35
    tokenizer: Tokenizer
    entry: ModelEntry
    checkpoint: Checkpoint
    dtype: mx.Dtype
    stop_ids: tuple[int, ...] = field(default=())
    budget: CacheBudget = field(default_factory=CacheBudget)
    # One computation on the model at a time (sessions, warm-up, the server's worker).
    lock: threading.RLock = field(default_factory=threading.RLock)
    # Set while foreground work waits for the lock: background work yields at its next chunk.
    _yield: threading.Event = field(default_factory=threading.Event)
    _worker: ModelThread | None = field(default=None, repr=False)
    _worker_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stateless: object = field(default=None, repr=False)
    # The disk tier of the pool's prefix cache (engine/storage/disk_cache.py), if enabled.
    disk: object = field(default=None, repr=False)
    # Speculative decoding for every answer whose sampler allows it (None: plain decoding).
    speculative: Speculation | None = None
    # Generations decoding together at most (continuous batching; 1: one after another).
    max_batch: int = DEFAULT_MAX_BATCH
    # Tokens in one forward pass at most: bounds how long a prefill stalls the rows decoding.
    pass_tokens: int = DEFAULT_PASS_TOKENS
    _batch: Batch | None = field(default=None, repr=False)
    # Bits the weights were quantized to at load (`load(quantize=)`), None if as stored.
    quantize: int | None = None

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def fingerprint(self) -> str:
        """Names the weights the model computes with: saved caches are reused only under the
        same (the checkpoint's, and how it was quantized at load)."""
        bits = f"-q{self.quantize}" if self.quantize else ""
        return self.checkpoint.fingerprint + bits

    @property
    def sharded(self) -> bool:
        """True when the layers are split over a launched group (rank 0's engine)."""
        return getattr(self.model, "link", None) is not None

    @contextmanager
    def foreground(self):
        """Hold the model for a user-facing computation, interrupting background work."""
        self._yield.set()
        with self.lock:
            self._yield.clear()
            yield

    @property
    def sampling_defaults(self) -> dict:
        """SamplingParams fields from the checkpoint's generation_config.json (what the CLI and
        the server start from; the Python API stays greedy unless told otherwise)."""
        from .checkpoints.generation import sampling_defaults

        return sampling_defaults(self.checkpoint.generation)

    def background_should_yield(self) -> bool:
        """True when idle-time work should stop at its next chunk: other work wants the model."""
        worker = self._worker
        return self._yield.is_set() or (worker is not None and worker.should_yield())

    @property
    def worker(self) -> ModelThread:
        """The engine's model-owner thread (started on first use): all MLX work runs there."""
        with self._worker_lock:
            if self._worker is None or not self._worker.alive:
                if self._batch is None:
                    self._batch = Batch(self.model, self.max_batch, self.pass_tokens)
                self._worker = ModelThread(self.lock, batch=self._batch,
                                           max_tasks=self.max_batch)  # fmt: skip
                # Stopped when the engine goes away, or at exit: no MLX work outlives Python.
                weakref.finalize(self, self._worker.stop)
            return self._worker

    def set_max_batch(self, n: int) -> None:
        """Decode at most `n` generations together (and start at most `n` at once)."""
        _check_count("max_batch", n)
        self.max_batch = n
        if self._batch is not None:
            self._batch.max_rows = n
        worker = self._worker  # once: close() on another thread may clear it
        if worker is not None:
            worker.max_tasks = n
            worker._wake.set()  # generations waiting for room start now

    def set_pass_tokens(self, n: int) -> None:
        """Run at most `n` tokens in one forward pass: prefill chunks are cut to fit beside
        the rows decoding, whose stall per step that bounds."""
        _check_count("pass_tokens", n)
        self.pass_tokens = n
        if self._batch is not None:
            self._batch.pass_tokens = n
        worker = self._worker  # None after close() (the batch stays for the next thread)
        if worker is not None:
            worker._wake.set()

    def batch_here(self) -> Batch | None:
        """The batch a generation running here files its decode steps with: inside a task's
        turn on the model thread, else None (the steps run at once)."""
        worker = self._worker
        return worker.batch if worker is not None and worker.in_task() else None

    @property
    def batch_stats(self) -> dict:
        """Passes the batch ran so far (decode steps, prefill chunks), the rows and tokens
        they carried, the widest (in rows) and the longest (in tokens: at most
        `pass_tokens`, see `batch.Batch`)."""
        b = self._batch
        keys = ("steps", "rows", "widest", "tokens", "longest")
        return {k: getattr(b, k) if b else 0 for k in keys}

    def close(self) -> None:
        """Stop the model thread (after its running job); a later call starts a new one.

        The disk cache, if any, finishes its writes and releases its folder (it is detached)."""
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
        self.detach_disk()

    def attach_disk(self, directory=None, max_bytes: int | None = None, **options) -> object:
        """Give the prefix cache a disk tier in `directory` (engine/storage/disk_cache.py):
        what the budget evicts from pool and session sequences, and each turn's resume point,
        are kept there and read back when a prompt's longest reusable prefix is there.
        Raises DiskCacheBusy if another process has it (`lock=`: a `FolderLock` the caller
        took on it already, before loading the model, so that a busy folder fails first)."""
        from .storage.disk_cache import DiskCache

        self.detach_disk()
        self.disk = DiskCache(self, directory, max_bytes, **options)
        self.budget.spill = self.disk.spill
        return self.disk

    def save_pool(self) -> None:
        """Write every pool sequence's live end and last snapshots to the disk tier and wait
        for the writes (a server shutting down: the next one resumes from there)."""
        if self.disk is None or self._stateless is None:
            return
        pool = self._stateless.pool
        self.worker.call(lambda: [self.disk.store_sequence(s) for s in pool.sequences])
        self.disk.flush()

    def detach_disk(self) -> None:
        disk, self.disk = self.disk, None
        if disk is not None:
            self.budget.spill = None
            disk.close()

    @property
    def stateless(self):
        """The engine-wide stateless chat (`engine.stateless.StatelessChat`): its renderer and
        its pool of cached sequences, shared by `chat`, `chat_stream` and `chatml serve`."""
        with self._worker_lock:
            if self._stateless is None:
                from .stateless import StatelessChat

                self._stateless = StatelessChat(self)
            return self._stateless

    def chat(self, messages: list[dict], **options):
        """Answer a whole conversation (OpenAI-style `messages`); returns the Turn.

        Stateless: send the whole conversation each time; what earlier calls computed is
        reused through the engine's pool of cached sequences. Options as `chat_stream`.
        """
        from .stateless import last

        return last(self.chat_stream(messages, **options))

    def chat_choices(self, messages: list[dict], n: int, **options) -> list:
        """`n` answers (1 to 8) to one conversation, as the server's `n` gives them: the
        prompt is prefilled once, the other answers fork from its end and decode together,
        and with a `seed` answer i is the one `seed + i` gives alone. Options as
        `chat_stream`; returns the Turns in order."""
        from .stateless import chat_choices

        return chat_choices(self, messages, n, **options)

    def chat_stream(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        logit_bias: dict[int, float] | None = None,
        enable_thinking: bool | None = None,
        preserve_thinking: bool | None = None,
        max_exchanges: int | None = None,
        context_window: int | None = None,
        warm: bool = True,
        response_format: dict | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        max_thinking_tokens: int | None = None,
        reasoning_effort: str | None = None,
    ):
        """Yield the answer's text pieces, then the Turn (see `chat`).

        The server's checks, rendering, tool calls, thinking split and stop strings. Every
        message is kept, and a conversation past the context window (`context_window`,
        default the model's) is a `ChatError`, unless `max_exchanges` keeps only that many
        earlier exchanges (fewer if the window needs it), as a Session does. `max_tokens`
        defaults to 512 within the window. `warm` prefills the conversation's likely next
        prompt while the engine is idle. The sampling options are the server's, greedy unless
        told otherwise (`**eng.sampling_defaults` passes the checkpoint's, as the server uses
        them). Bad input raises `ChatError` (a ValueError) here, before anything runs;
        several threads may call at once (served one after another).
        `response_format` (OpenAI's text / json_object / json_schema) and `tool_choice`
        ("required" or {"type": "function", "function": {"name": ...}}) constrain decoding;
        `logit_bias` ({token id: -100 to 100}) shifts those tokens' logits (-100 bans one);
        `logprobs`/`top_logprobs` fill `Turn.logprobs`; `max_thinking_tokens` or
        `reasoning_effort` (low/medium/high) bound the think block.
        """
        from .stateless import chat_stream

        return chat_stream(
            self, messages, tools=tools, tool_choice=tool_choice, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=stop, logit_bias=logit_bias,
            enable_thinking=enable_thinking, preserve_thinking=preserve_thinking,
            max_exchanges=max_exchanges, context_window=context_window, warm=warm,
            response_format=response_format, logprobs=logprobs, top_logprobs=top_logprobs,
            max_thinking_tokens=max_thinking_tokens, reasoning_effort=reasoning_effort,
        )  # fmt: skip

    def session(self, system: str | None = None, **options):
        """A conversation on this engine (see `engine.session.Session`)."""
        from .session import Session

        return Session(self, system=system, **options)


def _check_count(name: str, n) -> None:
    """A setting that counts something (rows, tokens) must be an int >= 1 (not a bool)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}")


def load(
    model: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: str | None = None,
    chunked_delta: bool = True,
    cache_bytes: int | None = None,
    quantize: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    disk_cache_bytes: int | None = None,
    speculative: str | None = None,
    num_draft: int = 4,
    max_batch: int = DEFAULT_MAX_BATCH,
    pass_tokens: int = DEFAULT_PASS_TOKENS,
    shard: str | None = None,
) -> Engine:
    """Load a model: a models.yaml alias, a local checkpoint folder, or a Hub id.

    The embedded models (`"tiny-chat"`, the default, and `"tiny"`) are built on first use
    (offline, deterministic) under CHATML_HOME. Hub ids go through the ordinary Hugging Face
    client and its cache (needs network the first time).
    `dtype` overrides the registry's compute dtype for this backend (float32 on CPUs).
    Quantized checkpoints stay quantized: on CPUs their matmuls go through the native kernels
    (`kernels.native`: a GEMV over the compact weights for decode, float32 BLAS for prefill);
    float32 products of a few rows (decode, batched decode, speculative verify) take its
    float32 GEMV;
    mixture-of-experts checkpoints are dequantized on CPUs. `quantize=8|4` quantizes a float
    checkpoint at load (MLX's affine format, group 64, as `mlx_lm.convert` writes it).
    `cache_bytes` bounds all sessions' caches and snapshots (default: half of what the
    weights leave of the memory MLX may use on this device, see `runtime.memory`). Weights
    that cannot fit the device raise `CheckpointError` (with both sizes) before loading.
    `cache_dir` gives the engine's prefix cache a disk tier there, of at most
    `disk_cache_bytes` (default: 8 GiB or a tenth of the free space, the lesser), used by
    `Engine.chat` and by sessions: each turn writes where its conversation resumes, so another
    process on the same folder later reuses it instead of prefilling; see `Engine.attach_disk`.
    A folder another process holds raises `DiskCacheBusy` at once, before the model loads.
    `speculative="lookup"` drafts up to `num_draft` tokens by prompt lookup and verifies them
    in one step; `"mtp"` drafts them with the checkpoint's MTP head (its `mtp.*` weights,
    which quantized mlx-community conversions drop: `CheckpointError` then). Greedy output is
    unchanged; penalties, a thinking budget, grammars and logprobs apply as in plain
    decoding (`runtime.speculative`). `"draft:NAME"` drafts with another model (a registry
    name, folder or Hub id with the same tokenizer, loaded in the same dtype), greedily from
    its own caches.
    `max_batch`: how many concurrent generations (sessions, `Engine.chat` calls from several
    threads, server requests) decode together in one forward pass per step; `pass_tokens`:
    the most tokens one pass runs, so a prompt being prefilled stalls the rows decoding beside
    it for one such pass at a time (its chunks are cut to fit).
    `shard="pipeline"`, in every process of a group started by `mlx.launch`, splits the layers
    over the processes (engine/runtime/shard.py): each loads only its layers. Rank 0 returns
    the Engine; on the other ranks `load` serves rank 0 and exits the process when it is done.
    A sharded model steps its generations one row at a time (no batched decode pass yet).
    Its state files (persisted sessions, `cache_dir`) are written and read by rank 0 alone,
    with every layer gathered in: they are the files one process writes (only rank 0 needs
    `cache_dir`, and the session store: the other ranks ignore it), and resume under any
    split or none.
    """
    if isinstance(model, str) and not model.strip():  # Path("") would be the current folder
        raise ValueError("model must be a registry alias, a checkpoint folder or a Hub id, got ''")
    for name, value in (("cache_bytes", cache_bytes), ("disk_cache_bytes", disk_cache_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):  # fmt: skip
            raise ValueError(f"{name} must be a number of bytes (an integer >= 0) or None, "
                             f"got {value!r}")  # fmt: skip
    if dtype is not None and (not isinstance(dtype, str) or dtype not in _DTYPES):
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or None, got {dtype!r}")
    if quantize is not None and (type(quantize) is not int or quantize not in (4, 8)):
        raise ValueError(f"quantize must be 8 or 4 (bits) or None, got {quantize!r}")
    _check_count("max_batch", max_batch)  # here too: not after the weights are loaded
    _check_count("pass_tokens", pass_tokens)
    spec = speculation(speculative, num_draft)
    if shard not in (None, "pipeline"):
        raise ValueError(f"shard must be 'pipeline' or None, got {shard!r}")
    folder = None
    # A folder another process holds fails now, not after the load. A pipeline's follower
    # ranks never use it (rank 0 alone reads and writes state files): a script started the
    # same way on every rank passes it everywhere, and on one machine they would collide.
    if cache_dir is not None and (not shard or _group_rank() == 0):
        from .storage.disk_cache import FolderLock

        folder = FolderLock(cache_dir)
    try:
        eng = _load(model, dtype=dtype, chunked_delta=chunked_delta, cache_bytes=cache_bytes,
                    quantize=quantize, speculative=speculative, spec=spec, max_batch=max_batch,
                    pass_tokens=pass_tokens, shard=shard)  # fmt: skip
    except BaseException:
        if folder is not None:
            folder.release()
        raise
    if folder is not None:
        eng.attach_disk(cache_dir, disk_cache_bytes, lock=folder)
        weakref.finalize(eng, eng.disk.close)  # its writes finish even if close() is not called
    return eng


def _group_rank() -> int:
    """This process's rank in its launched group (0 alone, or without mlx.distributed:
    `shard.connect` says what is wrong then)."""
    if not mx.distributed.is_available():
        return 0
    from .runtime.shard import join_group

    return join_group().rank()


def _load(model, *, dtype, chunked_delta, cache_bytes, quantize, speculative, spec, max_batch,
          pass_tokens, shard) -> Engine:  # fmt: skip
    """`load` less the disk tier (its arguments checked, `spec` made from `speculative`)."""
    path, entry = resolve(model)
    ckpt = inspect(path, entry)
    mtp = speculative == "mtp"
    if mtp and not (ckpt.mtp_tensors and ckpt.entry.arch.mtp_num_hidden_layers):
        raise CheckpointError(
            f"{path}: speculative='mtp' needs the checkpoint's MTP head, and it has none "
            f"({ckpt.mtp_tensors} mtp.* tensors, mtp_num_hidden_layers="
            f"{ckpt.entry.arch.mtp_num_hidden_layers}); quantized mlx-community conversions "
            "drop it: load the bf16 checkpoint (quantize= at load keeps the head), or use "
            "speculative='lookup'"
        )
    name = (
        dtype
        or os.environ.get("CHATML_DTYPE")
        or ckpt.entry.compute_dtype.get(backend(), "float32")
    )
    if name not in _DTYPES:
        raise ValueError(f"CHATML_DTYPE must be one of {', '.join(_DTYPES)}, got {name!r}")
    if ckpt.entry.arch.is_moe and backend() == "cpu" and name != "float32":
        raise ValueError(
            f"{name} mixture-of-experts models need a GPU: MLX's CPU gather_mm (the routed "
            "experts) supports float32 only; use dtype='float32' on a CPU"
        )
    if quantize and ckpt.quantization:
        raise ValueError(f"quantize={quantize}: {path} is already quantized")
    cpu = backend() == "cpu"
    if quantize and cpu and ckpt.entry.arch.is_moe:
        raise ValueError("quantize= on a CPU supports dense models (MoE experts need float32)")
    dequantize = cpu and ckpt.entry.arch.is_moe  # dense quantized layers use kernels.native
    link = select = None
    if shard:
        if mtp:
            raise ValueError("speculative='mtp' is not available with shard= yet")
        from .runtime import shard as sharding

        options = {"dtype": name, "quantize": quantize, "chunked_delta": chunked_delta}
        link = sharding.connect(ckpt, options)
        select = sharding.selector(link)
    mem = memory.device_memory()
    need = weights_nbytes(
        ckpt, _DTYPES[name].size, dequantize_quantized=dequantize, mtp=mtp, select=select
    )
    if problem := memory.fits(need, mem):  # before loading: not a swap storm or a crash
        raise CheckpointError(f"{path}: {problem}")
    wired, warning = memory.wired_limit(need, mem)
    if warning:
        warnings.warn(warning, stacklevel=2)
    if wired:
        mx.set_wired_limit(wired)
    arch = ckpt.entry.arch
    model_options = ModelOptions(chunked_delta=chunked_delta,
                                 native_activations=cpu and name == "float32" and _native_cpu())  # fmt: skip
    if link is None:
        net = Qwen35(arch, model_options, mtp=mtp)
    elif link.rank == 0:
        net = sharding.PipelineModel(arch, model_options, link, _DTYPES[name])
    else:
        from .runtime.follower import Stage

        net = Stage(arch, model_options, link)
    load_weights(ckpt, net, _DTYPES[name], dequantize_quantized=dequantize, select=select)
    if quantize:
        quantize_model(net, quantize)
    if cpu and (quantize or (ckpt.quantization and not dequantize)):
        _native_cpu()  # build (once, into CHATML_HOME) or report the fallback now, not mid-turn
        use_cpu_kernels(net)
    if cpu and name == "float32" and _native_cpu():  # float32 products of a few rows
        use_dense_kernels(net)
    if cpu and _native_cpu():  # one product per input in decode steps (runtime.fused)
        join_projections(net)
    if link is not None:
        sharding.ready(link)
        if link.rank != 0:
            from .runtime.follower import follow

            follow(net, link)  # serves rank 0, then exits the process
    tok = load_tokenizer(path, ckpt.entry)
    stops = tuple(tok.token_id(t) for t in ckpt.entry.stop_tokens)
    if cache_bytes is None:
        cache_bytes = memory.default_budget(need, mem)
    eng = Engine(net, tok, ckpt.entry, ckpt, _DTYPES[name], stops, CacheBudget(cache_bytes))
    eng.quantize = quantize
    eng.speculative = spec
    eng.set_max_batch(max_batch)
    eng.set_pass_tokens(pass_tokens)
    if link is not None:  # first: the followers are pinged while a draft model loads, and
        sharding.attach(eng)  # told to stop at exit if it fails
    if spec is not None and isinstance(spec.drafter, DraftModel):
        spec.drafter.load(eng)
    return eng


def _native_cpu() -> bool:
    """Whether the native CPU kernels (kernels.native) run: built on first call (once, into
    CHATML_HOME), or one line on stderr says why MLX's ops run instead."""
    from kernels import native

    return native.module() is not None


SPECULATIVE = ("lookup", "mtp", "draft:NAME")


def speculation(name: str | None, num_draft: int = 4) -> Speculation | None:
    """The `speculative=` option of `load` as a `Speculation` (None: off)."""
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or not 1 <= num_draft <= 8:
        raise ValueError(f"num_draft must be an integer from 1 to 8, got {num_draft!r}")
    if name is None:
        return None
    if name == "lookup":
        return Speculation(LookupDrafter, num_draft)
    if name == "mtp":
        return Speculation(MTPDrafter, num_draft)
    if isinstance(name, str) and name.startswith("draft:") and name[len("draft:") :].strip():
        return Speculation(DraftModel(name[len("draft:") :].strip()), num_draft)
    raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)} or None, got {name!r}")
