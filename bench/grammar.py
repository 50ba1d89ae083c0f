"""Constrained decoding cost: decode tokens/s with and without a grammar, grammar compile
time, and time to first token with a cold vs a cached grammar.

Run: ``chatml bench grammar [--model tiny] [--tokens 48] [--json-out FILE]``. Decoding uses
a fresh full prefill of one short prompt per run and greedy picks; the constrained answer is
a 400-character JSON string, so both runs decode the same number of tokens. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from bench.common import conditions, write_json

PROMPT = "Write a long sentence."
SCHEMA = {"type": "string", "minLength": 400, "maxLength": 400}


def _spec(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _run(eng, spec, tokens: int) -> dict:
    """Fresh prefill, then `tokens` greedy steps: (ttft_s, decode tokens/s)."""
    from engine.constraints import make_sampler
    from engine.runtime.generate import decode, prefill
    from engine.runtime.sampling import SamplingParams

    ids = eng.tokenizer.encode(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    t0 = time.perf_counter()
    sampler = make_sampler(eng, SamplingParams(), thinking=False, spec=spec)
    caches = eng.model.make_caches()
    logits, _ = prefill(eng.model, caches, ids, 0)
    steps = decode(eng.model, caches, logits, sampler, max_tokens=tokens, stop_ids=(),
                   history=list(ids))  # fmt: skip
    next(steps)
    t1 = time.perf_counter()
    n = 1 + sum(1 for _ in steps)
    t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "decode_tokens_per_s": (n - 1) / (t2 - t1), "tokens": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chatml bench grammar", description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    import engine
    from engine.runtime import grammar

    eng = engine.load(args.model)
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

    _run(eng, None, 4)  # warm up the model's compiled steps
    plain = _run(eng, None, args.tokens)
    cold = _run(eng, _spec({**SCHEMA, "description": uuid.uuid4().hex}), args.tokens)
    cached = _run(eng, _spec(SCHEMA), 4) and _run(eng, _spec(SCHEMA), args.tokens)
    slower = 1 - cached["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    result = {
        "bench": "grammar", "model": args.model, "conditions": conditions(),
        "llguidance_tokenizer_s": tokenizer_s, "compile_typical_schema_s": compile_s,
        "compile_cached_s": cached_s, "unconstrained": plain, "constrained_cold": cold,
        "constrained_cached": cached, "constrained_slower_fraction": slower,
    }  # fmt: skip
    print(f"decode tok/s: unconstrained {plain['decode_tokens_per_s']:.1f}, constrained "
          f"{cached['decode_tokens_per_s']:.1f} ({slower:+.0%} slower)")  # fmt: skip
    print(f"grammar compile (typical schema): {compile_s * 1e3:.1f} ms, cached "
          f"{cached_s * 1e3:.2f} ms; llguidance tokenizer {tokenizer_s:.2f} s (once)")  # fmt: skip
    print(f"TTFT: unconstrained {plain['ttft_s'] * 1e3:.0f} ms, cold grammar "
          f"{cold['ttft_s'] * 1e3:.0f} ms, cached grammar {cached['ttft_s'] * 1e3:.0f} ms")  # fmt: skip
    write_json(args.json_out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
