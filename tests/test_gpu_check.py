"""bench/gpu_check.py in --quick mode on this CPU: one JSON line, every section, small errors."""

import json

from bench.gpu_check import main


def test_quick_gpu_check_runs_every_section_with_small_errors(capsys):
    main(["--quick"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["errors"] == {}
    assert r["device"]["kind"] == "cpu" and r["device"]["mlx"]
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
    s = r["speed"]
    for key in ("engine_prefill_tps", "engine_decode_tps", "mlx_lm_prefill_tps",
                "mlx_lm_decode_tps"):  # fmt: skip
        assert s[key] > 0
