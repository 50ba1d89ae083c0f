"""Train `tiny-chat` on the synthetic chats of train/data.py, on the CPU, reproducibly.

    nice -n 19 python -m train.train            # trains, writes the weights file models.yaml names
    python -m train.train --steps 20 --dry-run  # step time only (choosing sizes by measurement)

The model is the engine's own `Qwen35` (engine/runtime/model.py) with the `tiny-chat` entry's
architecture, so what trains is exactly what the engine runs. Only the embedding rows the data
uses are trained (`V'` rows, tied input/output): the loss is the full-vocabulary softmax with
every other row's logit taken as 0 (one extra column holding log(vocab - V'), the log-sum-exp
of those zeros), and the builder regenerates those rows at a scale (`UNTRAINED_STD`) that
keeps their logits near 0, far below the trained answers'. The Gated DeltaNet recurrence runs
through the chunked kernel with its matmul-only triangular inverse, which MLX can differentiate.

Determinism: the data (TRAIN_SEED), the initial weights (the builder's seeded generator) and
the batch order (--seed) are all seeded; MLX on the CPU is deterministic for a fixed thread
count, so a rerun on this machine gives the same loss curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

import engine  # noqa: F401  (first: it loads the fast BLAS before MLX)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from engine.checkpoints import builder, registry
from engine.checkpoints.tokenizer import Tokenizer
from engine.runtime import model as model_module
from engine.runtime.cache import RecurrentCache
from kernels import delta_rule, gated_delta
from train import data, evaluate
from train import weights as weights_file

MODEL = "tiny-chat"
PAD_TO = 32  # batch lengths are padded to a multiple of this (few distinct shapes to compile)


class _TrainKV:
    """A KV 'cache' for one whole-sequence forward: nothing kept, keys and values as given
    (the engine's KVCache writes in place into a buffer, which autodiff need not go through)."""

    offset = 0

    def update(self, k, v):
        return k, v


@mx.custom_function
def _tri_inv(a):
    return mx.linalg.tri_inv(a, upper=False, stream=mx.cpu)


@_tri_inv.vjp
def _tri_inv_vjp(primals, cotangent, output):
    # X = A^-1: dA = -X^T dX X^T (only A's strictly lower part is used by the caller)
    x = output.swapaxes(-1, -2)
    return (-(x @ cotangent @ x),)


def _unit_lower_inverse(a, *, method="auto"):
    shape = a.shape
    return _tri_inv(a.reshape(-1, *shape[-2:])).reshape(shape)


def _differentiable_delta(q, k, v, g, beta, state=None, *, method="auto"):
    return gated_delta(q, k, v, g, beta, state, method="chunked")


def _attention(q, k, v, *, scale, mask=None):
    """`mx.fast.scaled_dot_product_attention`'s math as plain ops (GQA, causal mask): on the
    CPU its forward measured ~10x slower than this at training shapes (B=12, T=160)."""
    r = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)  # [B, Hq, T, S]
    if mask == "causal":
        T, S = scores.shape[-2:]
        causal = mx.arange(S)[None] <= (mx.arange(T) + S - T)[:, None]
        scores = mx.where(causal, scores, -mx.inf)
    return mx.softmax(scores, axis=-1, precise=True) @ v


def tokenizer() -> Tokenizer:
    from engine.checkpoints.tokenizer import tokenizer_json

    path = tokenizer_json().parent
    return Tokenizer.from_folder(path)


def make_samples(
    n: int, seed: int, tok: Tokenizer, short: float = 0.0
) -> list[tuple[list[int], list[int]]]:
    """n encoded chats: `data.short_chat` with probability `short`, else `data.training_chat`."""
    rng = np.random.default_rng(seed)
    make = [data.training_chat, data.short_chat]
    return [data.encode(make[bool(rng.random() < short)](rng), tok) for _ in range(n)]


def init_model(
    entry: registry.ModelEntry, vocab: np.ndarray, embed_std: float
) -> model_module.Qwen35:
    """The engine's model over the V' used rows, initialised by the builder's seeded tensors
    (the embedding rows rescaled to `embed_std`: tied rows start with logits of a useful size,
    since the answer's logit must beat the log-sum-exp of the ~248k untrained rows, ~12.4)."""
    arch = dataclasses.replace(entry.arch, vocab_size=len(vocab))
    model = model_module.Qwen35(arch)
    tensors = {}
    for spec in builder.tensor_plan(entry.arch):
        x = builder._generate(spec, entry.seed)
        if spec.name.endswith("embed_tokens.weight"):
            x = x[vocab] * np.float32(embed_std / spec.std)
        tensors[spec.name] = mx.array(x)
    model.load_weights(list(model_module.sanitize(tensors, arch).items()))
    return model


def loss_fn(model, ids, targets, mask, untrained_log_mass):
    caches = [RecurrentCache() if layer.is_linear else _TrainKV() for layer in model.layers]
    logits = model(ids, caches)  # [B, T, V']
    B, T, _ = logits.shape
    rest = mx.full((B, T, 1), untrained_log_mass, dtype=logits.dtype)
    logits = mx.concatenate([logits, rest], axis=-1)
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    return (ce * mask).sum() / mask.sum()


def batches(samples, batch: int, rng: np.random.Generator, remap: np.ndarray):
    """Endless batches: shuffled, grouped by length (little padding), padded to PAD_TO."""
    order = np.argsort([len(s[0]) for s in samples], kind="stable")
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    while True:
        for g in rng.permutation(len(groups)):
            rows = [samples[i] for i in groups[g]]
            T = -(-max(len(r[0]) for r in rows) // PAD_TO) * PAD_TO
            ids = np.zeros((len(rows), T + 1), np.int32)
            mask = np.zeros((len(rows), T), np.float32)
            for j, (x, m) in enumerate(rows):
                ids[j, : len(x)] = remap[x]
                mask[j, : len(x) - 1] = m[1:]
            yield mx.array(ids[:, :-1]), mx.array(ids[:, 1:]), mx.array(mask)


def held_out(n: int, tok: Tokenizer, seed: int = data.TRAIN_SEED + 100):
    """n memory-scenario chats the training does not see (`evaluate.cases`, from their own
    seed: half inside the window, half dropped), each as (ids, answer length, inside)."""
    out = []
    for case in evaluate.cases(n, seed):
        ids, _ = data.encode(case.chat, tok)
        out.append((ids, len(tok.encode(case.chat.exchanges[-1].assistant)) + 1, case.inside))
    return out


def exact_answers(model, cases, remap: np.ndarray, batch: int = 32) -> dict:
    """The fraction of cases whose last answer every argmax gets right, teacher-forced: the
    answer greedy decoding would give (over the trained rows, whose winning logits are far
    above the untrained rows' ~0), inside the window and dropped from it."""
    caches_for = lambda: [  # noqa: E731
        RecurrentCache() if layer.is_linear else _TrainKV() for layer in model.layers
    ]
    hits = {True: [], False: []}
    for i in range(0, len(cases), batch):
        rows = cases[i : i + batch]
        T = max(len(r[0]) for r in rows)
        ids = np.zeros((len(rows), T), np.int32)
        for j, (x, _, _) in enumerate(rows):
            ids[j, : len(x)] = remap[x]  # padded on the right: causal, so nothing changes
        pred = np.array(mx.argmax(model(mx.array(ids), caches_for()), axis=-1))
        for j, (x, n, inside) in enumerate(rows):
            L = len(x)
            hits[inside].append(bool((pred[j, L - n - 1 : L - 1] == ids[j, L - n : L]).all()))
    return {"inside": float(np.mean(hits[True])), "dropped": float(np.mean(hits[False]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=60000, help="training chats")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=8e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--embed-std", type=float, default=0.125, help="initial trained-row scale")
    p.add_argument("--seed", type=int, default=0, help="batch order")
    p.add_argument(
        "--minutes", type=float, default=0, help="stop after this wall time (0: no limit)"
    )
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100, help="exact answers on held-out chats")
    p.add_argument("--short", type=float, default=0.5, help="fraction of data.short_chat")
    p.add_argument("--phase", type=int, default=0, help="data seed offset (TRAIN_SEED + phase)")
    p.add_argument("--stop-after", type=int, default=0, help="stop after N steps (0: --steps)")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the step eagerly (compiled per shape by default: ~1.2x faster)",
    )
    p.add_argument("--save-every", type=int, default=100, help="write the weights every N steps")
    p.add_argument("--init-from", default=None, help="start from a weights file (continue a run)")
    p.add_argument("--dry-run", action="store_true", help="time the steps, write nothing")
    p.add_argument("--out", default=None, help="weights file (default: the one models.yaml names)")
    p.add_argument("--log", default=None, help="JSON log of the loss curve")
    args = p.parse_args(argv)

    # The training forward only: the chunked kernel, its triangular inverse with a gradient.
    model_module.gated_delta = _differentiable_delta
    delta_rule.unit_lower_inverse = _unit_lower_inverse
    mx.fast.scaled_dot_product_attention = _attention
    entry = registry.get(MODEL)
    tok = tokenizer()
    t0 = time.monotonic()
    samples = make_samples(args.samples, data.TRAIN_SEED + args.phase, tok, args.short)
    vocab = np.unique(np.concatenate([np.asarray(s[0]) for s in samples])).astype(np.int32)
    if args.init_from:  # a continuation keeps the file's rows (and adds any this data uses)
        rows = weights_file.trained._read(args.init_from, 0).tensors[weights_file.trained.IDS]
        vocab = np.union1d(vocab, rows).astype(np.int32)
    remap = np.full(entry.arch.vocab_size, -1, np.int64)
    remap[vocab] = np.arange(len(vocab))
    n_tokens = sum(len(s[0]) for s in samples)
    print(f"{len(samples)} chats, {n_tokens} tokens, {len(vocab)} vocabulary rows "
          f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip

    mx.random.seed(args.seed)
    model = init_model(entry, vocab, args.embed_std)
    if args.init_from:
        start = weights_file.load(Path(args.init_from), entry, vocab, model.embed_tokens.weight)
        model.load_weights(list(start.items()))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{n_params} trained parameters", flush=True)
    untrained = math.log(entry.arch.vocab_size - len(vocab))

    def schedule(step):
        warm = mx.minimum(1.0, (step + 1) / args.warmup)
        cos = 0.5 * (1 + mx.cos(math.pi * mx.minimum(step, args.steps) / args.steps))
        return args.lr * warm * (0.1 + 0.9 * cos)

    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.98], weight_decay=0.01)
    grad_fn = nn.value_and_grad(model, functools.partial(loss_fn, untrained_log_mass=untrained))
    state = [model.state, opt.state]

    def step(ids, targets, mask):
        loss, grads = grad_fn(model, ids, targets, mask)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    if args.compile:
        step = mx.compile(step, inputs=state, outputs=state)

    out = Path(args.out) if args.out else weights_file.path(entry)
    rng = np.random.default_rng(args.seed)
    stream = batches(samples, args.batch, rng, remap)
    evals = held_out(128, tok)
    curve, window, start = [], [], time.monotonic()
    for i in range(args.steps):
        ids, targets, mask = next(stream)
        loss = step(ids, targets, mask)
        mx.eval(loss, state)
        window.append(loss.item())
        if not args.dry_run and args.save_every and (i + 1) % args.save_every == 0:
            weights_file.save(out, model, entry, vocab)
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            elapsed = time.monotonic() - start
            point = {"step": i + 1, "loss": float(np.mean(window)), "minutes": elapsed / 60}
            if args.eval_every and (i + 1) % args.eval_every == 0:
                point["exact"] = exact_answers(model, evals, remap)
            curve.append(point)
            window = []
            print(f"step {i + 1:5d}  loss {point['loss']:.4f}  {elapsed / 60:6.1f} min  "
                  f"{elapsed / (i + 1):.2f} s/step  load {os.getloadavg()[0]:.1f}"
                  f"  {point.get('exact', '')}", flush=True)  # fmt: skip
            if args.log:
                meta = {"args": vars(args), "vocab_rows": len(vocab), "params": n_params,
                        "tokens": n_tokens, "curve": curve}  # fmt: skip
                Path(args.log).write_text(json.dumps(meta, indent=1))
            if args.stop_after and i + 1 >= args.stop_after:
                break
            if args.minutes and elapsed > 60 * args.minutes:
                print("wall-time limit reached", flush=True)
                break
    if args.dry_run:
        return 0

    weights_file.save(out, model, entry, vocab)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
