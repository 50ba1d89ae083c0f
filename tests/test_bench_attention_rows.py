"""Smoke test of `chatml bench attention_rows`: both ways timed on small caches, and their
outputs agree (the bench's max_diff is measured, not assumed)."""

from bench import attention_rows


def test_attention_rows_bench_times_both_ways_and_they_agree(mod):
    out = attention_rows.run([1, 3], [40], [1, 2], repeats=1)
    assert [(c["batch"], c["queries"]) for c in out["cases"]] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    for case in out["cases"]:
        assert case["ms"]["rows"] > 0 and case["ms"]["per_row"] > 0
        assert 0 <= case["max_diff"] <= 1e-5
        assert case["speedup"] > 0
