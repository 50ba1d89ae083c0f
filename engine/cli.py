"""The `chatml` command: chat, sessions, models, doctor, bench, serve."""

from __future__ import annotations

import argparse
import json
import sys

from .args import number


def _models(args) -> int:
    from .checkpoints import registry
    from .checkpoints.builder import build, parameter_count

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
        return 0
    if args.action == "build":
        if not args.out:
            print("chatml models build: --out DIR is required", file=sys.stderr)
            return 2
        path = build(e, args.out, seed=args.seed, dtype=args.dtype, progress=True)
        print(path)
        return 0
    return 2


def _doctor(args) -> int:
    import platform

    import mlx.core as mx

    from kernels import blas
    from kernels.choice import device_kind

    from .engine import backend
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
        "blas_note": info.reason,
        "matmul_gflops_f32": round(blas.measure_gflops(), 1),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>20}: {v}")
        if not info.fast and backend() == "cpu" and platform.system() == "Linux":
            print(f"\nslow reference BLAS in use: {blas.FIX_HINT}")
        if len(packages) > 1:
            print(f"\nseveral MLX backends installed ({', '.join(packages)}): each ships "
                  "libmlx.so and the last installed wins; uninstall all but one")  # fmt: skip
    return 0


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

    try:
        module = importlib.import_module(f"bench.{args.what}")
    except ModuleNotFoundError:
        print(f"chatml bench: no benchmark {args.what!r}", file=sys.stderr)
        return 2
    sys.argv = [f"chatml bench {args.what}", *args.rest]  # each bench parses its own options
    module.main()
    return 0


def _serve(args) -> int:
    from .serving.server import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatml", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    from .chat import add_chat_parser, add_sessions_parser

    add_chat_parser(sub)
    add_sessions_parser(sub)

    m = sub.add_parser("models", help="list, describe or build registry models")
    m.add_argument("action", nargs="?", choices=["list", "info", "build"])
    m.add_argument("name", nargs="?")
    m.add_argument("--out", help="folder to write the checkpoint to (build)")
    m.add_argument("--seed", type=int, default=None, help="weight seed (build)")
    m.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    m.set_defaults(func=_models)

    d = sub.add_parser("doctor", help="backend, BLAS in use and measured matmul speed")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_doctor)

    b = sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)")
    b.add_argument("what", help="kernels, render, replay or throughput")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (README: Server)")
    s.add_argument("--model", default="tiny", help="registry alias, checkpoint folder or Hub id")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=number(0, 65535), default=8080)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--cache-bytes", type=number(1), default=None,
                   help="cache budget (default: half the device memory the weights leave)")  # fmt: skip
    s.add_argument("--sequences", type=number(1), default=8,
                   help="cached sequences kept for reuse")  # fmt: skip
    s.add_argument("--max-tokens", type=number(1), default=512,
                   help="answer limit if a request has none")  # fmt: skip
    s.set_defaults(func=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "models" and args.action in ("info", "build") and not args.name:
        print(f"chatml models {args.action}: a model name is required", file=sys.stderr)
        return 2
    from .checkpoints.loader import CheckpointError
    from .checkpoints.registry import RegistryError

    try:
        return args.func(args)
    except (CheckpointError, RegistryError) as e:  # a bad model name or folder: say so, no trace
        print(f"chatml {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
