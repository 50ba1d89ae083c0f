"""Replay a scripted multi-turn chat through this engine and mlx-lm; time to first token per turn.

Run: ``chatml bench replay --model qwen3.5-0.8b [--turns 20] [--thinking on|off]
[--max-tokens 32] [--json FILE] [--plot FILE]``.

One run plays the same conversation (bench/conversation.py) through:

- ``chatml``: ``engine.load(path).session(system, max_exchanges=6).send(...)``;
- ``chatml_warm``: the same, calling ``Session.warm()`` after each answer (idle-time prefill
  of the next prompt's known prefix), when the engine has it;
- ``mlx_lm_stock``: ``mlx_lm.stream_generate`` on the full prompt ids with a fresh cache each
  turn (a stateless client of a stateless server), mlx-lm exactly as installed: its own
  interpreter, engine never imported (on Linux: the mlx-cpu wheel's reference BLAS);
- ``mlx_lm_stock_fast_blas``: the same stateless turns in this process, on this engine's fast
  BLAS: the part of the gain that is the cache and the engine, not the BLAS;
- ``mlx_lm_prompt_cache``: mlx-lm's ``LRUPromptCache`` driven the way ``mlx_lm.server`` does,
  with its checkpoints at the end of the system prompt, at the prompt end before the think
  tail, and at the end of generation; in this process, on the fast BLAS;
- ``chatml_lookup``, ``chatml_mtp`` (only when asked for with ``--engines``: each loads the
  model once more): the ``chatml`` session on an engine loaded with ``speculative="lookup"``
  or ``"mtp"`` (``--num-draft``, adaptive k). Their answers must be the plain session's token
  for token (greedy), which each row checks (``same_tokens``); the rows add the drafted and
  accepted tokens. With random weights the real acceptance is what drafting against noise
  gets: these rows measure what the drafters cost and save on a real chat's prompts, not the
  speed-up of trained weights.

Every engine sees the same prompt ids per turn: this engine renders each prompt (its history
is what it generated) and mlx-lm is fed ``Turn.prompt_ids``. Decoding is greedy with the
special tokens masked, so every engine decodes exactly ``--max-tokens`` tokens. The engines
run one after the other within each turn, so a noisy machine hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from statistics import median

from bench import mlx_lm_series
from bench.common import (
    conditions,
    load_mlx_lm,
    model_path,
    save_plot,
    special_ids,
    write_json,
)
from bench.conversation import SYSTEM, user_turns

ENGINES = (
    "chatml", "chatml_warm", "mlx_lm_stock", "mlx_lm_stock_fast_blas", "mlx_lm_prompt_cache",
    "chatml_lookup", "chatml_mtp",
)  # fmt: skip
# series -> engine.load(speculative=...)
SPECULATIVE = {"chatml_lookup": "lookup", "chatml_mtp": "mtp"}
DEFAULT_ENGINES = tuple(e for e in ENGINES if e not in SPECULATIVE)
LABELS = {
    "chatml": "chatml",
    "chatml_warm": "chatml (warm)",
    "mlx_lm_stock": "mlx-lm stock",
    "mlx_lm_stock_fast_blas": "stock + fast BLAS",
    "mlx_lm_prompt_cache": "mlx-lm prompt cache",
    "chatml_lookup": "chatml + lookup drafts",
    "chatml_mtp": "chatml + MTP drafts",
}
BASELINES = ("mlx_lm_stock", "mlx_lm_stock_fast_blas", "mlx_lm_prompt_cache")


# ----- fixed-length greedy decoding ----------------------------------------------------------


@contextlib.contextmanager
def masked_sampling(banned: list[int]) -> Iterator[None]:
    """Make the engine's sessions sample with `banned` ids at -inf (no EOS, no special tokens).

    The Session API has no logits processor, so the benchmark swaps the Sampler class the
    session module builds its samplers from, for the duration of the run; the ban is a link of
    the sampler's chain, so a speculative verify step applies it at every position too.
    """
    import mlx.core as mx

    import engine.session as session_module
    from engine.runtime.sampling import LogitsProcessor, processors_for

    original = session_module.Sampler
    bias = None

    class Ban(LogitsProcessor):
        def __call__(self, logits, history):
            nonlocal bias
            if bias is None or bias.shape != logits.shape[-1:]:
                bias = mx.zeros(logits.shape[-1:], dtype=mx.float32)
                bias[mx.array(banned)] = -mx.inf
            return logits + bias

    class MaskedSampler(original):
        def __init__(self, params, processors=None, **kw):
            chain = processors_for(params) if processors is None else processors
            super().__init__(params, [Ban(), *chain], **kw)

    session_module.Sampler = MaskedSampler
    try:
        yield
    finally:
        session_module.Sampler = original


# ----- the run -------------------------------------------------------------------------------


def template_minimum(prompt, prev_dropped: int | None) -> tuple[int, bool]:
    """(the fewest tokens any cache can avoid recomputing, whether this turn trims).

    The template re-renders the previous answer, so everything from right after its
    `<|im_start|>assistant\\n` on is new; a turn that drops an exchange from the window changes
    everything after the system block.
    """
    b = prompt.boundaries
    if prev_dropped is None or not b.assistant_starts:
        return len(prompt.ids), False
    if prompt.dropped > prev_dropped:
        return len(prompt.ids) - b.system_end, True
    return len(prompt.ids) - b.assistant_starts[-1], False


def _chatml_row(turn) -> dict:
    s = turn.stats
    return {
        "reused_tokens": s.reused_tokens,
        "prefilled_tokens": s.prefilled_tokens,
        "ttft_s": s.ttft_s,
        "decode_tps": s.decode_tps,
        "generated_tokens": s.generated_tokens,
        "cache_bytes": s.cache_bytes,
    }


def run(
    model: str = "tiny",
    *,
    turns: int = 20,
    thinking: bool = False,
    max_tokens: int = 32,
    engines: tuple[str, ...] = DEFAULT_ENGINES,
    models_dir: str | None = None,
    progress: bool = True,
    num_draft: int = 4,
) -> dict:
    """Play the conversation; returns {"conditions", "turns", "engines": {name: [rows]}}."""
    import engine as chatml
    from kernels import blas

    path = model_path(model, models_dir)
    eng = chatml.load(path)
    banned = special_ids(eng.entry.arch.vocab_size)
    notes = []
    if "mlx_lm_stock_fast_blas" in engines and not blas.info().fast:
        engines = tuple(e for e in engines if e != "mlx_lm_stock_fast_blas")
        notes.append(f"no fast BLAS here ({blas.info().reason}): mlx_lm_stock_fast_blas "
                     "would repeat mlx_lm_stock, so it was not run")  # fmt: skip
    lm_model = lm_tok = None
    if {"mlx_lm_stock_fast_blas", "mlx_lm_prompt_cache"} & set(engines):
        lm_model, lm_tok = load_mlx_lm(path)
    processor = mlx_lm_series.mask(banned)
    installed = None
    if "mlx_lm_stock" in engines:
        installed = mlx_lm_series.InstalledStock(path, banned)

    session = eng.session(SYSTEM, max_exchanges=6, enable_thinking=thinking)
    warm_session = None
    if "chatml_warm" in engines:
        if hasattr(session, "warm"):
            warm_session = eng.session(SYSTEM, max_exchanges=6, enable_thinking=thinking)
        else:
            notes.append("Session.warm() does not exist in this engine: no chatml_warm series")
    pcache = None
    if "mlx_lm_prompt_cache" in engines:
        pcache = mlx_lm_series.PromptCache(lm_model, lm_tok)
    drafting = {  # series -> its session, on an engine of its own
        name: chatml.load(path, speculative=SPECULATIVE[name], num_draft=num_draft).session(
            SYSTEM, max_exchanges=6, enable_thinking=thinking)
        for name in SPECULATIVE if name in engines
    }  # fmt: skip

    _warm_up(eng, lm_model, lm_tok, processor)
    results: dict[str, list[dict]] = {e: [] for e in engines if e != "chatml_warm"}
    if warm_session is not None:
        results["chatml_warm"] = []
    results.update({name: [] for name in drafting})
    per_turn: list[dict] = []
    prev_dropped = None
    messages = user_turns(turns)
    bar = _bar(len(messages), progress)
    t_run = time.perf_counter()
    with masked_sampling(banned), contextlib.ExitStack() as stack:
        if installed is not None:
            stack.callback(installed.close)
        for i, text in enumerate(messages, 1):
            current = [{"role": "user", "content": text}]
            prompt = session.render(current, max_tokens)  # the prompt send() is about to build
            minimum, trims = template_minimum(prompt, prev_dropped)
            prev_dropped = prompt.dropped
            turn = session.send(text, max_tokens=max_tokens)
            if turn.prompt_ids != prompt.ids:
                raise RuntimeError(f"turn {i}: the session rendered a different prompt")
            ids = turn.prompt_ids
            info = {
                "turn": i,
                "prompt_tokens": len(ids),
                "min_prefill_tokens": minimum,
                "trims_window": trims,
                "dropped_exchanges": prompt.dropped,
                "user_chars": len(text),
            }
            per_turn.append(info)
            results["chatml"].append(
                {**info, **_chatml_row(turn), "met_minimum": turn.stats.prefilled_tokens <= minimum}
            )
            if warm_session is not None:
                results["chatml_warm"].append(_warm_turn(warm_session, text, max_tokens, ids, info))
            if installed is not None:
                results["mlx_lm_stock"].append({**info, **installed.turn(ids, max_tokens)})
            if "mlx_lm_stock_fast_blas" in results:
                row = mlx_lm_series.stock_turn(lm_model, lm_tok, ids, max_tokens, processor)
                results["mlx_lm_stock_fast_blas"].append({**info, **row})
            if pcache is not None:
                row = pcache.turn(ids, prompt.boundaries.system_end, max_tokens, processor)
                results["mlx_lm_prompt_cache"].append({**info, **row})
            for name, spec_session in drafting.items():
                results[name].append(_drafting_turn(spec_session, text, max_tokens, turn, info))
            if warm_session is not None:  # idle time after the answer, before the next message
                _warm(warm_session, results["chatml_warm"][-1], last=i == len(messages))
            bar.update(1)
            bar.set_postfix_str(f"prompt {len(ids)} tok")
    bar.close()
    # Each warm row also states the idle-time work done before it (the previous turn's warm()).
    warm_rows = results.get("chatml_warm", [])
    for prev, row in zip([None, *warm_rows], warm_rows, strict=False):
        row["warm_s"] = prev.get("warm_s_after", 0.0) if prev else 0.0
        row["warm_prefilled_tokens"] = prev.get("warm_prefilled_after", 0) if prev else 0
    cond = conditions(
        model=model,
        checkpoint=str(path),
        dtype_chatml=str(eng.dtype),
        dtype_mlx_lm="float32" if lm_model is not None or installed is not None else None,
        turns=turns,
        thinking=thinking,
        max_tokens=max_tokens,
        max_exchanges=6,
        num_draft=num_draft if drafting else None,
        decoding="greedy, special tokens masked: every engine decodes exactly max_tokens",
        prefill_step_mlx_lm=mlx_lm_series.PREFILL_STEP,
        mlx_lm_blas={
            "mlx_lm_stock": "own interpreter, CHATML_BLAS=0, engine never imported: mlx's own",
            "mlx_lm_stock_fast_blas": "this process: the engine's fast BLAS",
            "mlx_lm_prompt_cache": "this process: the engine's fast BLAS",
        },
        mlx_lm_stock_worker=installed.hello if installed else None,
        wall_s=round(time.perf_counter() - t_run, 1),
        notes=notes,
    )
    return {"conditions": cond, "turns": per_turn, "engines": results}


def _warm_up(eng, lm_model, lm_tok, processor) -> None:
    """One short throwaway generation per engine: first-call setup stays out of turn 1."""
    from engine.runtime.generate import decode, prefill
    from engine.runtime.sampling import Sampler, SamplingParams

    ids = eng.tokenizer.encode("warm-up: " + SYSTEM)
    caches = eng.model.make_caches()
    logits, _ = prefill(eng.model, caches, ids, 0)
    for _ in decode(eng.model, caches, logits, Sampler(SamplingParams()), max_tokens=2,
                    stop_ids=(), history=list(ids)):  # fmt: skip
        pass
    if lm_model is not None:
        mlx_lm_series.stock_turn(lm_model, lm_tok, ids, 2, processor)


def _warm_turn(session, text: str, max_tokens: int, ids: list[int], info: dict) -> dict:
    turn = session.send(text, max_tokens=max_tokens)
    row = {**info, **_chatml_row(turn)}
    row["same_prompt"] = turn.prompt_ids == ids
    row["warm_tokens_stat"] = getattr(turn.stats, "warm_tokens", 0)
    row["met_minimum"] = turn.stats.prefilled_tokens <= info["min_prefill_tokens"]
    return row


def _drafting_turn(session, text: str, max_tokens: int, plain, info: dict) -> dict:
    """One turn of a speculative series, checked against the plain session's answer."""
    turn = session.send(text, max_tokens=max_tokens)
    s = turn.stats
    return {
        **info, **_chatml_row(turn),
        "same_tokens": turn.token_ids == plain.token_ids and turn.prompt_ids == plain.prompt_ids,
        "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
        "tokens_per_verify": s.tokens_per_verify,
    }  # fmt: skip


def _warm(session, row: dict, last: bool) -> None:
    """Idle-time prefill for the next turn, timed on its own (not part of any TTFT)."""
    if last:
        return
    t = time.perf_counter()
    n = session.warm()
    row["warm_s_after"] = time.perf_counter() - t
    row["warm_prefilled_after"] = int(n or 0)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="replay", unit="turn", disable=not enabled, file=sys.stderr)


# ----- reporting -----------------------------------------------------------------------------


def slower_turns(rows: list[dict], base_rows: list[dict], key: str, higher_is_better: bool):
    """The turns on which `rows` did worse than `base_rows` on `key`."""
    base = {r["turn"]: r[key] for r in base_rows}
    return [r["turn"] for r in rows if r["turn"] in base
            and (r[key] < base[r["turn"]] if higher_is_better else r[key] > base[r["turn"]])]  # fmt: skip


def summary(result: dict) -> dict:
    """The targets: TTFT ratios from turn 3 on, minimum prefill, decode speed; medians are
    true medians (the mean of the middle two for an even count), and the turns where an engine
    was slower than a baseline are listed beside every ratio."""
    e = result["engines"]
    out: dict = {}
    chat = e.get("chatml", [])
    out["chatml_met_minimum_all_turns"] = all(r["met_minimum"] for r in chat)
    out["chatml_excess_prefill_tokens"] = sum(
        max(0, r["prefilled_tokens"] - r["min_prefill_tokens"]) for r in chat
    )
    for name in ("chatml", "chatml_warm"):
        rows = [r for r in e.get(name, []) if r["turn"] >= 3]
        if not rows:
            continue
        for base in BASELINES:
            brow = {r["turn"]: r for r in e.get(base, [])}
            pairs = [(r["turn"], brow[r["turn"]]["ttft_s"] / r["ttft_s"]) for r in rows
                     if r["turn"] in brow]  # fmt: skip
            if pairs:
                ratios = [q for _, q in pairs]
                out[f"{name}_vs_{base}_ttft_ratio_min"] = min(ratios)
                out[f"{name}_vs_{base}_ttft_ratio_median"] = median(ratios)
                out[f"{name}_under_5x_vs_{base}_turns"] = [t for t, q in pairs if q < 5.0]
                out[f"{name}_slower_than_{base}_turns"] = [t for t, q in pairs if q < 1.0]
    for name in e:
        tps = [r["decode_tps"] for r in e[name] if r["decode_tps"] > 0]
        ttft = [r["ttft_s"] for r in e[name] if r["turn"] >= 3]
        out[f"{name}_decode_tps_median"] = median(tps) if tps else 0.0
        out[f"{name}_ttft_s_sum_from_turn3"] = sum(ttft)
    for name in SPECULATIVE:
        rows = e.get(name, [])
        if rows:
            drafted = sum(r["drafted_tokens"] for r in rows)
            out[f"{name}_same_tokens_all_turns"] = all(r["same_tokens"] for r in rows)
            out[f"{name}_acceptance_rate"] = (
                sum(r["accepted_tokens"] for r in rows) / drafted if drafted else 0.0
            )
            if out.get("chatml_decode_tps_median"):
                out[f"{name}_decode_vs_chatml"] = (
                    out[f"{name}_decode_tps_median"] / out["chatml_decode_tps_median"]
                )
    for base in BASELINES:
        if out.get(f"{base}_decode_tps_median") and "chatml" in e:
            out[f"chatml_decode_vs_{base}"] = (
                out["chatml_decode_tps_median"] / out[f"{base}_decode_tps_median"]
            )
            out[f"chatml_decode_slower_than_{base}_turns"] = slower_turns(
                e["chatml"], e[base], "decode_tps", higher_is_better=True
            )
    return out


def print_table(result: dict) -> None:
    e = result["engines"]
    names = [n for n in ENGINES if n in e]
    head = f"{'turn':>4} {'prompt':>6} {'min':>5} {'trim':>4} "
    head += " ".join(f"{LABELS[n][:19]:>19}" for n in names)
    print("prefilled tokens / time to first token (s) per engine")
    print(head)
    for k, info in enumerate(result["turns"]):
        cells = []
        for n in names:
            r = e[n][k]
            cells.append(f"{r['prefilled_tokens']:>7d} {r['ttft_s']:>8.3f}s   ")
        trim = "yes" if info["trims_window"] else ""
        print(
            f"{info['turn']:>4} {info['prompt_tokens']:>6} {info['min_prefill_tokens']:>5} "
            f"{trim:>4} " + " ".join(f"{c:>19}" for c in cells)
        )
    print("decode tokens/s (median): " + ", ".join(
        f"{LABELS[n]} {median(r['decode_tps'] for r in e[n]):.2f}" for n in names
    ))  # fmt: skip
    for base in BASELINES:
        if "chatml" in e and base in e:
            ttft = slower_turns(e["chatml"], e[base], "ttft_s", higher_is_better=False)
            tps = slower_turns(e["chatml"], e[base], "decode_tps", higher_is_better=True)
            print(f"chatml slower than {LABELS[base]} on turns: first token "
                  f"{', '.join(map(str, ttft)) or 'none'}; decode "
                  f"{', '.join(map(str, tps)) or 'none'}")  # fmt: skip
    if "chatml_warm" in e:
        warm = [r.get("warm_s_after", 0.0) for r in e["chatml_warm"]]
        print(f"chatml (warm): warm() took {sum(warm):.2f} s in all, max {max(warm):.2f} s")


def plot(result: dict, file: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = result["engines"]
    turns = [t["turn"] for t in result["turns"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name in ENGINES:
        if name not in e:
            continue
        ax1.plot(turns, [r["ttft_s"] for r in e[name]], marker="o", ms=3, label=LABELS[name])
        ax2.plot(turns, [r["prefilled_tokens"] for r in e[name]], marker="o", ms=3,
                 label=LABELS[name])  # fmt: skip
    ax2.plot(turns, [t["min_prefill_tokens"] for t in result["turns"]], "k--", lw=1,
             label="template minimum")  # fmt: skip
    c = result["conditions"]
    ax1.set_yscale("log")
    ax1.set_ylabel("time to first token (s)")
    ax1.set_title(
        f"replay: {c['model']}, {c['max_tokens']} decode tokens/turn, thinking "
        f"{'on' if c['thinking'] else 'off'} ({c['cpu'][:40]}, {c['cores']} cores)",
        fontsize=9,
    )
    ax2.set_yscale("log")
    ax2.set_ylabel("prefilled tokens")
    ax2.set_xlabel("turn")
    ax2.set_xticks(turns)
    save_plot(fig, (ax1, ax2), file)


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--thinking", choices=["on", "off"], default="off")
    ap.add_argument("--max-tokens", type=int, default=32, help="decode tokens per turn (fixed)")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help=f"comma-separated, from {', '.join(ENGINES)}")  # fmt: skip
    ap.add_argument("--num-draft", type=int, default=4, help="k of the drafting series")
    ap.add_argument("--models-dir", help="where big checkpoints are built and cached")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG plot here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args()
    engines = tuple(x for x in a.engines.split(",") if x)
    unknown = set(engines) - set(ENGINES)
    if unknown or "chatml" not in engines:
        ap.error(f"--engines: choose from {', '.join(ENGINES)} (chatml is required)")
    result = run(
        a.model, turns=a.turns, thinking=a.thinking == "on", max_tokens=a.max_tokens,
        engines=engines, models_dir=a.models_dir, progress=not a.no_progress,
        num_draft=a.num_draft,
    )  # fmt: skip
    result["summary"] = summary(result)
    print_table(result)
    for note in result["conditions"]["notes"]:
        print(f"note: {note}")
    print(json.dumps(result["summary"], indent=1))
    write_json(a.json, result)
    if a.plot:
        plot(result, a.plot)


if __name__ == "__main__":
    main()
