"""Pipeline sharding: prefill and decode tokens/s, peak memory per rank, bytes per token.

Runs the same prompt and greedy decode in one process, then in 2 ranks on this machine (the
ring backend over localhost, started as `mlx.launch` starts them). On one machine this
measures the overhead of sharding (every transfer, the ranks taking turns on the same
cores), not a speed-up: that needs two machines, each with its own memory bandwidth.
Prints a table and writes JSON with the conditions (`--json`).

With `--hostfile`, the sharded half runs through `mlx.launch --hostfile FILE --backend ring`
(two Macs: see BENCHMARKS.md). Every rank prints its report as one `BENCH-SHARD {json}` line,
which `mlx.launch` forwards from every machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def worker(model: str, prompt_tokens: int, tokens: int, shard: str | None) -> None:
    """One process's share: load, prefill `prompt_tokens`, decode `tokens`; rank 0 reports
    the timings, every rank its peak memory and the bytes it sent."""
    import atexit
    import time

    import engine  # first: the fast BLAS loads before mlx
    from bench.common import peak_rss_bytes

    rank = int(os.environ.get("MLX_RANK", "0")) if shard else 0
    report: dict = {"rank": rank}

    def write():
        from engine.runtime import shard as sharding

        link = sharding.joined
        if link is not None:
            report.update(sent_bytes=link.sent_bytes, received_bytes=link.received_bytes)
        report["peak_rss_bytes"] = peak_rss_bytes()
        print(f"BENCH-SHARD {json.dumps(report)}", flush=True)

    atexit.register(write)  # followers leave `load` by SystemExit, when rank 0 is done
    eng = engine.load(model, shard=shard)

    import mlx.core as mx

    from engine.runtime.generate import decode, eval_caches, prefill
    from engine.runtime.sampling import Sampler, SamplingParams

    ids = [1000 + (i * 7919) % 50000 for i in range(prompt_tokens)]

    def run():
        caches = eng.model.make_caches()
        t = time.perf_counter()
        logits, _ = prefill(eng.model, caches, ids, 0)
        mx.eval(logits)
        eval_caches(caches)
        t_prefill = time.perf_counter() - t
        history = list(ids)
        steps = decode(eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=tokens,
                       stop_ids=(), history=history)  # fmt: skip
        t = time.perf_counter()
        decoded = list(steps)
        return decoded, prompt_tokens / t_prefill, (tokens - 1) / (time.perf_counter() - t)

    eng.worker.call(run)  # warm-up: compilation, page faults
    before = (getattr(eng.model, "decode_steps", 0), getattr(eng.model, "decode_bytes", 0))
    decoded, prefill_tps, decode_tps = eng.worker.call(run)
    report.update(tokens=decoded, prefill_tps=prefill_tps, decode_tps=decode_tps)
    if shard:
        steps = eng.model.decode_steps - before[0]
        report["bytes_per_decoded_token"] = (eng.model.decode_bytes - before[1]) / max(steps, 1)
        report["layers"] = [[r.start, r.stop] for r in eng.model.link.ranges]


def _reports(outputs: list[str]) -> list[dict]:
    found = [json.loads(line.split(" ", 1)[1]) for text in outputs for line in text.splitlines()
             if line.startswith("BENCH-SHARD ")]  # fmt: skip
    return sorted(found, key=lambda r: r["rank"])


def _launch(args, tmp: Path, ranks: int) -> list[dict]:
    from bench.common import ROOT

    base = [sys.executable, "-m", "bench.shard", "--worker", args.model,
            "--prompt-tokens", str(args.prompt_tokens), "--tokens", str(args.tokens)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = {"env": env, "cwd": ROOT, "stdout": subprocess.PIPE, "text": True, "check": True}
    if ranks == 1:
        return _reports([subprocess.run(base, **run).stdout])
    if args.hostfile:
        launch = ["mlx.launch", "--hostfile", args.hostfile, "--backend", "ring", "--"]
        return _reports([subprocess.run([*launch, *base, "--shard"], **run).stdout])
    import socket

    ports = []
    for _ in range(ranks):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hosts = tmp / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    procs = [
        subprocess.Popen(
            [*base, "--shard"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(env, MLX_HOSTFILE=str(hosts), MLX_RANK=str(r)),
        )  # fmt: skip
        for r in range(ranks)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed (exits {[p.returncode for p in procs]})")
    return _reports(outputs)


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-0.8b", help="registry name or checkpoint folder")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    ap.add_argument("--ranks", type=int, default=2, help="ranks on this machine")
    ap.add_argument("--hostfile", help="run the sharded half with mlx.launch over these hosts")
    ap.add_argument("--models-dir")
    ap.add_argument("--json")
    ap.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        shard = "pipeline" if args.shard else None
        return worker(args.worker, args.prompt_tokens, args.tokens, shard)

    import engine  # noqa: F401  (the fast BLAS first)
    from bench.common import conditions, model_path, write_json

    args.model = str(model_path(args.model, args.models_dir))
    with tempfile.TemporaryDirectory() as tmp:
        one = _launch(args, Path(tmp), 1)
        many = _launch(args, Path(tmp), args.ranks)
    if one[0]["tokens"] != many[0]["tokens"]:
        raise SystemExit("the sharded run decoded other tokens than one process")
    print(f"{Path(args.model).name}: prompt {args.prompt_tokens}, decode {args.tokens} tokens "
          f"(one machine: this is sharding's overhead, not a speed-up)")  # fmt: skip
    print(f"{'run':<18} {'prefill tok/s':>13} {'decode tok/s':>12} {'peak RSS per rank (GiB)':>24}")
    for name, ranks in (("1 process", one), (f"{len(many)} ranks", many)):
        rss = ", ".join(f"{r['peak_rss_bytes'] / 2**30:.2f}" for r in ranks)
        print(f"{name:<18} {ranks[0]['prefill_tps']:>13.1f} {ranks[0]['decode_tps']:>12.2f} "
              f"{rss:>24}")  # fmt: skip
    ratio = many[0]["decode_tps"] / one[0]["decode_tps"]
    print(f"decode {len(many)} ranks / 1 process: {ratio:.2f}x; bytes moved by rank 0 per "
          f"decoded token: {many[0]['bytes_per_decoded_token']:.0f}")  # fmt: skip
    write_json(args.json, {"conditions": conditions(ranks=len(many)), "model": args.model,
                           "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
                           "one": one, "sharded": many, "decode_ratio": ratio})  # fmt: skip


if __name__ == "__main__":
    main()
