# ruff: noqa: I001  (engine first: it sets MLX_ENABLE_TF32 before MLX loads)
"""Device diagnosis for the lent GPU (not committed): decode step times and a profile,
precision of ours and mlx-lm against float32, the 4-bit section. One JSON per part."""

import cProfile
import io
import json
import os
import pstats
import sys
import time

import engine  # noqa: F401
import mlx.core as mx


def decode_ms(eng, n=12, prompt=64):
    from engine.runtime.generate import decode, prefill
    from engine.runtime.sampling import Sampler, SamplingParams

    ids = list(range(1000, 1000 + prompt))
    caches = eng.model.make_caches()
    logits, _ = prefill(eng.model, caches, ids, 0)
    mx.eval(logits)
    out, t = [], time.perf_counter()
    for _ in decode(eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=n,
                    stop_ids=(), history=list(ids)):  # fmt: skip
        now = time.perf_counter()
        out.append(round((now - t) * 1e3, 2))
        t = now
    return out


def part_decode(profile: bool):
    r = {}
    for dtype in ("bfloat16", "float32"):
        eng = engine.load("tiny", dtype=dtype)
        r[f"tiny-{dtype}"] = decode_ms(eng)
    # one raw forward of a single token, no decode loop
    eng = engine.load("tiny", dtype="bfloat16")
    caches = eng.model.make_caches()
    mx.eval(eng.model(mx.array([list(range(1000, 1064))]), caches))
    raw = []
    for i in range(6):
        t = time.perf_counter()
        mx.eval(eng.model(mx.array([[1000 + i]]), caches))
        raw.append(round((time.perf_counter() - t) * 1e3, 2))
    r["raw_forward_ms"] = raw
    if profile:
        from bench.common import model_path

        eng = engine.load(str(model_path("qwen3.5-0.8b", dtype="bfloat16")), dtype="bfloat16")
        r["0.8b-bfloat16"] = decode_ms(eng, n=10, prompt=512)
        decode_ms(eng, 4)
        pr = cProfile.Profile()
        pr.enable()
        decode_ms(eng, 8)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        r["profile"] = s.getvalue()[-3000:]
    return r


def part_precision():
    from bench.common import mlx_lm_model
    from bench.gpu_check import PROMPT, _bf16_tiny

    r = {}
    for moe in (False, True) if mx.default_device() != mx.cpu else (False,):
        path = _bf16_tiny(moe)
        e16 = engine.load(str(path), dtype="bfloat16")
        ids = e16.tokenizer.encode(PROMPT * 3)
        x = mx.array([ids])
        o16 = e16.model(x, e16.model.make_caches())[0].astype(mx.float32)
        e32 = engine.load(str(path), dtype="float32")
        o32 = e32.model(x, e32.model.make_caches())[0]
        ref = mlx_lm_model(path)
        r16 = ref(x, cache=ref.make_cache())[0].astype(mx.float32)
        ref.set_dtype(mx.float32)
        r32 = ref(x, cache=ref.make_cache())[0]

        def d(a, b):
            return round(mx.abs(a - b).max().item(), 5)

        def agree(a, b):
            return round((mx.argmax(a, -1) == mx.argmax(b, -1)).mean().item(), 4)

        r["moe" if moe else "dense"] = {
            "tokens": len(ids),
            "ours32_vs_mlxlm32": d(o32, r32),
            "ours16_vs_f32": d(o16, o32), "mlxlm16_vs_f32": d(r16, o32),
            "ours16_vs_mlxlm16": d(o16, r16),
            "agree_ours16_f32": agree(o16, o32), "agree_mlxlm16_f32": agree(r16, o32),
        }  # fmt: skip
    return r


def part_quantized():
    from bench.gpu_check import quantized_section

    return quantized_section(False)


if __name__ == "__main__":
    part = sys.argv[1]
    t = time.perf_counter()
    try:
        if part == "decode":
            res = part_decode(profile=len(sys.argv) > 2)
        else:
            res = {"precision": part_precision, "quantized": part_quantized}[part]()
    except Exception as e:  # noqa: BLE001
        res = {"error": f"{type(e).__name__}: {e}"[:600]}
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    print(json.dumps({"part": part, "env": env, "s": round(time.perf_counter() - t, 1), **res}))
