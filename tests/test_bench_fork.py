"""Smoke test of `python -m bench.fork` on tiny: with fork snapshots the third request resumes
at the fork, without them it reuses only the system block, and the answers are the same."""

from bench import fork


def test_fork_bench_reuses_the_document_only_with_fork_snapshots(tmp_path):
    out = tmp_path / "fork.json"
    result = fork.main(["--model", "tiny", "--clauses", "12", "--questions", "3", "--repeats",
                        "1", "--max-tokens", "3", "--json", str(out)])  # fmt: skip
    assert out.exists() and result["answers_equal"]
    off, on = result["rounds"]
    assert not off["fork_snapshots"] and on["fork_snapshots"]
    system_block = off["reused_tokens"][1]
    assert off["reused_tokens"][2] == system_block > 0
    assert on["reused_tokens"][:2] == [0, system_block]
    assert on["reused_tokens"][2] > system_block + 64  # the whole shared document
