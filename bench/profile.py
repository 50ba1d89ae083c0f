"""Where a decode step's time goes: the per-token cost broken into its parts.

Run: ``chatml bench profile --model qwen3.5-0.8b [--depth 512] [--json FILE]``.

One decode step of the engine's model (batch 1, one token, after a ``--depth``-token prompt) is
timed whole, then each kind of work in it is timed alone with the same shapes, evaluated the
same way (one ``mx.eval`` per step):

- ``build``: Python building the step's graph (the model call, no evaluation);
- ``matvec``: every projection of every layer (``x @ W.T`` with one row);
- ``lm_head``: the output projection over the vocabulary;
- ``delta``: the Gated DeltaNet recurrence of every linear-attention layer (one token);
- ``attention``: scaled dot-product attention of every full-attention layer at this depth;
- ``sample``: greedy sampling (argmax over the vocabulary);
- ``rest``: what the step costs beyond the parts (norms, the conv, gates, cache writes,
  scheduling): step + sample - the parts.

And the host side (``host``): the graph nodes one step dispatches and the Python time to build
them, against mlx-lm's qwen3_5 on the same checkpoint; and a short turn through the Python
API whole (``short_turn``: `Session.send` of a one-line message after the conversation's
cached prefix, 4 tokens generated, greedy; on ``tiny`` almost all of it is per-turn overhead).

The weights are read once per token, so ``matvec + lm_head`` against the bytes they read gives
the achieved bandwidth. Each figure is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.common import conditions, model_path, write_json


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _nbytes(m) -> int:
    """Bytes a layer's product reads: the weight, and for quantized layers its scales/biases."""
    return sum(m[k].nbytes for k in ("weight", "scales", "biases") if k in m)


def profile(model: str, depth: int, repeats: int, quantize: int | None = None) -> dict:
    import engine  # noqa: I001  (before mlx: the fast BLAS loads first)

    import mlx.core as mx
    import mlx.nn as nn
    from engine.runtime.generate import prefill
    from kernels import gated_delta

    eng = engine.load(str(model_path(model)), quantize=quantize)
    net = eng.model
    a = net.arch
    caches = net.make_caches()
    prefill(net, caches, list(range(1000, 1000 + depth)), 0)
    token = mx.array([[1234]])

    def step(evaluate: bool = True):
        saved = [c.snapshot() for c in caches]
        out = mx.argmax(net(token, caches)[0, -1])
        if evaluate:
            mx.eval(out)
        for c, s in zip(caches, saved):
            c.restore(s)  # the next run decodes at the same depth

    out: dict = {"depth": depth}
    out["step"] = _median_ms(step, repeats)
    out["build"] = _median_ms(lambda: step(evaluate=False), repeats)

    x = mx.random.normal((1, 1, a.hidden_size))
    linears = [m for layer in net.layers for _, m in layer.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear))]  # fmt: skip
    inputs = [mx.random.normal((1, 1, m.weight.shape[1] * 32 // getattr(m, "bits", 32)))
              for m in linears]  # fmt: skip
    mx.eval(x, inputs)
    out["matvec"] = _median_ms(lambda: mx.eval([m(v) for m, v in zip(linears, inputs)]), repeats)
    out["lm_head"] = _median_ms(lambda: mx.eval(net.logits(x)), repeats)
    head = net.embed_tokens if a.tie_word_embeddings else net.lm_head
    out["weight_bytes"] = sum(_nbytes(m) for m in linears) + _nbytes(head)

    n_linear = a.layer_types.count("linear_attention")
    n_full = len(a.layer_types) - n_linear
    hk, hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                      a.linear_value_head_dim)  # fmt: skip
    q = mx.random.normal((1, 1, hk, dk))
    v = mx.random.normal((1, 1, hv, dv))
    g, beta = mx.full((1, 1, hv), 0.9), mx.full((1, 1, hv), 0.5)
    states = [mx.random.normal((1, hv, dv, dk)) for _ in range(n_linear)]
    mx.eval(q, v, g, beta, states)
    out["delta"] = _median_ms(
        lambda: mx.eval([gated_delta(q, q, v, g, beta, s) for s in states]),  # as decode picks
        repeats,
    )
    qa = mx.random.normal((1, a.num_attention_heads, 1, a.head_dim))
    kv = [mx.random.normal((1, a.num_key_value_heads, depth + 1, a.head_dim))
          for _ in range(n_full)]  # fmt: skip
    mx.eval(qa, kv)
    out["attention"] = _median_ms(
        lambda: mx.eval([mx.fast.scaled_dot_product_attention(qa, k, k, scale=1.0) for k in kv]),
        repeats,
    )
    logits = mx.random.normal((a.vocab_size,))
    mx.eval(logits)
    out["sample"] = _median_ms(lambda: mx.eval(mx.argmax(logits)), repeats)
    parts = ("build", "matvec", "lm_head", "delta", "attention", "sample")
    out["rest"] = out["step"] - sum(out[p] for p in parts)
    out["gb_per_s"] = out["weight_bytes"] / ((out["matvec"] + out["lm_head"]) * 1e-3) / 1e9
    out["tokens_per_s"] = 1e3 / out["step"]
    return out


def graph_nodes(*outputs) -> int:
    """Operations in the lazy graph behind `outputs` (what evaluating them dispatches)."""
    import tempfile

    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return f.read().count("shape=rectangle")


def host(model: str, depth: int = 64, repeats: int = 50) -> dict:
    """The host side of one decode step (batch 1, greedy), this engine against mlx-lm's
    qwen3_5 on the same checkpoint: graph nodes, and milliseconds of Python to build them."""
    import engine  # noqa: I001  (before mlx: the fast BLAS loads first)

    import mlx.core as mx
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.models.cache import make_prompt_cache
    from engine.runtime.generate import cache_arrays, prefill
    from engine.runtime.step import Row, forward, rollback

    path = str(model_path(model))
    prompt = list(range(1000, 1000 + depth))
    net = engine.load(path).model
    caches = net.make_caches()
    prefill(net, caches, prompt, 0)

    def ours():
        ((logits, mark),) = forward(net, [Row(caches, [1234])])
        return mx.argmax(logits[-1]), mark

    first, mark = ours()  # the first step traces the compiled layers
    mx.eval(first, cache_arrays(caches))
    rollback(caches, mark, mark.start)
    out = {"depth": depth}

    def build_ours():
        y, mark = ours()
        rollback(caches, mark, mark.start)
        return y

    y = build_ours()
    out["engine_nodes"] = graph_nodes(y)
    out["engine_build_ms"] = _median_ms(build_ours, repeats)

    theirs, _ = mlx_lm_load(path)
    cache = make_prompt_cache(theirs)
    mx.eval(theirs(mx.array([prompt]), cache=cache), [c.state for c in cache])
    token = mx.array([[1234]])

    def build_theirs():
        y = mx.argmax(theirs(token, cache=cache)[0, -1])
        for c in cache:  # back to the same depth without evaluating the step
            if hasattr(c, "offset") and c.offset > depth:
                c.offset = depth
        return y

    snapshot = [list(c.state) for c in cache]
    out["mlx_lm_nodes"] = graph_nodes(build_theirs())

    def build_theirs_restored():
        build_theirs()
        for c, s in zip(cache, snapshot):
            c.state = s

    out["mlx_lm_build_ms"] = _median_ms(build_theirs_restored, repeats)
    return out


def short_turn(model: str, repeats: int = 20) -> dict:
    """A short turn's wall time through `Session.send`, median of `repeats` turns of one
    conversation (never trimmed: each prefills its own exchange, after the cached prefix)."""
    import engine

    eng = engine.load(str(model_path(model)))
    chat = eng.session("You are a helpful assistant.", max_exchanges=repeats + 1)
    chat.send("hello there", max_tokens=4)
    ms, prefilled = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        turn = chat.send(f"question number {i}: what next?", max_tokens=4)
        ms.append((time.perf_counter() - t0) * 1e3)
        prefilled.append(turn.stats.prefilled_tokens)
    return {"short_turn_ms": statistics.median(ms), "short_turn_prefilled": statistics.median(prefilled),
            "short_turn_generated": 4}  # fmt: skip


def print_table(r: dict) -> None:
    print(f"decode step at depth {r['depth']}: {r['step']:.1f} ms ({r['tokens_per_s']:.1f} tok/s)")
    for part in ("build", "matvec", "lm_head", "delta", "attention", "sample", "rest"):
        print(f"  {part:<10}{r[part]:>8.2f} ms {100 * r[part] / r['step']:>5.0f}%")
    print(f"  weights {r['weight_bytes'] / 2**30:.2f} GiB read at {r['gb_per_s']:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    ap.add_argument("--depth", type=int, default=512, help="prompt tokens before the step")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quantize", type=int, choices=(4, 8),
                    help="quantize the checkpoint at load (the engine's step only; host "
                         "compares float32 graphs with mlx-lm)")  # fmt: skip
    ap.add_argument("--json")
    a = ap.parse_args()
    r = profile(a.model, a.depth, a.repeats, a.quantize)
    h = host(a.model, a.depth, a.repeats) | short_turn(a.model, a.repeats)
    result = {
        "conditions": conditions(model=a.model, dtype="float32", quantize=a.quantize),
        "profile": r,
        "host": h,
    }
    print_table(r)
    print(f"host: {h['engine_nodes']} graph nodes, {h['engine_build_ms']:.2f} ms to build "
          f"(mlx-lm: {h['mlx_lm_nodes']} nodes, {h['mlx_lm_build_ms']:.2f} ms); a short turn "
          f"({h['short_turn_prefilled']:.0f} tokens prefilled, 4 generated) "
          f"{h['short_turn_ms']:.1f} ms")  # fmt: skip
    print(json.dumps({"bench": "profile", **result}))
    write_json(a.json, result)


if __name__ == "__main__":
    main()
