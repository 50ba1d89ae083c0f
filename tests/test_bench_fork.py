"""Smoke test of `python -m bench.fork` on tiny: without fork or grid snapshots the requests
reuse only the system block; with fork snapshots the third resumes at the fork; with the grid
too the second already resumes on the grid. The answers are the same in every mode."""

from bench import fork
from engine.runtime.pool import GRID


def test_fork_bench_reuses_the_document_as_each_mode_allows(tmp_path):
    out = tmp_path / "fork.json"
    result = fork.main(["--model", "tiny", "--clauses", "12", "--questions", "3", "--repeats",
                        "1", "--max-tokens", "3", "--json", str(out)])  # fmt: skip
    assert out.exists() and result["answers_equal"]
    off, at_fork, grid = result["rounds"]
    assert [r["mode"] for r in result["rounds"]] == ["off", "fork", "grid"]
    system_block = off["reused_tokens"][1]
    assert off["reused_tokens"][2] == system_block > 0
    assert at_fork["reused_tokens"][:2] == [0, system_block]
    document = at_fork["reused_tokens"][2]  # the whole shared document
    assert document > system_block + GRID
    assert grid["reused_tokens"] == [0, system_block + GRID, document]
