"""Sampling cost per token: the engine's cuts against mlx-lm's sampler over a real vocabulary.

Run: ``chatml bench sampling [--vocab 248320] [--repeats 30] [--json FILE]``, or for whole
decode steps ``chatml bench sampling --model qwen3.5-0.8b [--quantize 4] [--tokens 40]``.

One sampled pick from a vector of `--vocab` random logits (Qwen3.5's vocabulary by default),
with Qwen's recommended cuts, each cut alone and the temperature alone: this engine's
``Sampler.pick`` (on the CPU one native pass, ``kernels/native/sampling.cpp``), the same cuts
through MLX's ops (``final_logits`` then the inverse-CDF ``draw``: the path on a GPU or
with ``CHATML_NATIVE=0``), and mlx-lm's ``make_sampler`` with the same options (given
log-probabilities, as ``mlx_lm.generate`` computes them first: that ``logsumexp`` is timed
with it), and greedy ``argmax`` as the floor; and the log-probabilities a request may ask for
(the token's and the top 5: ``kernels.sampling.logprobs`` against MLX's ops), whole
``Sampler`` calls with a penalty (the processors, then the pick), and a batched step's picks
(``--rows``, default 8: one ``pick_rows`` call against a pick per row, on both paths). Mean
milliseconds over `--repeats` picks, all in one process, interleaved per configuration; the
table ends with one JSON line.

With ``--model``: what sampling adds to a decode step. Greedy decoding against the
checkpoint's own sampling defaults (``generation_config.json``: what ``chatml chat`` and the
server use, e.g. temperature 0.7, top_k 20, top_p 0.8, presence_penalty 1.5), seeded, on the
engine's model thread, alternating; milliseconds per token after a 128-token prompt, median
of `--repeats` (default 4) decodes of ``--tokens`` each.
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
CALLS = {  # a Sampler call with Qwen's instruct cuts (top_k 20, top_p 0.8) and these penalties
    "call, presence_penalty 1.5": {"presence_penalty": 1.5},
    "call, repetition_penalty 1.1": {"repetition_penalty": 1.1},
}


def _mean_ms(fn, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: compiled samplers trace once
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - t0) / repeats * 1e3


def measure(vocab: int, repeats: int, temperature: float = 0.7, rows: int = 8) -> dict:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from engine.runtime.sampling import Sampler, SamplingParams, draw
    from kernels.sampling import logprobs

    logits = mx.random.normal((vocab,), key=mx.random.key(0)) * 3
    mx.eval(logits)
    out = {"greedy_argmax_ms": round(_mean_ms(lambda: mx.argmax(logits), repeats), 2)}
    for name, (top_k, top_p) in CUTS.items():
        ours = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0))
        theirs = make_sampler(temp=temperature, top_k=top_k, top_p=top_p if top_p < 1 else 0.0)

        def mlx_ops(s=ours):
            return draw(s.final_logits(logits), s.uniform())

        out[name] = {
            "chatml_ms": round(_mean_ms(lambda s=ours: s.pick(logits), repeats), 3),
            "mlx_ops_ms": round(_mean_ms(mlx_ops, repeats), 2),
            "mlx_lm_ms": round(
                _mean_ms(lambda f=theirs: f(logits - mx.logsumexp(logits)), repeats), 2
            ),
        }
    token = mx.array(123, dtype=mx.uint32)

    def logprobs_mlx_ops():  # Sampler._record's fallback: log_softmax, a partition, gathers
        lp = logits - mx.logsumexp(logits)
        top = mx.argpartition(-lp, 4)[:5]
        return lp[token], top, lp[top]

    # a whole Sampler call (processors, then the pick), as a decode step makes it
    history = list(range(100))
    for name, extra in CALLS.items():
        params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=0, **extra)
        call = Sampler(params)
        out[name] = {"chatml_ms": round(_mean_ms(lambda c=call: c(logits, history), repeats), 3)}
    out["logprobs top 5"] = {
        "chatml_ms": round(_mean_ms(lambda: logprobs(logits, token, 5), repeats), 3),
        "mlx_ops_ms": round(_mean_ms(logprobs_mlx_ops, repeats), 2),
    }
    out["rows"] = measure_rows(vocab, rows, repeats)
    return out


def measure_rows(vocab: int, rows: int, repeats: int) -> dict:
    """A batched step's picks: `rows` rows with Qwen's cuts (top_k 20, top_p 0.95), each
    seeded, picked together (`pick_rows`) against one pick per row: the engine's path (the
    native pass on a CPU, MLX's ops on a GPU) and MLX's ops themselves (a GPU's path, on any
    device)."""
    import mlx.core as mx

    from engine.runtime.sampling import Sampler, SamplingParams, draw, pick_rows

    x = mx.random.normal((rows, vocab), key=mx.random.key(1)) * 3
    mx.eval(x)
    samplers = [Sampler(SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=i))
                for i in range(rows)]  # fmt: skip
    history = [[] for _ in range(rows)]
    each = list(x)  # the rows as a step hands them over

    def engine_together():
        return pick_rows(samplers, each, history)

    def engine_alone():
        return [s(row, []) for s, row in zip(samplers, each)]

    def ops_together():
        return draw(samplers[0].final_logits(x), mx.stack([s.uniform() for s in samplers]))

    def ops_alone():
        return [draw(s.final_logits(row), s.uniform()) for s, row in zip(samplers, each)]

    timed = {name: round(_mean_ms(fn, repeats), 3) for name, fn in (
        ("engine_together_ms", engine_together), ("engine_alone_ms", engine_alone),
        ("mlx_ops_together_ms", ops_together), ("mlx_ops_alone_ms", ops_alone))}  # fmt: skip
    return {"rows": rows, **timed}


def measure_decode(model: str, quantize: int | None, tokens: int, repeats: int) -> dict:
    import statistics

    import engine
    from bench.common import model_path
    from engine.runtime.generate import decode, prefill
    from engine.runtime.sampling import Sampler, SamplingParams

    eng = engine.load(str(model_path(model)), quantize=quantize)
    sampled = SamplingParams(**eng.sampling_defaults, seed=0)
    ids = list(range(1000, 1128))

    def ms_per_token(params: SamplingParams, n: int) -> float:
        caches = eng.model.make_caches()
        logits, _ = prefill(eng.model, caches, ids, 0)
        first, count = None, 0
        for _ in decode(eng.model, caches, logits, Sampler(params), max_tokens=n, stop_ids=(),
                        history=list(ids)):  # fmt: skip
            count += 1
            first = first or time.perf_counter()
        return (time.perf_counter() - first) / (count - 1) * 1e3

    runs: dict[str, list[float]] = {"greedy": [], "sampled": []}
    for params in (SamplingParams(), sampled):  # warm-up
        eng.worker.call(ms_per_token, params, 4)
    for _ in range(repeats):
        runs["greedy"].append(eng.worker.call(ms_per_token, SamplingParams(), tokens))
        runs["sampled"].append(eng.worker.call(ms_per_token, sampled, tokens))
    out = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    return {"model": model, "quantize": quantize, "tokens": tokens,
            "sampling": eng.sampling_defaults, "greedy_ms": out["greedy"],
            "sampled_ms": out["sampled"], "sampled_over_greedy": round(out["sampled"] / out["greedy"], 3),
            "runs_ms": runs}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--rows", type=int, default=8, help="rows of a batched step's picks")
    ap.add_argument("--repeats", type=int, help="picks to average (30), or decodes (4)")
    ap.add_argument("--model", help="time whole decode steps of this model instead")
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="with --model")
    ap.add_argument("--tokens", type=int, default=40, help="with --model: tokens per decode")
    ap.add_argument("--json")
    a = ap.parse_args()

    import engine  # noqa: F401  (the fast BLAS before mlx)
    from bench.common import conditions, write_json

    if a.model:
        before = conditions()["load_average"]
        r = measure_decode(a.model, a.quantize, a.tokens, a.repeats or 4)
        result = {"loadavg_before": before, "conditions": conditions(), "decode": r}
        print(
            f"{a.model} (quantize {a.quantize}), ms per token, median of "
            f"{len(r['runs_ms']['greedy'])}: greedy {r['greedy_ms']:.1f}, sampled "
            f"({r['sampling']}) {r['sampled_ms']:.1f}: {r['sampled_over_greedy']:.3f}x"
        )
        print(json.dumps({"bench": "sampling", **result}))
        write_json(a.json, result)
        return

    repeats = a.repeats or 30
    before = conditions()["load_average"]
    r = measure(a.vocab, repeats, rows=a.rows)
    result = {"vocab": a.vocab, "repeats": repeats, "loadavg_before": before,
              "conditions": conditions(), "sampling": r}  # fmt: skip
    print(f"one pick over {a.vocab} logits, mean of {repeats}; greedy argmax "
          f"{r['greedy_argmax_ms']:.2f} ms")  # fmt: skip
    print(f"  {'cuts':<24}{'chatml':>10}{'MLX ops':>11}{'mlx-lm':>10}{'mlx-lm/chatml':>15}")
    for name in CUTS:
        c, o, m = (r[name][k] for k in ("chatml_ms", "mlx_ops_ms", "mlx_lm_ms"))
        print(f"  {name:<24}{c:>8.2f} ms{o:>8.2f} ms{m:>7.2f} ms{m / c:>14.2f}x")
    for name in CALLS:
        print(f"  {name:<30}{r[name]['chatml_ms']:>8.2f} ms")
    lp = r["logprobs top 5"]
    print(f"  {'logprobs, top 5':<24}{lp['chatml_ms']:>8.2f} ms{lp['mlx_ops_ms']:>8.2f} ms")
    b = r["rows"]
    print(
        f"  {b['rows']} seeded rows (top_k 20, top_p 0.95), together / one by one: engine "
        f"{b['engine_together_ms']:.2f} / {b['engine_alone_ms']:.2f} ms, MLX ops "
        f"{b['mlx_ops_together_ms']:.2f} / {b['mlx_ops_alone_ms']:.2f} ms"
    )
    print(json.dumps({"bench": "sampling", **result}))
    write_json(a.json, result)


if __name__ == "__main__":
    main()
