"""`chatml models` and `chatml doctor` as a user runs them."""

import json
import os

import pytest

from engine.checkpoints import registry
from engine.checkpoints.builder import parameter_count
from engine.cli import main


def test_models_lists_the_registry(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in registry.registry():
        assert name in out
    assert "Qwen/Qwen3.5-27B" in out and "embedded" in out


def test_models_info_prints_architecture_and_cache_sizes(capsys):
    assert main(["models", "info", "qwen3.5-0.8b"]) == 0
    out = capsys.readouterr().out
    arch = registry.get("qwen3.5-0.8b").arch
    assert f"parameters: {parameter_count(arch):,}" in out
    assert f"recurrent state: {arch.recurrent_state_bytes():,} bytes" in out
    assert "KV cache: 24,576 bytes per token" in out
    assert "18 Gated DeltaNet, 6 gated attention" in out


def test_models_errors(capsys):
    assert main(["models", "info", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["models", "build", "tiny"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # was a numpy traceback, mid-build
        main(["models", "build", "tiny", "--out", "x", "--seed", "-1"])
    assert usage.value.code == 2
    assert "--seed: must be >= 0, got -1" in capsys.readouterr().err


def test_models_build_writes_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "tiny-seed3"
    assert main(["models", "build", "tiny", "--out", str(out), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == registry.get("tiny").arch.hidden_size
    import engine

    assert engine.load(str(out)).checkpoint.path == out


def test_doctor_reports_backend_and_blas(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] in ("cpu", "gpu")
    assert report["device_kind"] in ("cpu", "metal", "cuda")
    assert report["device_kind"] == "cpu" or report["backend"] == "gpu"
    assert report["memory_usable_gib"] > 0
    # exactly one MLX backend distribution (two would fight over libmlx.so)
    assert len(report["mlx_backend_packages"]) == 1, report["mlx_backend_packages"]
    assert report["matmul_gflops_f32"] > 0
    assert report["blas"]
    # a compiler is present here: the quantized CPU path is the native one (kernels/native)
    assert report["quantized_cpu_path"].startswith("native ("), report["quantized_cpu_path"]


def test_build_kernels_names_the_module_and_the_path(capsys):
    from kernels import native

    assert main(["build-kernels"]) == 0
    out = capsys.readouterr().out
    assert str(native.build_dir()) in out and "quantized CPU path: native (" in out


def test_a_bad_model_is_a_message_not_a_traceback(capsys):
    assert main(["chat", "--model", "/nonexistent", "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert "chatml chat: /nonexistent: no such checkpoint folder" in err
    assert "Traceback" not in err


def test_doctor_shows_the_data_folder_and_no_empty_note(capsys, monkeypatch):
    import os

    from kernels import blas

    monkeypatch.setattr(blas, "measure_gflops", lambda: 1.0)  # the report, not the speed
    monkeypatch.setattr(blas, "info", lambda: blas.BlasInfo("openblas", "scipy-openblas32", ""))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"chatml_home: {os.environ['CHATML_HOME']}" in out
    assert "blas_note" not in out and "blas_provider: scipy-openblas32" in out
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chatml_home"] == os.environ["CHATML_HOME"]


def test_models_info_shows_the_sampling_defaults(capsys):
    assert main(["models", "info", "qwen3.5-9b"]) == 0
    out = capsys.readouterr().out
    assert ("sampling defaults (generation_config.json; chat and serve): temperature 1.0, "
            "top_p 0.95, top_k 20, min_p 0.0, presence_penalty 1.5") in out  # fmt: skip
    assert main(["models", "info", "qwen3.5-0.8b"]) == 0
    assert "temperature 0.7, top_p 0.8, top_k 20" in capsys.readouterr().out


def test_float32_products_stay_float32_unless_the_user_opts_into_tf32(monkeypatch):
    """MLX computes float32 matmuls in TF32 on CUDA by default (3e-4 relative error measured on
    an H200, and a chunked prefill's state 5e-4 off): `import engine` turns that off unless the
    user chose, and doctor says which is in force."""
    import subprocess
    import sys

    from engine.cli import float32_matmul

    def after_import(env):
        code = "import os, engine; print(os.environ['MLX_ENABLE_TF32'])"
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300, check=True).stdout.strip()  # fmt: skip

    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    assert after_import(env) == "0"
    assert after_import({**env, "MLX_ENABLE_TF32": "1"}) == "1"  # the user's choice stands
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert float32_matmul("cuda") == "float32" == float32_matmul("cpu")
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    assert float32_matmul("cuda").startswith("TF32") and float32_matmul("cpu") == "float32"
