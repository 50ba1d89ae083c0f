"""The native kernels' thread pool on a busy machine: a decode step's GEMVs, quiet and with a core taken.

Run: ``chatml bench pool [--steps 400] [--module FILE.so ...] [--json FILE]``. A "step" is seven
8-bit GEMVs of the 0.8B build's shapes (four 1024x1024, two 3584x1024, one 1024x3584) back to
back, evaluated together, as a decode step issues them. Each module is timed quiet, then while a
spinning process (started here, nice 0) holds one core, so the OS parks a pool worker now and
then: the ratio says what a busy machine costs a step. ``--module`` times other builds of the
kernels module (e.g. one built from an older ``pool.h``), each in its own interpreter, in turns
with this checkout's build, so two pools are compared under the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench.common import ROOT, child_env, conditions, write_json

SHAPES = [(1024, 1024)] * 4 + [(3584, 1024)] * 2 + [(1024, 3584)]


def _time_steps(module: str | None, steps: int) -> dict:
    """In this interpreter: per-step seconds of `module` (a .so path; None: this checkout's)."""
    import importlib.util

    import mlx.core as mx

    if module is None:
        from kernels import native

        mod = native.module()
        assert mod is not None, native.info().reason
    else:
        spec = importlib.util.spec_from_file_location("_chatml_qgemv", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    jobs = []
    for i, (n, k) in enumerate(SHAPES):
        kw, kx = mx.random.split(mx.random.key(i))
        w, s, b = mx.quantize(mx.random.normal((n, k), key=kw), group_size=64, bits=8)
        jobs.append((mx.random.normal((1, k), key=kx), w, s, b))
    mx.eval(jobs)

    def step() -> None:
        mx.eval([mod.quantized_gemv(*job, 64, 8) for job in jobs])

    for _ in range(20):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    return {
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": times[int(0.9 * len(times))] * 1e3,
        "p99_ms": times[int(0.99 * len(times))] * 1e3,
        "threads": mod.threads(),
    }


def _child(module: str | None, steps: int) -> dict:
    cmd = [sys.executable, "-m", "bench.pool", "--child", module or "", "--steps", str(steps)]
    out = subprocess.run(cmd, cwd=ROOT, env=child_env("auto"), capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"bench pool: {module or 'this checkout'}: {out.stderr.strip()}")
    return json.loads(out.stdout.splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2, help="turns of every module, each setting")
    ap.add_argument("--module", action="append", default=[], help="another build's .so to time")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import engine  # noqa: F401  (the BLAS before mlx, as everywhere; conditions() reports it)

    if args.child is not None:
        print(json.dumps(_time_steps(args.child or None, args.steps)))
        return 0
    modules = [None, *args.module]
    rows = []
    for busy in (False, True):
        spinner = None
        if busy:
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for r in range(args.rounds):
                for m in modules:
                    res = _child(m, args.steps)
                    rows.append({"module": m or "this checkout", "busy": busy, "round": r, **res})
                    print(f"{'one core busy' if busy else 'quiet':<14} {m or 'this checkout'}: "
                          f"median {res['median_ms']:.3f} ms, p90 {res['p90_ms']:.3f}, "
                          f"p99 {res['p99_ms']:.3f} ({res['threads']} threads)", flush=True)  # fmt: skip
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    result = {"conditions": conditions(), "shapes": SHAPES, "steps": args.steps, "rows": rows}
    write_json(args.json, result)
    print(json.dumps({k: result[k] for k in ("steps", "rows")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
