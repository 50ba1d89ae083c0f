"""bench/gpu_check.py in --quick mode on this CPU: one JSON line, every section, small errors."""

import json

from bench.gpu_check import main


def test_quick_gpu_check_runs_every_section_with_small_errors(capsys, tmp_path):
    main(["--quick", "--out", str(tmp_path / "check.json")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert json.loads((tmp_path / "check.json").read_text()) == r  # the last section's write
    assert r["errors"] == {}
    assert r["device"]["kind"] == "cpu" and r["device"]["mlx"]
    assert r["device"]["tf32"] == "0"  # engine keeps float32 matmuls in float32 (CUDA's TF32)
    assert {(row["model"], row["T"]) for row in r["kernels"]} == {
        (m, t) for m in ("tiny", "0.8b") for t in (1, 7, 64)
    }
    for row in r["kernels"]:
        methods = ("sequential", "chunked", "step")  # bfloat16 in and out, float32 state
        for method in methods:
            k = row[method]
            assert k["dtypes"] == ["bfloat16", "float32"]
            assert k["err_y"] < 1e-2 and k["err_state"] < 1e-5 and k["ms"] > 0
        assert row["choice"] in methods
    b = r["bf16_vs_mlx_lm"]
    assert b["max_diff"] <= 0.05 and b["clear_positions"] > 0 and b["clear_disagree"] == 0
    assert r["moe_bf16_vs_mlx_lm"] == "cpu: n/a"
    qz = r["quantized_vs_mlx_lm"]
    assert qz["kept_quantized"] and qz["max_diff"] < 1e-4 and qz["argmax_agree"] == 1.0
    assert r["threads"]["failures"] == 0 and r["threads"]["threads"] == 30
    m = r["memory"]
    assert m["snapshots"] >= 10 and m["held_bytes"] <= 1.05 * m["counted_bytes"]
    picks = r["picks"]
    assert picks["rows"] == 8 and all(v > 0 for k, v in picks.items() if k.endswith("_ms"))
    s = r["speed"]
    for key in ("engine_prefill_tps", "engine_first_decode_step_s", "engine_decode_tps",
                "mlx_lm_prefill_tps", "mlx_lm_decode_tps"):  # fmt: skip
        assert s[key] > 0


def test_the_tests_section_counts_passes_and_names_failures(tmp_path, monkeypatch):
    """The GPU-only section, run here on two small files: one passing, one planted failure."""
    import bench.gpu_check as gc

    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    (tests / "test_bad.py").write_text(
        "def test_bad():\n    assert 0.5 < 1e-4, 'too far'\n\ndef test_fused_skipped():\n    pass\n"
    )
    monkeypatch.setattr(gc, "__file__", str(tmp_path / "bench" / "gpu_check.py"))
    r = gc.tests_section(("test_ok.py", "test_bad.py"), workers=0, timeout=300)
    assert r["passed"] == 1 and r["failed"] == 1, r  # test_fused_* is deselected as CPU-only
    assert r["failures"][0].startswith("test_bad::test_bad: AssertionError: too far")
