"""Smoke test of `chatml bench gates` on tiny: both models prefill, ratios and JSON."""

import json

from bench import gates


def test_gates_bench_compares_native_and_mlx_ops(tmp_path, monkeypatch):
    out = tmp_path / "g.json"
    argv = ["chatml bench gates", "--model", "tiny", "--ts", "40", "--repeats", "1",
            "--json", str(out)]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    gates.main()
    row = json.loads(out.read_text())["results"]["40"]
    for side in ("native", "mlx_ops"):
        assert row[side]["wall_s"] > 0 and row[side]["cpu_s"] > 0
    assert row["cpu_ratio"] == row["mlx_ops"]["cpu_s"] / row["native"]["cpu_s"]
