"""Smoke test of the disk-tier benchmark on tiny: it runs, its checks hold, the JSON is whole."""

from __future__ import annotations

import json
import sys

from bench import disk_cache


def test_disk_cache_bench_on_tiny(tmp_path):
    out = tmp_path / "d.json"
    argv = ["chatml bench disk_cache", "--model", "tiny", "--lengths", "96", "--turns", "3",
            "--budget-mib", "0", "--max-tokens", "2", "--json", str(out)]  # fmt: skip
    saved, sys.argv = sys.argv, argv
    try:
        disk_cache.main()  # asserts restored answers equal computed ones, in both parts
    finally:
        sys.argv = saved
    result = json.loads(out.read_text())
    (row,) = result["restart"]
    assert row["same_answer"] and row["prompt_tokens"] >= 96
    assert row["reused_tokens"] == row["entry_tokens"] >= 96  # the system prompt, from disk
    ram, disk = result["evictions"]["ram_only"], result["evictions"]["disk"]
    assert all(r["reused_tokens"] == 0 for r in ram)  # a zero budget keeps nothing in RAM
    assert all(r["reused_tokens"] > 0 for r in disk[1:3])  # every later turn reads from disk
    assert disk[-1]["disk"]["reads"] >= 2 and result["summary"]["turns"] == 3
