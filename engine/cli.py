"""The `chatml` command: chat, sessions, models, build-kernels, doctor, bench, serve."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
from pathlib import Path

from .args import (
    DefaultsFormatter,
    add_sampling_flags,
    add_shard_flags,
    add_speculative_flags,
    number,
    sampling_overrides,
)
from .checkpoints.registry import DEFAULT_MODEL
from .runtime.batch import DEFAULT_MAX_BATCH, DEFAULT_PASS_TOKENS
from .runtime.pool import DEFAULT_SEQUENCES


def _models(args) -> int:
    from .checkpoints import registry
    from .checkpoints.builder import build, parameter_count
    from .checkpoints.generation import describe, qwen_generation_config, sampling_defaults

    entries = registry.registry()
    if args.action in (None, "list"):
        print(f"{'name':<18} {'params':>8}  {'template':<14} {'thinking':<8} hub")
        for e in entries.values():
            params = parameter_count(e.arch) / 1e9
            size = f"{params:.2f}B" if params >= 0.1 else f"{params * 1e3:.0f}M"
            hub = e.hub or "(embedded, built locally)"
            think = "on" if e.thinking_default else "off"
            print(f"{e.name:<18} {size:>8}  {e.template:<14} {think:<8} {hub}")
        return 0
    if args.name not in entries:
        print(
            f"chatml models: unknown model {args.name!r}; known: {', '.join(entries)}",
            file=sys.stderr,
        )
        return 2
    e = entries[args.name]
    if args.action == "info":
        a = e.arch
        print(f"{e.name}: {e.description}")
        print(f"  hub: {e.hub or '-'}   mlx: {', '.join(e.mlx) or '-'}")
        print(
            f"  template: {e.template} (thinking {'on' if e.thinking_default else 'off'} by default)"
        )
        print(f"  context window: {e.context_window} tokens; stop: {', '.join(e.stop_tokens)}")
        print(f"  parameters: {parameter_count(a):,}")
        print(
            f"  layers: {a.num_hidden_layers} ({a.layer_types.count('linear_attention')} Gated "
            f"DeltaNet, {a.layer_types.count('full_attention')} gated attention), hidden {a.hidden_size}"
        )
        print(
            f"  attention heads Q/KV: {a.num_attention_heads}/{a.num_key_value_heads} x {a.head_dim}; "
            f"GDN heads V/K: {a.linear_num_value_heads}/{a.linear_num_key_heads} x {a.linear_key_head_dim}"
        )
        ffn = (
            f"MoE {a.num_experts} experts, {a.num_experts_per_tok} routed + shared, expert FFN "
            f"{a.moe_intermediate_size}"
            if a.is_moe
            else f"FFN {a.intermediate_size}"
        )
        print(f"  {ffn}; tied embeddings: {a.tie_word_embeddings}")
        print(f"  recurrent state: {a.recurrent_state_bytes():,} bytes per sequence (float32)")
        print(f"  KV cache: {a.kv_bytes_per_token():,} bytes per token (float32)")
        defaults = sampling_defaults(qwen_generation_config(e))
        print(f"  sampling defaults (generation_config.json; chat and serve): {describe(defaults)}")
        return 0
    if args.action == "build":
        if not args.out:
            print("chatml models build: --out DIR is required", file=sys.stderr)
            return 2
        path = build(e, args.out, seed=args.seed, dtype=args.dtype, progress=True)
        print(path)
        return 0
    return 2


def native_path() -> str:
    """Which path CPU quantized matmuls take, in words (builds the kernels if it can)."""
    from kernels import native

    got = native.info()
    if got.active:
        mod = native.module()  # "vnni", "maddubs", "maddwd": weights multiplied in integers
        fixed = {bits: mod.kernel(bits) for bits in (8, 4)}
        kernels = ", ".join([got.isa] + [f"{b}-bit: {k}" for b, k in fixed.items() if k != got.isa])
        return f"native ({kernels}, {got.threads} threads; {got.path})"
    return f"MLX ops (slower: {got.reason})"


def dense_path() -> str:
    """Which path float32 matmuls of a few rows (decode, batched decode, short prefills) take,
    in words."""
    from kernels import native

    from .engine import backend

    if backend() != "cpu":
        return "MLX's GPU kernels"
    got = native.info()
    lo, hi = native.dense_rows()
    if got.active:
        outer = native.module().dense_outer_from()
        form = f": outer products from {outer} rows" if 0 < outer <= hi else ""
        one = "; 1 row: BLAS sgemv" if lo > 1 else ""
        long_k = (f" ({lo}-{native.LONG_K_ROWS} for rows of {native.LONG_K}+ floats)"
                  if native.LONG_K_ROWS < hi else "")  # fmt: skip
        return f"native GEMV for {lo}-{hi} rows{long_k} ({got.isa}{form}){one}; more: sgemm"
    return f"BLAS sgemm (slower for {lo}-{hi} rows: {got.reason})"


def delta_path() -> str:
    """Which path the Gated DeltaNet update of decode steps and prefills takes, in words."""
    from kernels import native

    from .engine import backend

    if backend() != "cpu":
        return "MLX ops, compiled (GPU)"
    got = native.info()
    if got.active:
        return f"native fused update ({got.isa})"
    return f"MLX ops, compiled (no fused update: {got.reason})"


def activation_path() -> str:
    """Which path the float32 gates (silu, sigmoid, the conv's silu) take, in words."""
    from kernels import native

    from .engine import backend

    if backend() != "cpu":
        return "MLX ops (GPU)"
    got = native.info()
    if got.active:
        return f"native vectorized pass ({got.isa})"
    return f"MLX ops (scalar exp on x86: {got.reason})"


def attention_path() -> str:
    """Which path a decode step's attention over each row's KV cache takes, in words."""
    from kernels import native
    from kernels.attention import ROWS_KEYS, ROWS_QUERIES

    from .engine import backend

    if backend() != "cpu":
        return "MLX's scaled_dot_product_attention, row by row (GPU)"
    got = native.info()
    if got.active:
        return (f"native pass over every row's cache (float32: 1 query a row; up to "
                f"{ROWS_QUERIES} while the rows hold at most {ROWS_KEYS} keys)")  # fmt: skip
    return f"MLX's scaled_dot_product_attention, row by row ({got.reason})"


def sampling_path() -> str:
    """Which path a sampled token's cuts and draw (and logprobs) take, in words."""
    from kernels import native

    from .engine import backend

    if backend() != "cpu":
        return "MLX ops (GPU)"
    got = native.info()
    if got.active:
        return "native pass over the vocabulary"
    return f"MLX ops (about a dozen passes over the vocabulary: {got.reason})"


def _build_kernels(args) -> int:
    import time

    from kernels import native

    t0 = time.perf_counter()
    try:
        path = native.build(quiet=False)
    except RuntimeError as err:
        print(f"chatml build-kernels: {err}", file=sys.stderr)
        return 1
    native.reset()
    print(f"{path} ({time.perf_counter() - t0:.0f} s); quantized CPU path: {native_path()}")
    return 0


def float32_matmul(kind: str) -> str:
    """How MLX computes float32 products here: on GPUs with TF32 units (CUDA; MLX documents
    M5-class Apple GPUs too) in TF32 unless MLX_ENABLE_TF32=0, which `import engine` sets
    unless the user set it (engine/__init__.py)."""
    if kind == "cpu" or os.environ.get("MLX_ENABLE_TF32", "1") == "0":
        return "float32"
    return "TF32 where the GPU has it (MLX_ENABLE_TF32 is set: ~3e-4 relative per product)"


def _doctor(args) -> int:
    import platform

    import mlx.core as mx

    from kernels import blas, heap, subnormals
    from kernels.choice import device_kind

    from .engine import backend
    from .paths import chatml_home
    from .runtime.memory import device_memory

    info = blas.info()
    mem = device_memory()
    packages = mlx_backend_packages()
    report = {
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_backend_packages": packages,
        "backend": backend(),
        "device": str(mx.default_device()),
        "device_kind": device_kind(),
        "device_name": mx.device_info().get("device_name", "?"),
        "memory_usable_gib": round(mem.usable / 2**30, 1),
        "blas": info.library,
        "blas_provider": info.provider,
        "blas_core": blas.core(),  # OpenBLAS's kernel set; OPENBLAS_CORETYPE may pin an older one
        "blas_threads": blas.threads(),  # OPENBLAS_NUM_THREADS, OPENBLAS_THREAD_TIMEOUT
        "blas_note": info.reason,
        "malloc": heap.info(),  # glibc thresholds pinned so step buffers are not refaulted
        "subnormals": subnormals.info(),  # flushed to zero on the engine's threads (x86)
        "float32_matmul": float32_matmul(device_kind()),
        "quantized_cpu_path": native_path(),
        "float32_batch_path": dense_path(),
        "delta_decode_path": delta_path(),
        "activation_path": activation_path(),
        "attention_decode_path": attention_path(),
        "sampling_path": sampling_path(),
        "matmul_gflops_f32": round(blas.measure_gflops(), 1),
        "chatml_home": str(chatml_home()),  # built models, the tokenizer, sessions
    }
    if args.json:
        print(json.dumps(report))
    else:
        width = max(map(len, report))
        for k, v in report.items():
            if v not in (None, ""):  # e.g. no note when the fast BLAS loaded
                print(f"{k:>{width}}: {v}")
        if not info.fast and backend() == "cpu" and platform.system() == "Linux":
            print(f"\nslow reference BLAS in use: {blas.FIX_HINT}")
        if len(packages) > 1:
            print(f"\nseveral MLX backends installed ({', '.join(packages)}): each ships "
                  "libmlx.so and the last installed wins; uninstall all but one")  # fmt: skip
    return 0


def benchmarks() -> dict[str, str]:
    """The `bench/` modules that run on their own (a top-level `main`), with their docstring's
    first paragraph on one line: read from the source, so `--help` imports no benchmark (nor
    MLX)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("bench")
    out = {}
    for folder in spec.submodule_search_locations if spec else []:
        for path in sorted(Path(folder).glob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, ValueError):
                continue
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
                first = (ast.get_docstring(tree) or "").split("\n\n")[0]
                out.setdefault(path.stem, " ".join(first.split()))
    return out


def mlx_backend_packages() -> list[str]:
    """Installed MLX backend distributions (mlx-cpu, mlx-cuda-12/13, mlx-metal): one expected."""
    from importlib import metadata

    names = ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return found


def _bench(args) -> int:
    import importlib

    known = benchmarks()
    if args.what not in known:
        print(f"chatml bench: no benchmark {args.what!r}; known: {', '.join(known)}",
              file=sys.stderr)  # fmt: skip
        return 2
    module = importlib.import_module(f"bench.{args.what}")
    sys.argv = [f"chatml bench {args.what}", *args.rest]  # each bench parses its own options
    # A bench that checks something returns its exit status (1: it failed); others return
    # their results (for tests and scripts), which are not a status.
    status = module.main()
    return status if type(status) is int else 0


def _serve(args) -> int:
    from .serving.server import run

    try:
        sampling = sampling_overrides(args)
    except ValueError as e:
        print(f"chatml serve: error: {e}", file=sys.stderr)
        return 2
    return run(args, sampling)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("chatml-engine")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatml", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    from .chat import add_chat_parser, add_sessions_parser

    add_chat_parser(sub)
    add_sessions_parser(sub)

    m = sub.add_parser("models", help="list, describe or build registry models",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    m.add_argument("action", nargs="?", choices=["list", "info", "build"])
    m.add_argument("name", nargs="?")
    m.add_argument("--out", help="folder to write the checkpoint to (build)")
    m.add_argument(
        "--seed", type=number(0), default=None, help="weight seed (build; default: the registry's)"
    )
    m.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight dtype (build; default: the registry's)")  # fmt: skip
    m.set_defaults(func=_models)

    k = sub.add_parser("build-kernels", help="compile the native CPU kernels into CHATML_HOME",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    k.set_defaults(func=_build_kernels)

    d = sub.add_parser("doctor", help="backend, BLAS, measured matmul speed, data folder",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    d.add_argument("--json", action="store_true", help="print the report as one JSON object")
    d.set_defaults(func=_doctor)

    known = benchmarks()
    width = max(map(len, known), default=0) + 2
    indent = " " * (width + 2)  # a summary longer than a line goes on under itself
    listed = "\n".join(
        textwrap.fill(
            what,
            120,
            initial_indent=f"  {name:<{width}}",
            subsequent_indent=indent,
            break_on_hyphens=False,
        )
        for name, what in known.items()
    )
    b = sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"benchmarks (chatml bench NAME --help for each one's options):\n{listed}")  # fmt: skip
    b.add_argument("what", metavar="NAME", help="the benchmark to run (listed below)")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options for the benchmark")
    b.set_defaults(func=_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (README: Server)",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registry alias, checkpoint folder or Hub id (default: {DEFAULT_MODEL})")  # fmt: skip
    s.add_argument("--quantize", type=int, choices=[8, 4], default=None,
                   help="quantize a float checkpoint at load (bits; group 64)")  # fmt: skip
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=number(0, 65535), default=8080,
                   help="TCP port (0: a free one, shown in the banner)")  # fmt: skip
    key = s.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (visible in ps: prefer the file "
                     "or $CHATML_API_KEY)")  # fmt: skip
    key.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="read the API key from FILE (surrounding whitespace ignored)")  # fmt: skip
    s.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web page's origin (http://localhost:3000) that may call the server "
                        "from the browser (CORS); repeatable. Without an API key a server on "
                        "loopback refuses other sites' pages")  # fmt: skip
    s.add_argument("--cache-bytes", type=number(1), default=None,
                   help="cache budget (default: half the device memory the weights leave)")  # fmt: skip
    s.add_argument("--sequences", type=number(1), default=DEFAULT_SEQUENCES,
                   help="conversations kept cached for reuse, within the cache budget "
                        f"(default {DEFAULT_SEQUENCES})")  # fmt: skip
    s.add_argument("--max-tokens", type=number(1), default=512,
                   help="answer limit if a request has none")  # fmt: skip
    s.add_argument("--max-batch", type=number(1), default=DEFAULT_MAX_BATCH, metavar="N",
                   help="requests decoded together in one forward pass per step (continuous "
                        f"batching; 1: one at a time; default {DEFAULT_MAX_BATCH})")  # fmt: skip
    s.add_argument("--pass-tokens", type=number(1), default=DEFAULT_PASS_TOKENS, metavar="N",
                   help="tokens in one forward pass at most: a prompt is prefilled in chunks cut "
                        "to fit beside the requests decoding, which stall one such pass at a "
                        f"time (default {DEFAULT_PASS_TOKENS})")  # fmt: skip
    s.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="disk tier of the prefix cache: what leaves RAM, and everything at "
                        "shutdown (default: CHATML_HOME/prefix-cache)")  # fmt: skip
    s.add_argument("--disk-cache-bytes", type=number(1), default=None, metavar="N",
                   help="disk cache budget, least recently used deleted first (default: 8 GiB "
                        "or a tenth of the free space)")  # fmt: skip
    s.add_argument("--no-disk-cache", action="store_true", help="keep the prefix cache in RAM only")
    s.add_argument("--warm-prompts", default=None, metavar="FILE",
                   help="JSON list of message arrays (or of {\"messages\", \"tools\"} objects) to "
                        "prefill at start-up (system prompts, tool sets)")  # fmt: skip
    s.add_argument("--no-warm", action="store_true",
                   help="no idle-time warm-up (by default, after each answer the server prefills "
                        "that conversation's next prompt while it waits)")  # fmt: skip
    s.add_argument("--parse-special-in-content", action="store_true",
                   help="special tokens written in message text (<|im_end|>...) become control "
                        "tokens, as in transformers (default: ordinary text)")  # fmt: skip
    add_sampling_flags(s, "fields a request omits")
    add_speculative_flags(s)
    add_shard_flags(s)
    s.set_defaults(func=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit: a broken pipe must reach the handler below
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as `cat` would
        # Python flushes stdout again at exit; point it at /dev/null so that flush is silent.
        with contextlib.suppress(OSError, ValueError):  # stdout may not be a real file
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 141  # 128 + SIGPIPE, what a command killed by the broken pipe reports


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "models" and args.action in ("info", "build") and not args.name:
        print(f"chatml models {args.action}: a model name is required", file=sys.stderr)
        return 2
    from .checkpoints.loader import CheckpointError
    from .checkpoints.registry import RegistryError
    from .runtime.shard import ShardError

    try:
        return args.func(args)
    except (CheckpointError, RegistryError) as e:  # a bad model name or folder: say so, no trace
        print(f"chatml {args.command}: {e}", file=sys.stderr)
        return 1
    except ShardError as e:  # --shard: not launched, ranks that disagree, a rank gone
        print(f"chatml {args.command}: {e}", file=sys.stderr)
        return 3  # as `chatml chat` says it at load, and a follower rank whose peer is gone
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
