"""Smoke test of the sampling benchmark: on a small vocabulary every configuration timed on
each path, and the JSON line printed; whole decode steps on tiny, greedy and sampled."""

from __future__ import annotations

import json
import sys

from bench import sampling


def test_every_cut_is_timed_for_both_and_reported(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["chatml bench sampling", "--vocab", "1000", "--repeats", "2",
                                      "--rows", "3"])  # fmt: skip
    sampling.main()
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["bench"] == "sampling" and r["vocab"] == 1000
    assert r["sampling"]["greedy_argmax_ms"] > 0
    assert set(r["sampling"]) == {"greedy_argmax_ms", "logprobs top 5", "rows", *sampling.CUTS,
                                  *sampling.CALLS}  # fmt: skip
    rows = r["sampling"]["rows"]
    assert rows["rows"] == 3 and all(v > 0 for k, v in rows.items() if k.endswith("_ms"))
    assert all(r["sampling"][name]["chatml_ms"] > 0 for name in sampling.CALLS)
    assert all(r["sampling"]["logprobs top 5"][k] > 0 for k in ("chatml_ms", "mlx_ops_ms"))
    for name in sampling.CUTS:
        assert all(r["sampling"][name][k] > 0 for k in ("chatml_ms", "mlx_ops_ms", "mlx_lm_ms"))


def test_decode_steps_greedy_and_sampled_are_timed(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["chatml bench sampling", "--model", "tiny", "--tokens", "4",
                                      "--repeats", "1"])  # fmt: skip
    sampling.main()
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode"]
    assert r["greedy_ms"] > 0 and r["sampled_ms"] > 0 and r["sampling"]["temperature"] > 0
    assert len(r["runs_ms"]["greedy"]) == len(r["runs_ms"]["sampled"]) == 1
