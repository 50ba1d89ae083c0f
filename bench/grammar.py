"""Constrained decoding cost: decode tokens/s with and without a grammar (and where the
difference goes), grammar compile time, and time to first token with a cold vs a cached
grammar.

Run: ``chatml bench grammar [--model tiny] [--tokens 48] [--repeats 3] [--json-out FILE]``.
Decoding uses a fresh full prefill of one short prompt per run and greedy picks; the
constrained answer is `{"text": <a 400-character string>}`, longer than any run, and no token
stops a run, so every run decodes the same number of tokens. The decode variants run
interleaved, `--repeats` rounds, and each reports its best round (a loaded machine only
ever slows a run down):

- unconstrained: the pipelined loop (the next step is queued before the token is read);
- one step at a time: a no-op processor that reads the history, so the loop waits for each
  token before building the next step (what any grammar costs before its mask);
- all-allowed mask: the same plus a host mask of ones applied to the logits (the transfer
  and the `where`);
- grammar_serial: llguidance's mask for that JSON, computed after the step's logits
  (its host time per token also reported);
- grammar: the same, the mask computed while the device computes the logits (the default).

Then the grammar under speculative decoding, each against `grammar` (plain constrained
decoding) run beside it in the same rounds, its tokens checked equal to plain's:

- spec_lookup: prompt lookup with the adaptive draft length (what `speculative="lookup"`
  runs);
- spec_injected_R: the plain constrained answer itself drafted, k = 4, each draft token wrong
  with probability R (0, 0.5, 1): the mechanism at known acceptance (random weights make real
  acceptance meaningless). A wrong token the grammar refuses is cut before verifying.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

import numpy as np

from bench.common import conditions, write_json

PROMPT = "Write a long sentence."
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400,
          "maxLength": 400}}, "required": ["text"]}  # fmt: skip
VARIANTS = ("unconstrained", "one_step_at_a_time", "all_allowed_mask", "grammar_serial",
            "grammar")  # fmt: skip
SPECULATIVE = ("spec_lookup", "spec_injected_0", "spec_injected_0.5", "spec_injected_1")


def _spec(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _paused():
    """A processor that changes nothing but reads the history (no running ahead)."""
    from engine.runtime.sampling import LogitsProcessor

    class Paused(LogitsProcessor):
        reads_history = True

        def __call__(self, logits, history):
            return logits

    return Paused()


def _ones():
    """An all-true host mask, applied as a grammar's is."""
    import mlx.core as mx

    class Ones(type(_paused())):
        def __call__(self, logits, history):
            allowed = np.ones(logits.shape[-1], dtype=bool)
            return mx.where(mx.array(allowed), logits, -mx.inf)

    return Ones()


def _timed(inner):
    """`inner` (a processor) with the host time of its calls (the mask) in `.host_s`."""
    from engine.runtime.sampling import LogitsProcessor

    class Timed(LogitsProcessor):
        reads_history = inner.reads_history
        host_s = 0.0

        def __call__(self, logits, history):
            t = time.perf_counter()
            out = inner(logits, history)
            self.host_s += time.perf_counter() - t
            return out

        def advance(self, token):
            inner.advance(token)

        def accept(self, tokens):
            inner.accept(tokens)

    return Timed()


def _sampler(eng, variant: str | None, spec: dict | None):
    from engine.constraints import make_sampler
    from engine.runtime.sampling import Sampler, SamplingParams

    if variant == "one_step_at_a_time":
        return Sampler(SamplingParams(), [_paused()])
    if variant == "all_allowed_mask":
        return Sampler(SamplingParams(), [_ones()])
    return make_sampler(eng, SamplingParams(), thinking=False, spec=spec)


def _drafter(variant: str, truth: list[int], prompt_len: int):
    """The drafter and draft policy of a `SPECULATIVE` variant."""
    from engine.runtime.speculative import DraftLength, InjectedDrafter, LookupDrafter

    if variant == "spec_lookup":
        return LookupDrafter(), DraftLength(4)
    rate = float(variant.rsplit("_", 1)[1])
    return InjectedDrafter(truth, prompt_len, rate), DraftLength(4, adaptive=False)


def _run(eng, tokens: int, variant: str | None = None, spec: dict | None = None,
         truth: list[int] | None = None) -> dict:  # fmt: skip
    """Fresh prefill, then `tokens` greedy steps: ttft_s, decode tokens/s, the tokens (and the
    grammar's host time per token; speculation's acceptance)."""
    from engine.runtime.generate import decode, prefill
    from engine.runtime.grammar import GrammarProcessor
    from engine.runtime.speculative import SpeculationStats, speculative_decode

    ids = eng.tokenizer.encode(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    t0 = time.perf_counter()
    sampler = _sampler(eng, variant, spec)
    timed = None
    for i, p in enumerate(sampler.processors):
        if isinstance(p, GrammarProcessor) and variant not in SPECULATIVE:  # drafts: bare
            p.overlap = variant != "grammar_serial"
            timed = sampler.processors[i] = _timed(p)
    caches = eng.model.make_caches()
    logits, _ = prefill(eng.model, caches, ids, 0)
    stats = None
    if variant in SPECULATIVE:
        drafter, policy = _drafter(variant, truth or [], len(ids))
        stats = SpeculationStats()
        steps = speculative_decode(
            eng.model, caches, logits, sampler, max_tokens=tokens, stop_ids=(),
            history=list(ids), drafter=drafter, policy=policy, stats=stats,
        )  # fmt: skip
    else:
        steps = decode(eng.model, caches, logits, sampler, max_tokens=tokens, stop_ids=(),
                       history=list(ids))  # fmt: skip
    got = [next(steps)]
    t1 = time.perf_counter()
    got += list(steps)
    t2 = time.perf_counter()
    n = len(got)
    out = {"ttft_s": t1 - t0, "decode_tokens_per_s": (n - 1) / (t2 - t1), "tokens": n,
           "ids": got}  # fmt: skip
    if timed is not None:
        out["mask_host_ms_per_token"] = timed.host_s / n * 1e3
    if stats is not None:
        out["acceptance"] = round(stats.acceptance_rate, 3)
        out["tokens_per_verify"] = round(stats.tokens_per_verify, 2)
        out["cut"] = stats.cut
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chatml bench grammar", description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (best kept)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--models-dir", default=None, help="where registry models are built")
    args = ap.parse_args(argv)

    import engine
    from bench.common import model_path
    from engine.runtime import grammar

    eng = engine.load(str(model_path(args.model, args.models_dir)))
    load_before = conditions()["load_average"]
    t = time.perf_counter()
    grammar.tokenizer_for(eng)
    tokenizer_s = time.perf_counter() - t
    typical = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name"],
        "description": uuid.uuid4().hex}  # fmt: skip
    t = time.perf_counter()
    grammar.check(eng, _spec(typical))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    grammar.check(eng, _spec(typical))
    cached_s = time.perf_counter() - t

    _run(eng, 4)  # warm up the model's compiled steps
    plain = _run(eng, args.tokens)
    cold = _run(eng, args.tokens, spec=_spec({**SCHEMA, "description": uuid.uuid4().hex}))
    cached = _run(eng, args.tokens, spec=_spec(SCHEMA))
    truth = cached["ids"]
    for v in SPECULATIVE[1:]:  # warm-up: compile the verify shapes
        _run(eng, 8, v, _spec(SCHEMA), truth)
    rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS + SPECULATIVE}
    for _ in range(args.repeats):
        for v in VARIANTS + SPECULATIVE:
            spec = None if v in VARIANTS[:3] else _spec(SCHEMA)
            rounds[v].append(run := _run(eng, args.tokens, v, spec, truth))
            if spec is not None and run["ids"] != truth:
                raise SystemExit(f"{v}: the constrained answer differs from plain decoding's")
    for r in rounds.values():
        for run in r:
            del run["ids"]
    best = {v: max(r, key=lambda x: x["decode_tokens_per_s"]) for v, r in rounds.items()}
    base = best["unconstrained"]["decode_tokens_per_s"]
    slower = {v: 1 - best[v]["decode_tokens_per_s"] / base for v in VARIANTS}
    grammar_tps = best["grammar"]["decode_tokens_per_s"]
    speedup = {v: best[v]["decode_tokens_per_s"] / grammar_tps for v in SPECULATIVE}
    result = {
        "bench": "grammar", "model": args.model, "conditions": conditions(),
        "load_average_before": load_before, "tokens": args.tokens, "repeats": args.repeats,
        "llguidance_tokenizer_s": tokenizer_s, "compile_typical_schema_s": compile_s,
        "compile_cached_s": cached_s, "ttft": {"unconstrained": plain, "constrained_cold": cold,
                                                "constrained_cached": cached},
        "decode_best": best, "decode_rounds": rounds, "slower_fraction": slower,
        "speculative_speedup_vs_grammar": speedup,
    }  # fmt: skip
    print(f"load average: before {load_before}, after {result['conditions']['load_average']}")
    print(f"decode tok/s, best of {args.repeats} interleaved rounds of {args.tokens} tokens:")
    for v in VARIANTS:
        extra = best[v].get("mask_host_ms_per_token")
        host = f", mask on the host {extra:.2f} ms/token" if extra is not None else ""
        print(f"  {v:<20} {best[v]['decode_tokens_per_s']:7.2f} ({slower[v]:+.1%} slower{host})")
    print("constrained under speculative decoding (vs grammar, plain constrained decoding):")
    for v in SPECULATIVE:
        b = best[v]
        print(f"  {v:<20} {b['decode_tokens_per_s']:7.2f} ({speedup[v]:.2f}x; acceptance "
              f"{b['acceptance']:.2f}, {b['tokens_per_verify']:.2f} tokens/verify, "
              f"{b['cut']} draft tokens cut by the grammar)")  # fmt: skip
    print(f"grammar compile (typical schema): {compile_s * 1e3:.1f} ms, cached "
          f"{cached_s * 1e3:.2f} ms; llguidance tokenizer {tokenizer_s:.2f} s (once)")  # fmt: skip
    print(f"TTFT: unconstrained {plain['ttft_s'] * 1e3:.0f} ms, cold grammar "
          f"{cold['ttft_s'] * 1e3:.0f} ms, cached grammar {cached['ttft_s'] * 1e3:.0f} ms")  # fmt: skip
    write_json(args.json_out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
