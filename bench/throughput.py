"""Prefill and decode tokens/s: this engine vs mlx-lm on the same checkpoint.

Run: ``chatml bench throughput --model qwen3.5-0.8b [--ts 512,2048,8192] [--decode 128]
[--configs chatml,mlx_lm] [--json FILE]``.

Each configuration runs in its own interpreter, because the BLAS library must be chosen before
mlx is first imported, and so that peak memory is per configuration:

- ``chatml``: this engine, fast BLAS, chunked gated delta kernel (``engine.runtime.generate.prefill``
  on fresh caches, then ``engine.runtime.generate.decode``);
- ``chatml_q8``, ``chatml_q4``: this engine with the weights quantized at load
  (``engine.load(quantize=8|4)``, group 64, MLX's affine layout: what an mlx-community
  checkpoint holds), decoded by the native quantized GEMV; activations stay float32;
- ``chatml_sequential``: this engine with fast BLAS but ``mx.fast.gated_delta_update``
  instead of the chunked kernel (where the kernel's share of the speedup shows);
- ``mlx_lm``: mlx-lm's ``generate_step`` with this engine's fast BLAS loaded before mlx, but
  without importing the engine;
- ``mlx_lm_stock``: mlx-lm as users get it: ``CHATML_BLAS=0``, no engine import (on Linux
  the mlx-cpu wheel's reference BLAS);
- ``chatml_sgemm``, ``mlx_lm_sgemm``: as ``chatml`` and ``mlx_lm`` but with ``CHATML_GEMV=0``,
  so single-row matmuls go to OpenBLAS's sgemm instead of sgemv (the gain of
  ``kernels.shim.gemv_dispatch``).

Prefill time is the time to the first token's logits (mlx-lm: to the first token of
``generate_step``); decode is tokens/s over ``--decode`` greedy tokens after a 512-token
prompt, with no stop tokens. All compute is float32 (the quantized configurations keep their
weights compact and compute in float32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, child_env, write_json

CONFIGS = ("chatml", "chatml_q8", "chatml_q4", "chatml_sequential", "chatml_sgemm", "mlx_lm",
           "mlx_lm_sgemm", "mlx_lm_stock")  # fmt: skip
QUANTIZE = {"chatml_q8": 8, "chatml_q4": 4}  # engine.load(quantize=) bits
DECODE_PROMPT = 512


def _prompt(n: int, vocab: int = 248044) -> list[int]:
    """Seeded ordinary-token ids (speed does not depend on which tokens)."""
    import numpy as np

    return np.random.default_rng(n).integers(0, vocab, n).tolist()


def child(config: str, path: str, ts: list[int], decode_n: int, repeats: int) -> dict:
    """Measure `config` in this interpreter (its CHATML_BLAS was set by the parent)."""
    if config.startswith("chatml"):
        import engine  # noqa: F401  (loads the fast BLAS before mlx)
    elif config.startswith("mlx_lm") and config != "mlx_lm_stock":
        from kernels import blas

        blas.enable()
    import mlx.core as mx

    from kernels import blas

    out: dict = {"config": config, "mlx": mx.__version__, "prefill": {}, "decode": None,
                 "gemv": blas.info().fast and blas.gemv_enabled()}  # fmt: skip
    if config.startswith("chatml"):
        chunked = config != "chatml_sequential"
        run_prefill, run_decode, blas_name = _chatml(path, chunked, QUANTIZE.get(config))
    else:
        run_prefill, run_decode, blas_name = _mlx_lm(path)
    out["blas"] = blas_name
    out["blas_core"] = blas.core()
    run_prefill(_prompt(16))  # warm-up: first-call allocations and kernel setup
    for T in ts:
        ids = _prompt(T)
        best = min(run_prefill(ids) for _ in range(repeats))
        out["prefill"][str(T)] = {"seconds": best, "tokens_per_s": T / best}
        print(f"  {config}: prefill {T} tokens {best:.2f} s", file=sys.stderr, flush=True)
    if decode_n:
        n, dt = run_decode(_prompt(DECODE_PROMPT), decode_n)
        out["decode"] = {"tokens": n, "seconds": dt, "tokens_per_s": (n - 1) / dt}
        print(f"  {config}: decode {(n - 1) / dt:.2f} tok/s", file=sys.stderr, flush=True)
    out["peak_memory_bytes"] = mx.get_peak_memory()
    from bench.common import peak_rss_bytes

    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def _chatml(path: str, chunked: bool, quantize: int | None = None):
    import mlx.core as mx

    import engine
    from engine.runtime.generate import decode, prefill
    from engine.runtime.sampling import Sampler, SamplingParams
    from kernels import blas

    eng = engine.load(path, chunked_delta=chunked, quantize=quantize)
    mx.eval(eng.model.parameters())

    # Both run on the engine's model thread, as every turn of a user's does (its floating-point
    # mode included: kernels/subnormals.py).
    def prefill_s(ids: list[int]) -> float:
        caches = eng.model.make_caches()
        t = time.perf_counter()
        logits, _ = prefill(eng.model, caches, ids, 0)
        mx.eval(mx.argmax(logits))
        return time.perf_counter() - t

    def run_prefill(ids: list[int]) -> float:
        return eng.worker.call(prefill_s, ids)

    def run_decode(ids: list[int], n: int) -> tuple[int, float]:
        return eng.worker.call(decode_s, ids, n)

    def decode_s(ids: list[int], n: int) -> tuple[int, float]:
        caches = eng.model.make_caches()
        logits, _ = prefill(eng.model, caches, ids, 0)
        first = None
        count = 0
        for _ in decode(eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=n,
                        stop_ids=(), history=list(ids)):  # fmt: skip
            count += 1
            if first is None:
                first = time.perf_counter()
        return count, time.perf_counter() - first

    return run_prefill, run_decode, blas.info().provider


def _mlx_lm(path: str):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(path)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    blas_name = "fast (kernels.blas)" if os.environ.get("CHATML_BLAS") != "0" else "reference"

    def run_prefill(ids: list[int]) -> float:
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        for _ in generate_step(mx.array(ids), model, max_tokens=1, prompt_cache=cache):
            break  # the first token: prefill done
        return time.perf_counter() - t

    def run_decode(ids: list[int], n: int) -> tuple[int, float]:
        cache = make_prompt_cache(model)
        first = None
        count = 0
        for _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache):
            count += 1
            if first is None:
                first = time.perf_counter()
        return count, time.perf_counter() - first

    return run_prefill, run_decode, blas_name


def run_child(config: str, path: Path, ts: list[int], decode_n: int, repeats: int) -> dict:
    env = child_env("0" if config == "mlx_lm_stock" else "1")
    env["CHATML_GEMV"] = "0" if config.endswith("_sgemm") else "1"
    cmd = [sys.executable, "-m", "bench.throughput", "--child", config, "--model", str(path),
           "--ts", ",".join(map(str, ts)), "--decode", str(decode_n), "--repeats", str(repeats)]  # fmt: skip
    res = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(
    model: str,
    configs: list[str],
    ts: list[int],
    decode_n: int,
    *,
    stock_ts: list[int] | None = None,
    stock_decode: int | None = None,
    repeats: int = 1,
    models_dir: str | None = None,
) -> dict:
    """Run every configuration in its own interpreter; returns conditions and results."""
    from tqdm import tqdm

    import engine  # noqa: F401  (conditions() reports the engine's BLAS)
    from bench.common import conditions, model_path

    path = model_path(model, models_dir)
    results = {}
    for config in tqdm(configs, desc="throughput", unit="config", file=sys.stderr):
        stock = config == "mlx_lm_stock"
        c_ts = stock_ts if stock and stock_ts is not None else ts
        c_dec = stock_decode if stock and stock_decode is not None else decode_n
        results[config] = run_child(config, path, c_ts, c_dec, repeats)
    cond = conditions(model=model, checkpoint=str(path), dtype="float32", repeats=repeats,
                      decode_prompt_tokens=DECODE_PROMPT)  # fmt: skip
    return {"conditions": cond, "results": results}


def print_table(result: dict) -> None:
    res = result["results"]
    ts = sorted({int(t) for r in res.values() for t in r["prefill"]})
    print(f"{'config':<20}" + "".join(f"{'prefill ' + str(t):>14}" for t in ts)
          + f"{'decode':>10}{'peak mem':>11}{'peak rss':>11}")  # fmt: skip
    for name, r in res.items():
        cells = "".join(
            f"{r['prefill'][str(t)]['tokens_per_s']:>14.1f}" if str(t) in r["prefill"] else
            f"{'-':>14}" for t in ts
        )  # fmt: skip
        dec = f"{r['decode']['tokens_per_s']:>10.2f}" if r["decode"] else f"{'-':>10}"
        print(f"{name:<20}{cells}{dec}{r['peak_memory_bytes'] / 2**30:>10.2f}G"
              f"{r['peak_rss_bytes'] / 2**30:>10.2f}G")  # fmt: skip
    print("(tokens/s; prefill = prompt tokens / time to first token)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    ap.add_argument("--ts", default="512,2048,8192", help="prefill lengths (comma separated)")
    ap.add_argument("--decode", type=int, default=128, help="decode tokens (0: skip)")
    ap.add_argument("--configs", default="chatml,mlx_lm", help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--stock-ts", default="512", help="prefill lengths for mlx_lm_stock (slow)")
    ap.add_argument("--stock-decode", type=int, default=16, help="decode tokens, mlx_lm_stock")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--models-dir")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model, _ints(a.ts), a.decode, a.repeats)))
        return
    configs = [c for c in a.configs.split(",") if c]
    if set(configs) - set(CONFIGS):
        ap.error(f"--configs: choose from {', '.join(CONFIGS)}")
    result = measure(
        a.model, configs, _ints(a.ts), a.decode, stock_ts=_ints(a.stock_ts),
        stock_decode=a.stock_decode, repeats=a.repeats, models_dir=a.models_dir,
    )  # fmt: skip
    print_table(result)
    print(json.dumps({"bench": "throughput", **result}))
    write_json(a.json, result)


if __name__ == "__main__":
    main()
