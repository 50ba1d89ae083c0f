"""Sampling cost per token: the engine's cuts against mlx-lm's sampler over a real vocabulary.

Run: ``chatml bench sampling [--vocab 248320] [--repeats 30] [--json FILE]``.

One sampled pick from a vector of `--vocab` random logits (Qwen3.5's vocabulary by default),
with Qwen's recommended cuts, each cut alone and the temperature alone: this engine's
``Sampler.pick`` (on the CPU one native pass, ``kernels/native/sampling.cpp``), the same cuts
through MLX's ops (``final_logits`` then a categorical draw: the path on a GPU or with
``CHATML_NATIVE=0``), and mlx-lm's ``make_sampler`` with the same options (given
log-probabilities, as ``mlx_lm.generate`` computes them first: that ``logsumexp`` is timed
with it), and greedy ``argmax`` as the floor. Mean milliseconds over `--repeats` picks, all
in one process, interleaved per configuration; the table ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

CUTS = {  # name -> (top_k, top_p)
    "top_k 20 + top_p 0.95": (20, 0.95),
    "top_k 20": (20, 1.0),
    "top_p 0.95": (0, 0.95),
    "temperature alone": (0, 1.0),
}


def _mean_ms(fn, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: compiled samplers trace once
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - t0) / repeats * 1e3


def measure(vocab: int, repeats: int, temperature: float = 0.7) -> dict:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from engine.runtime.sampling import Sampler, SamplingParams

    logits = mx.random.normal((vocab,), key=mx.random.key(0)) * 3
    mx.eval(logits)
    out = {"greedy_argmax_ms": round(_mean_ms(lambda: mx.argmax(logits), repeats), 2)}
    for name, (top_k, top_p) in CUTS.items():
        ours = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0))
        theirs = make_sampler(temp=temperature, top_k=top_k, top_p=top_p if top_p < 1 else 0.0)

        def mlx_ops(s=ours):
            return mx.random.categorical(s.final_logits(logits), key=s.subkey())

        out[name] = {
            "chatml_ms": round(_mean_ms(lambda s=ours: s.pick(logits), repeats), 3),
            "mlx_ops_ms": round(_mean_ms(mlx_ops, repeats), 2),
            "mlx_lm_ms": round(
                _mean_ms(lambda f=theirs: f(logits - mx.logsumexp(logits)), repeats), 2
            ),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()

    import engine  # noqa: F401  (the fast BLAS before mlx)
    from bench.common import conditions, write_json

    before = conditions()["load_average"]
    r = measure(a.vocab, a.repeats)
    result = {"vocab": a.vocab, "repeats": a.repeats, "loadavg_before": before,
              "conditions": conditions(), "sampling": r}  # fmt: skip
    print(f"one pick over {a.vocab} logits, mean of {a.repeats}; greedy argmax "
          f"{r['greedy_argmax_ms']:.2f} ms")  # fmt: skip
    print(f"  {'cuts':<24}{'chatml':>10}{'MLX ops':>11}{'mlx-lm':>10}{'mlx-lm/chatml':>15}")
    for name in CUTS:
        c, o, m = (r[name][k] for k in ("chatml_ms", "mlx_ops_ms", "mlx_lm_ms"))
        print(f"  {name:<24}{c:>8.2f} ms{o:>8.2f} ms{m:>7.2f} ms{m / c:>14.2f}x")
    print(json.dumps({"bench": "sampling", **result}))
    write_json(a.json, result)


if __name__ == "__main__":
    main()
