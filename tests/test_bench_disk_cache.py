"""Smoke test of the disk-tier benchmark on tiny: it runs, its checks hold, the JSON is whole."""

from __future__ import annotations

import json

from bench import disk_cache


def test_disk_cache_bench_on_tiny(tiny, tmp_path):
    out = tmp_path / "d.json"
    # The smallest run that still checks both parts: one restart row past the read threshold
    # (32 tokens), two replay turns (the second one resumes from the disk tier); on the
    # session's `tiny` (loading another one is most of the run), which it leaves as it was.
    argv = ["--model", "tiny", "--lengths", "40", "--turns", "2", "--budget-mib", "0",
            "--max-tokens", "1", "--json", str(out)]  # fmt: skip
    budget = tiny.budget.max_bytes
    disk_cache.main(argv, eng=tiny)  # asserts restored answers equal computed ones, both parts
    assert tiny.disk is None and tiny.budget.max_bytes == budget
    result = json.loads(out.read_text())
    (row,) = result["restart"]
    assert row["same_answer"] and row["prompt_tokens"] >= 40
    assert row["reused_tokens"] == row["entry_tokens"] >= 40  # the system prompt, from disk
    ram, disk = result["evictions"]["ram_only"], result["evictions"]["disk"]
    assert all(r["reused_tokens"] == 0 for r in ram)  # a zero budget keeps nothing in RAM
    assert disk[1]["reused_tokens"] > 0  # the second turn resumes from the disk tier
    # from its file, or from its copy in RAM if the writer had not written it yet
    assert disk[-1]["disk"]["reads"] + disk[-1]["disk"]["memory_reads"] >= 1
    assert result["summary"]["turns"] == 2
