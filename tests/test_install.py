"""Which MLX backend `pip install -e .` asks for (setup.py): never two on one machine."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def mlx_requirements(*args):
    spec = importlib.util.spec_from_file_location("chatml_setup", SETUP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module.mlx_requirements(*args)


def linux(reqs):
    (req,) = [r for r in reqs if "linux" in r and r.startswith("mlx")]
    return req.split(">=")[0]


def test_a_cpu_only_machine_gets_the_cpu_backend():
    assert linux(mlx_requirements(None, False)) == "mlx[cpu]"


def test_a_machine_with_an_nvidia_driver_picks_its_backend_by_extra():
    # no backend in the base: `.[cuda]`, `.[cuda13]` or `.[cpu]` adds exactly one
    assert linux(mlx_requirements(None, True)) == "mlx"


@pytest.mark.parametrize("choice", ["cpu", "cuda12", "cuda13"])
def test_the_environment_variable_decides(choice):
    for driver in (False, True):
        reqs = mlx_requirements(choice, driver)
        assert linux(reqs) == f"mlx[{choice}]"
        # CUDA 13's run-time compiled kernels need the crt/ headers, which mlx-cuda-13 omits
        assert any(r.startswith("nvidia-cuda-crt==13.") for r in reqs) == (choice == "cuda13")
    assert linux(mlx_requirements("none", False)) == "mlx"


def test_a_wrong_choice_is_named():
    with pytest.raises(ValueError, match="CHATML_MLX_BACKEND must be one of"):
        mlx_requirements("rocm", False)


def test_the_extras_each_name_one_backend():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    extras = tomllib.loads((SETUP.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name, backend in (("cpu", "cpu"), ("cuda", "cuda12"), ("cuda12", "cuda12"),
                          ("cuda13", "cuda13")):  # fmt: skip
        req, *headers = extras[name]
        assert req.startswith(f"mlx[{backend}]>=")
        assert [h.split(";")[0] for h in headers] == (
            ["nvidia-cuda-crt==13.*"] if backend == "cuda13" else []
        )


def test_a_foreign_kernels_package_found_first_is_named(tmp_path):
    """Hugging Face's `kernels` (a dependency of transformers >= 5.25) has the import name of
    this repo's `kernels/`; found first, it is named with the way out, not a bare ImportError."""
    import subprocess
    import sys

    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text('"""Another project\'s kernels."""\n')
    r = subprocess.run([sys.executable, "-c", "import engine"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0
    assert f"shadowed by {tmp_path / 'kernels' / '__init__.py'}" in r.stderr
    assert "pip uninstall kernels" in r.stderr


def test_mlx_without_a_backend_is_named_with_the_extras(tmp_path):
    """`mlx` installed without mlx-cpu or mlx-cuda (a plain `pip install -e .` where an NVIDIA
    driver is present) failed `import engine`, and so every `chatml` command, with a bare
    "libmlx.so: cannot open shared object file"; the error now names the extras to install."""
    import subprocess
    import sys

    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("")
    (tmp_path / "mlx" / "core.py").write_text(  # what mlx's core module raises without libmlx.so
        'raise ImportError("libmlx.so: cannot open shared object file: No such file or directory")\n'
    )
    r = subprocess.run([sys.executable, "-c", "import engine"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: MLX has no backend") and '.[cpu]"' in last, last


def test_transformers_stays_below_the_release_that_brings_another_kernels():
    spec = importlib.util.spec_from_file_location("chatml_setup", SETUP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (req,) = [d for d in module.DEPENDENCIES if d.startswith("transformers")]
    assert req == "transformers>=5.0,<5.25"


def test_a_wheel_carries_the_registry_and_the_native_sources(tmp_path):
    """A non-editable install (`pip install .`, a wheel) could load no model: the registry was
    read from the checkout's models.yaml, which no wheel carries, and the native kernels'
    headers were left out, so their build failed. Built here from a copy of the tracked files,
    installed into a folder, and imported away from the checkout."""
    import subprocess
    import sys

    root = SETUP.parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    src = tmp_path / "src"
    for name in files:
        if name.split("/")[0] in ("engine", "kernels", "renderer", "bench") or "/" not in name:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((root / name).read_bytes())
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "wheel",
                    src], check=True, capture_output=True, timeout=300)  # fmt: skip
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    probe = (
        "import engine, json\n"
        "from engine.checkpoints import registry\n"
        "print(json.dumps([engine.__file__, str(registry.REGISTRY_PATH), "
        "registry.DEFAULT_MODEL in registry.registry()]))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(site)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    module, registry_path, has_default = json.loads(r.stdout.splitlines()[-1])
    assert module.startswith(str(site)) and registry_path.startswith(str(site)) and has_default
    native = {n.removeprefix("kernels/native/") for n in files if n.startswith("kernels/native/")}
    assert native == {f.name for f in (site / "kernels" / "native").iterdir()}  # headers too
