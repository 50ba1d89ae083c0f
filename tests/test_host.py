"""The host side of a decode step: the compiled per-layer step replays the same math as the
layer's eager path, and dispatches fewer graph nodes than mlx-lm's qwen3_5 on the same model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.runtime.generate import cache_arrays, prefill
from engine.runtime.step import Row, forward

PROMPT = list(range(1000, 1040))


def _step_logits(eng, compiled: bool) -> list[np.ndarray]:
    """Logits of 6 greedy decode steps after PROMPT, with the layers' compiled decode path or
    with their eager one (forced by asking for a captured state, which the compiled path never
    takes)."""
    net = eng.model
    caches = net.make_caches()
    logits, _ = prefill(net, caches, PROMPT, 0)
    out = []
    token = int(mx.argmax(logits).item())
    for _ in range(6):
        if not compiled:
            for c in caches:
                if hasattr(c, "capture"):
                    c.capture = [5]  # beyond the one-token step: no state is kept, eager path
        ((step, _),) = forward(net, [Row(caches, [token])])
        for c in caches:
            if hasattr(c, "capture"):
                c.capture = []
        mx.eval(step, cache_arrays(caches))
        out.append(np.array(step[-1].astype(mx.float32)))
        token = int(np.argmax(out[-1]))
    return out


def test_compiled_decode_equals_the_eager_layers(tiny, tiny_moe, tiny_bf16) -> None:
    for eng, tol in ((tiny, 1e-5), (tiny_moe, 1e-5), (tiny_bf16, 5e-2)):
        fast, eager = _step_logits(eng, True), _step_logits(eng, False)
        for a, b in zip(fast, eager, strict=True):
            assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


def test_decode_graph_is_smaller_than_mlx_lm(tiny) -> None:
    from bench.profile import host

    r = host(str(tiny.path), depth=16, repeats=2)
    assert r["engine_nodes"] <= r["mlx_lm_nodes"], r


def test_profile_counts_quantized_weights(tiny) -> None:
    """`chatml bench profile --quantize 4`: the step's parts are timed on the compact layers,
    and the bytes they read are the packed weights with their scales and biases."""
    import mlx.nn as nn

    import engine
    from bench.profile import profile

    r = profile(str(tiny.path), depth=8, repeats=2, quantize=4)
    net = engine.load(str(tiny.path), quantize=4).model
    packed = sum(v.nbytes for k, v in nn.utils.tree_flatten(net.parameters())
                 if k.rsplit(".", 1)[-1] in ("weight", "scales", "biases")
                 and "norm" not in k and "conv" not in k)  # fmt: skip
    assert r["weight_bytes"] == packed
    assert r["step"] > 0 and r["matvec"] > 0 and r["lm_head"] > 0


def test_short_turn_prefills_only_its_exchange(tiny) -> None:
    """`bench.profile.short_turn` times turns that each prefill their own exchange after the
    cached prefix (a trimmed window would re-prefill the whole conversation instead)."""
    from bench.profile import short_turn

    r = short_turn(str(tiny.path), repeats=3)
    assert r["short_turn_ms"] > 0 and 0 < r["short_turn_prefilled"] < 40
