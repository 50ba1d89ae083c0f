"""Smoke test of `python -m bench.stall` on tiny: each budget bounds its passes, the decoders
stream on while the arrivals are served, and every arrival (the late one too) gets its first
token."""

from bench import stall


def test_stall_bench_reports_each_budget_within_its_bound(tmp_path):
    out = tmp_path / "stall.json"
    result = stall.main(["--model", "tiny", "--pass-tokens", "24,96", "--prompt-tokens", "120",
                         "--max-tokens", "48", "--late-tokens", "30", "--json", str(out)])  # fmt: skip
    assert out.exists() and [r["pass_tokens"] for r in result["runs"]] == [24, 96]
    for run in result["runs"]:
        assert run["prompt_tokens"] > 96  # every budget had to cut the prompts
        # a pass holds the budget, or the decode rows and the first chunk's MIN_CUT tokens
        assert run["longest_pass"] <= max(run["pass_tokens"], 24) + 2 + 4
        assert all(t is not None and t > 0 for t in run["ttft_s"])
        assert run["passes"] > 0 and run["gaps"] > 0
        assert run["late_ttft_s"] is not None and run["late_ttft_s"] > 0
