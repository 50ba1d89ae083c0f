"""Smoke test of the throughput benchmark on tiny: one interpreter per configuration, JSON shape."""

from __future__ import annotations

import json
import sys

from bench import throughput
from bench.report import report
from kernels import blas


def test_throughput_runs_each_configuration_and_reports(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["chatml bench throughput", "--model", "tiny", "--ts", "16,32", "--decode", "4",
            "--configs", "chatml,chatml_q4,mlx_lm_stock", "--stock-ts", "16", "--stock-decode", "4",
            "--json", str(out)]  # fmt: skip
    saved, sys.argv = sys.argv, argv
    try:
        throughput.main()
    finally:
        sys.argv = saved
    result = json.loads(out.read_text())
    chatml, stock = result["results"]["chatml"], result["results"]["mlx_lm_stock"]
    assert set(chatml["prefill"]) == {"16", "32"} and set(stock["prefill"]) == {"16"}
    for r in (chatml, stock):
        assert r["decode"]["tokens"] == 4  # no stop tokens: the full count
        assert all(p["tokens_per_s"] > 0 for p in r["prefill"].values())
        assert r["peak_memory_bytes"] > 0
    q4 = result["results"]["chatml_q4"]  # quantize=4 at load: the quantized decode path
    assert set(q4["prefill"]) == {"16", "32"} and q4["decode"]["tokens"] == 4
    assert (chatml["blas"] != "reference") == blas.info().fast  # as in this process
    assert chatml["blas_core"] == blas.core()  # OpenBLAS's kernel set, recorded
    assert stock["blas"] == "reference"  # mlx-lm as installed: CHATML_BLAS=0, no engine import
    table = report(result)
    assert "| chatml | " in table and "| mlx_lm_stock | " in table
    assert "prefill 16 tok/s" in table and "prefill 32 tok/s" in table
