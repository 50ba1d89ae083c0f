"""Smoke test of the replay benchmark on tiny: JSON shape and minimum prefill."""

from __future__ import annotations

import json
import sys

import pytest

from bench import replay

ROW_KEYS = {"turn", "prompt_tokens", "reused_tokens", "prefilled_tokens", "ttft_s", "decode_tps",
            "cache_bytes", "min_prefill_tokens"}  # fmt: skip


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    argv = ["chatml bench replay", "--model", "tiny", "--turns", "3", "--max-tokens", "2",
            "--json", str(out / "r.json"), "--plot", str(out / "r.png"), "--no-progress"]  # fmt: skip
    saved, sys.argv = sys.argv, argv
    try:
        replay.main()
    finally:
        sys.argv = saved
    assert (out / "r.png").stat().st_size > 0
    return json.loads((out / "r.json").read_text())


def test_structure(result):
    engines = result["engines"]
    for name in ("chatml", "mlx_lm_stock", "mlx_lm_stock_fast_blas", "mlx_lm_prompt_cache"):
        rows = engines[name]
        assert [r["turn"] for r in rows] == [1, 2, 3]
        for r in rows:
            assert ROW_KEYS <= set(r)
            assert r["reused_tokens"] + r["prefilled_tokens"] == r["prompt_tokens"]
            assert r["generated_tokens"] == 2  # fixed decode length: stop tokens are masked
    for key in ("mlx", "mlx_lm", "cpu", "cores", "blas", "max_tokens"):
        assert key in result["conditions"]
    # every engine saw the same prompt per turn
    prompts = {n: [r["prompt_tokens"] for r in rows] for n, rows in engines.items()}
    assert len({tuple(p) for p in prompts.values()}) == 1


def test_stock_is_mlx_lm_as_installed(result):
    """The stock series ran in an interpreter without the engine and its fast BLAS."""
    worker = result["conditions"]["mlx_lm_stock_worker"]
    assert worker["engine_imported"] is False
    if worker["blas_libraries"] is None:
        pytest.skip("no /proc/self/maps on this OS: cannot list the mapped BLAS libraries")
    assert not [p for p in worker["blas_libraries"] if "scipy_openblas32" in p]


def test_chatml_prefills_the_minimum(result):
    for r in result["engines"]["chatml"]:
        assert r["prefilled_tokens"] == r["min_prefill_tokens"], r
        assert r["met_minimum"]
    stock = result["engines"]["mlx_lm_stock"]
    assert all(r["prefilled_tokens"] == r["prompt_tokens"] for r in stock)


def test_warm_series_if_available(result):
    rows = result["engines"].get("chatml_warm")
    if rows is None:
        pytest.skip("Session.warm() not in this engine")
    assert all(r["same_prompt"] for r in rows)
    assert all(r["met_minimum"] for r in rows)


def test_report_renders_every_turn_and_engine(result):
    from bench.report import report

    text = report(result)
    for label in ("chatml", "mlx-lm stock", "stock + fast BLAS", "mlx-lm prompt cache"):
        assert f"| {label} |" in text
    per_turn = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |", "| 3 |"))]
    assert len(per_turn) == 3
    with pytest.raises(ValueError, match="not a replay or throughput"):
        report({"something": "else"})


def _synthetic(ttft: dict, tps: dict) -> dict:
    """A replay result with the given TTFTs and decode speeds per engine and turn."""
    n = len(next(iter(ttft.values())))
    rows = {name: [{"turn": k + 1, "ttft_s": ttft[name][k], "decode_tps": tps[name][k],
                    "prefilled_tokens": 5, "min_prefill_tokens": 5, "met_minimum": True,
                    "cache_bytes": 0} for k in range(n)] for name in ttft}  # fmt: skip
    turns = [{"turn": k + 1, "prompt_tokens": 9, "min_prefill_tokens": 5, "trims_window": False}
             for k in range(n)]  # fmt: skip
    return {"engines": rows, "turns": turns}


def test_medians_are_true_medians_and_slower_turns_are_named(capsys):
    from bench.report import report

    result = _synthetic(
        ttft={"chatml": [1.0, 1.0, 1.0, 3.0], "mlx_lm_stock": [1.0, 1.0, 2.0, 2.0]},
        tps={"chatml": [1.0, 4.0, 6.0, 8.0], "mlx_lm_stock": [2.0, 5.0, 5.0, 5.0]},
    )
    s = replay.summary(result)
    # turns 3 and 4: ratios 2 and 2/3; the median of an even count is the mean of the middle two
    assert s["chatml_vs_mlx_lm_stock_ttft_ratio_median"] == pytest.approx((2 + 2 / 3) / 2)
    assert s["chatml_decode_tps_median"] == 5.0 and s["mlx_lm_stock_decode_tps_median"] == 5.0
    assert s["chatml_slower_than_mlx_lm_stock_turns"] == [4]
    assert s["chatml_decode_slower_than_mlx_lm_stock_turns"] == [1, 2]
    assert "| chatml | mlx-lm stock | 0.7x | 1.3x | 3, 4 | 4 | 1, 2 |" in report(result)
    replay.print_table(result)
    out = capsys.readouterr().out
    assert "chatml 5.00, mlx-lm stock 5.00" in out
    assert "chatml slower than mlx-lm stock on turns: first token 4; decode 1, 2" in out


def test_drafting_series_decode_what_plain_decoding_does():
    """The lookup and MTP series replay the same chat with every token equal to the plain
    session's (greedy), the ban on special tokens applying inside verify steps too."""
    result = replay.run("tiny", turns=2, max_tokens=6, progress=False,
                        engines=("chatml", "chatml_lookup", "chatml_mtp"))  # fmt: skip
    for name in ("chatml_lookup", "chatml_mtp"):
        rows = result["engines"][name]
        assert [r["turn"] for r in rows] == [1, 2]
        assert all(r["same_tokens"] and r["generated_tokens"] == 6 for r in rows)
        assert all(r["accepted_tokens"] <= r["drafted_tokens"] for r in rows)
    summary = replay.summary(result)
    assert (
        summary["chatml_lookup_same_tokens_all_turns"]
        and summary["chatml_mtp_same_tokens_all_turns"]
    )
    assert result["conditions"]["num_draft"] == 4
