"""The native quantized GEMV (kernels/native) against a float64 numpy reference, its fallback,
its build/fallback reporting, and `engine.load(quantize=...)` against mlx-lm.

Tolerance (every format): |y - ref| <= 2e-6 * (|W| @ |x|) per output, W the dequantized
matrix in float64. The kernels accumulate in float32 (K = 512..2048 terms, partial sums per
group and lane), so the error is bounded by a few float32 ulps of the sum of magnitudes; the
scales and biases are used at their stored precision on both sides. The fixed-point kernels
(4 bits: AVX-512 VNNI, AVX2; 8 bits: AVX2) sum exact integer products of x in 24-bit fixed
point per group: their extra error is at most 2^-23 of the group's largest |x| per element, and stays within
the same bound on these inputs; `test_fixed_point_error_bound` checks its own bound with
outliers.
"""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import mlx_lm_model, mlx_lm_quantized

import engine
from kernels import native

REL = 2e-6


def unpack(w: mx.array, bits: int) -> np.ndarray:
    """uint32-packed weights -> [N, K] integers, lowest bits first (MLX's affine layout)."""
    b = np.array(w).view(np.uint8)
    if bits == 8:
        return b.astype(np.int64)
    return np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(np.int64)


def reference(x, w, scales, biases, gs, bits):
    q = unpack(w, bits)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), gs, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), gs, axis=1)
    wd = s * q + b
    xd = np.array(x, dtype=np.float64).reshape(-1, wd.shape[1])
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


def case(N, K, gs, bits, dtype, M=1, seed=0):
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    w, s, b = mx.quantize(mx.random.normal((N, K), key=k1), group_size=gs, bits=bits)
    return mx.random.normal((M, K), key=k2), w, s.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("isa", ["simd", "float", "generic"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits,gs", [(8, 128), (8, 64), (8, 32), (4, 128), (4, 64), (4, 32)])
def test_kernel_matches_float64_reference(mod, monkeypatch, isa, dtype, bits, gs):
    if isa != "simd":  # the portable kernel (NEON and unknown CPUs), or the float SIMD one
        monkeypatch.setenv("CHATML_GEMV_ISA", isa)  # where VNNI would run, on this machine too
    # 200 rows (not a multiple of the 16-row thread chunks), 1 and 3 rows of x; the larger
    # matrix is split over the thread pool
    for N, K, M in ((200, 512, 1), (200, 512, 3), (1000, 2048, 1)):
        x, w, s, b = case(N, K, gs, bits, dtype, M)
        y = mod.quantized_gemv(x, w, s, b, gs, bits)
        ref, mag = reference(x, w, s, b, gs, bits)
        assert y.shape == (M, N) and y.dtype == mx.float32
        err = np.abs(np.array(y, dtype=np.float64) - ref)
        assert (err <= REL * mag).all(), f"max excess {(err - REL * mag).max()}"


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        return set()


def test_fixed_point_kernel_runs_where_the_cpu_has_it(mod, monkeypatch):
    """4 bits multiply in integers with AVX-512 VNNI ("vnni") or AVX2 ("maddubs") when rows
    come in whole 128-weight blocks, 8 bits with AVX2 ("maddwd"; AVX-512 reads 8-bit weights
    at memory speed in floats); CHATML_GEMV_ISA=float keeps the float kernels."""
    fixed4 = {"avx512": "vnni" if "avx512_vnni" in cpu_flags() else None, "avx2": "maddubs"}
    fixed8 = {"avx2": "maddwd"}
    isa = mod.isa()
    assert mod.kernel(4, 1024, 64) == fixed4.get(isa, isa)
    assert mod.kernel(8, 1024, 64) == fixed8.get(isa, isa)
    assert mod.kernel(4, 192, 64) == isa  # rows not in 128-weight blocks
    assert mod.kernel(8, 192, 64) == fixed8.get(isa, isa)
    monkeypatch.setenv("CHATML_GEMV_ISA", "float")
    assert mod.kernel(4, 1024, 64) == mod.kernel(8, 1024, 64) == isa


KERNEL_TESTS = (
    "tests/test_native.py::test_kernel_matches_float64_reference",
    "tests/test_native.py::test_fixed_point_kernel_runs_where_the_cpu_has_it",
    "tests/test_native.py::test_fixed_point_error_bound",
    "tests/test_native.py::test_rows_at_the_ends_of_the_float_range",
    "tests/test_native.py::test_inputs_that_are_not_row_major",
    "tests/test_dense.py::test_kernel_matches_float64_reference",
    "tests/test_dense.py::test_prefill_rows_match_float64_reference",
    "tests/test_dense.py::test_matches_mlx_matmul_at_every_phase",
    "tests/test_dense.py::test_outer_products_give_a_row_the_same_bits_in_any_company",
    "tests/test_kernels.py::test_fused_rows_match_reference",
    "tests/test_kernels.py::test_fused_prefill_segments_match_reference",
    "tests/test_kernels.py::test_fused_odd_head_sizes",
    "tests/test_activations.py::test_gates_match_float64",
    "tests/test_activations.py::test_conv_silu_matches_float64",
)


def test_avx2_kernels_on_any_x86_machine():
    """What AVX2-only CPUs run (the float kernels at 8 lanes, 4 bits as "maddubs", the dense
    kernel's 4-row dot-product and 6 x 16 outer-product tiles, 8 bits as "maddwd") built with
    -march=haswell and put through the kernels' float64 checks in a subprocess, so that a
    machine with AVX-512 (CI's) tests it too."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs an x86 CPU with AVX2 and FMA to run a -march=haswell build")
    if native.info().isa == "avx2":
        pytest.skip("this machine's own build is the AVX2 one: the other tests here run it")
    env = dict(os.environ, CHATML_NATIVE_MARCH="haswell")
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(var, None)
    probe = "import engine; from kernels import native; m = native.module(); "
    probe += "print(m.isa() if m else native.info().reason, m and m.kernel(4), m and m.kernel(8))"
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.stdout.split() == ["avx2", "maddubs", "maddwd"], run.stdout + run.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_fixed_point_error_bound(mod, gs, bits):
    """x with outliers (a few values 10^4 times the rest, as in real activations) and a zero
    group: the fixed-point kernels are within float32 rounding of the float64 product of x rounded to
    24-bit fixed point per group, error <= 2^-23 * max_g|x| * sum|w| (+ float32 sums)."""
    N, K = 96, 1024
    x, w, s, b = case(N, K, gs, bits, mx.bfloat16, M=2, seed=3)
    xn = np.array(x, dtype=np.float64)
    xn[0, 5] = 3e4
    xn[1, 700] = -2e4
    xn[1, :gs] = 0.0
    x = mx.array(xn.astype(np.float32))
    y = np.array(mod.quantized_gemv(x, w, s, b, gs, bits), dtype=np.float64)
    ref, mag = reference(x, w, s, b, gs, bits)
    q = unpack(w, bits)
    sd = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), gs, axis=1)
    wq = np.abs(sd * q)  # the part multiplied in fixed point (the bias goes with sum(x))
    top = np.repeat(np.abs(xn).reshape(2, -1, gs).max(axis=2), gs, axis=1)
    bound = 2.0**-23 * (top @ wq.T) + 2e-6 * mag
    assert np.isfinite(y).all() and (np.abs(y - ref) <= bound).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", ["simd", "float"])
def test_rows_at_the_ends_of_the_float_range(mod, monkeypatch, isa, bits):
    """A row scaled by 2^-120 (whose fixed-point units 2^(e - 23) would be subnormal), one by
    10^30, a 2^-140 group in an ordinary row, and an inf: the float64 bound holds on the
    finite rows and the inf's row is not finite."""
    if isa == "float":
        monkeypatch.setenv("CHATML_GEMV_ISA", "float")
    x, w, s, b = case(96, 1024, 64, bits, mx.bfloat16, M=4, seed=5)
    xn = np.array(x, dtype=np.float64)
    xn[0] *= 2.0**-120
    xn[1] *= 1e30
    xn[2, 64:128] *= 2.0**-140
    xn[3, 3] = np.inf
    x = mx.array(xn.astype(np.float32))
    y = np.array(mod.quantized_gemv(x, w, s, b, 64, bits), dtype=np.float64)
    ref, mag = reference(x[:3], w, s, b, 64, bits)
    assert (np.abs(y[:3] - ref) <= REL * mag).all()
    assert not np.isfinite(y[3]).any()


@pytest.mark.parametrize("bits", [8, 4])
def test_inputs_that_are_not_row_major(mod, bits):
    """A transposed x, scales read every other column, a reversed-row weight: the kernels
    copy such inputs to row-major while they run (no contiguous() node in the graph) and
    give what the row-major copies give."""
    x, w, s, b = case(200, 512, 64, bits, mx.bfloat16, M=3)
    xt = mx.array(np.array(x).T.copy()).T  # [3, 512] view of a [512, 3] buffer
    s2 = mx.concatenate([s[:, :, None], s[:, :, None]], axis=2).reshape(200, -1)[:, ::2]
    wr = mx.array(np.array(w)[::-1].copy())[::-1]  # rows reversed twice: negative strides
    want = mod.quantized_gemv(x, w, s, b, 64, bits)
    got = mod.quantized_gemv(xt, wr, s2, b, 64, bits)
    assert mx.array_equal(got, want).item()
    deq = mod.dequantize(wr, s2, b, 64, bits)
    assert mx.array_equal(deq, mod.dequantize(w, s, b, 64, bits)).item()


@pytest.mark.parametrize("bits,gs", [(8, 64), (4, 32)])
def test_dequantize_is_exact(mod, bits, gs):
    x, w, s, b = case(300, 256, gs, bits, mx.bfloat16)
    got = np.array(mod.dequantize(w, s, b, gs, bits))
    f32 = mx.float32
    want = mx.dequantize(w, s.astype(f32), b.astype(f32), group_size=gs, bits=bits)
    assert got.dtype == np.float32 and (got == np.array(want)).all()  # one rounding: s * q + b


def test_leading_dims_and_bad_input(mod):
    x, w, s, b = case(64, 128, 64, 4, mx.float32, M=6)
    y = mod.quantized_gemv(x.reshape(2, 3, 128), w, s, b, 64, 4)
    ref, _ = reference(x, w, s, b, 64, 4)
    assert y.shape == (2, 3, 64)
    assert np.allclose(np.array(y).reshape(6, 64), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="x has 100 columns, w holds 128"):
        mod.quantized_gemv(x[:, :100], w, s, b, 64, 4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        mod.quantized_gemv(x, w, s, b, 64, 3)
    with pytest.raises(ValueError, match="float32"):
        mod.quantized_gemv(x.astype(mx.bfloat16), w, s, b, 64, 4)
    # rows of length 0 (K = 0): x.size() / K divided by zero, SIGFPE killed the process
    empty = mx.zeros((4, 0), dtype=mx.uint32), mx.zeros((4, 0)), mx.zeros((4, 0))
    with pytest.raises(ValueError, match="empty rows"):
        mod.quantized_gemv(mx.zeros((1, 0)), *empty, 64, 4)
    with pytest.raises(ValueError, match="empty rows"):
        mod.dequantize(*empty, 64, 4)


@pytest.mark.parametrize("rows", [1, 9, native.GEMV_ROWS, native.GEMV_ROWS + 1])
def test_quantized_matmul_both_paths(mod, monkeypatch, rows):
    """The GEMV kernel (few rows) and prefill (dequantize + BLAS), native and fallback."""
    x, w, s, b = case(256, 512, 64, 4, mx.bfloat16, M=rows)
    ref, mag = reference(x, w, s, b, 64, 4)
    for setting in ("build", "0"):
        monkeypatch.setenv("CHATML_NATIVE", setting)
        native.reset()
        y = native.quantized_matmul(x, w, s, b, 64, 4)
        assert native.info().active == (setting == "build")
        err = np.abs(np.array(y, dtype=np.float64) - ref)
        assert (err <= 1e-5 * mag + 1e-5).all(), setting
    native.reset()


def test_no_compiler_falls_back_with_one_line(tmp_path):
    code = (
        "from kernels import native; import sys; "
        "print(native.module() is None, native.info().reason, file=sys.stdout)"
    )
    env = {**os.environ, "CHATML_HOME": str(tmp_path), "PATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True no cmake on PATH"
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "native CPU kernels unavailable (no cmake on PATH)" in lines[0]


def test_mlx_cmake_package_is_found_beside_a_folder_named_mlx(tmp_path):
    """A script in a folder that also holds an `mlx` folder (a checkout, scratch files):
    that folder comes first in the mlx namespace's path, and the build once looked for
    MLX's CMake files there (`cmake -S failed`)."""
    (tmp_path / "mlx").mkdir()
    script = tmp_path / "where.py"
    script.write_text("from kernels import native; print(native.mlx_cmake_dir())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    found = Path(run.stdout.strip())
    assert (found / "MLXConfig.cmake").is_file() and tmp_path not in found.parents


def test_module_built_for_another_mlx_is_refused(mod, monkeypatch, capsys):
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    native.reset()
    assert native.module() is None
    assert "built for MLX 0.32" in native.info().reason and "running MLX 0.0.1" in (
        native.info().reason
    )
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.undo()
    native.reset()


def prefill_and_steps(model, ids, steps=3):
    """Logits of a prefill of all but the last `steps` ids, then one-token decode steps."""
    caches = model.make_caches()
    first = model(mx.array([ids[:-steps]]), caches)
    return mx.concatenate([first] + [model(mx.array([[t]]), caches) for t in ids[-steps:]], 1)


@pytest.mark.parametrize("bits,path", [(8, "native"), (4, "native"), (4, "mlx-ops")])
def test_quantize_at_load_matches_mlx_lm(tiny, monkeypatch, bits, path):
    """`quantize=` on a float checkpoint = mlx_lm.convert's quantization, run by mlx-lm;
    prefill (dequantize + BLAS) and decode (the GEMV kernel, or the fallback's MLX ops)."""
    out = mlx_lm_quantized(tiny.checkpoint.path, bits)
    if path == "mlx-ops":
        monkeypatch.setenv("CHATML_NATIVE", "0")
    native.reset()
    ours = engine.load(str(tiny.checkpoint.path), quantize=bits)
    assert native.info().active == (path == "native")
    ref = mlx_lm_model(out)
    ids = tiny.tokenizer.encode("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    got = prefill_and_steps(ours.model, ids)
    want = ref(mx.array([ids]), cache=ref.make_cache())
    assert mx.abs(got - want).max().item() < 1e-4  # float32 activations, the same weights
    native.reset()
    from mlx.utils import tree_flatten

    size = sum(v.nbytes for _, v in tree_flatten(ours.model.parameters()))
    on_disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert size <= 1.3 * on_disk
    with pytest.raises(ValueError, match="already quantized"):
        engine.load(str(out), quantize=4)
    with pytest.raises(ValueError, match="quantize must be 8 or 4"):
        engine.load(str(tiny.checkpoint.path), quantize=2)


def test_two_threads_at_once(mod):
    """Two threads (each its own MLX stream) share the kernel's thread pool correctly."""
    import threading

    x, w, s, b = case(1024, 2048, 64, 8, mx.bfloat16, M=1)  # big enough to use the pool
    ref, mag = reference(x, w, s, b, 64, 8)
    x, w, s, b = (np.array(a.astype(mx.float32)) for a in (x, w.view(mx.float32), s, b))
    errors = []

    def worker():
        stream = mx.new_stream(mx.cpu)
        with mx.stream(stream):
            xs, ws = mx.array(x), mx.array(w).view(mx.uint32)
            ss, bs = mx.array(s).astype(mx.bfloat16), mx.array(b).astype(mx.bfloat16)
            for _ in range(30):
                y = np.array(mod.quantized_gemv(xs, ws, ss, bs, 64, 8), dtype=np.float64)
                if not (np.abs(y - ref) <= REL * mag).all():
                    errors.append(np.abs(y - ref).max())

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


SHAPES = ((1024, 2048), (640, 1024))  # test_more_workers_than_cores: two jobs, alternated


def test_more_workers_than_cores(mod):
    """Eight pool threads on this machine's cores: workers are parked by the OS all the time,
    wake late for jobs already done, and race the caller for parts. Every one of 400 jobs (two
    matrix shapes, back to back, so a late worker meets the next job) gives the same bits as
    the first, which is within the float64 reference's bound."""
    code = """
import sys
sys.path.insert(0, "tests")
import engine
import mlx.core as mx, numpy as np
from kernels import native
from test_native import SHAPES, case
m = native.module()
assert m.threads() == 8, m.threads()
jobs = [case(n, k, 64, 8, mx.float32, seed=3 + i) for i, (n, k) in enumerate(SHAPES)]
first = [np.array(m.quantized_gemv(*job, 64, 8)) for job in jobs]
for i in range(400):
    y = np.array(m.quantized_gemv(*jobs[i % 2], 64, 8))
    assert (y == first[i % 2]).all(), i
for y in first:
    np.save(sys.stdout.buffer, y)
"""
    env = {**os.environ, "CHATML_GEMV_THREADS": "8"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()
    import io

    out = io.BytesIO(run.stdout)
    for i, (n, k) in enumerate(SHAPES):
        ref, mag = reference(*case(n, k, 64, 8, mx.float32, seed=3 + i), 64, 8)
        err = np.abs(np.load(out).astype(np.float64) - ref)
        assert (err <= REL * mag).all()
