#!/bin/bash
# A record of session 18's device runs (BENCHMARKS.md, NVIDIA H200): run from the repo root with the
# wheels and the cut backend (now `python -m bench.gpu_carry`) in .whl/, carried to the machine.
# On the lent NVIDIA machine: MLX's CUDA backend from carried files, then bench.gpu_check and
# the GPU-relevant tests. Not committed (.whl/ is ignored): the workplace's device harness only.
set -u
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
PY=python3
$PY -c "import sys, numpy, transformers; print(sys.version.split()[0], numpy.__version__, transformers.__version__)"
VENV_SP=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SP=/tmp/site
rm -rf $SP && mkdir -p $SP
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SP \
  .whl/*.whl || { el "pip failed"; exit 1; }
tar xJf .whl/mlx_cuda13_sm90.tar.xz -C $SP || { el "tar failed"; exit 1; }
# libmlx's RPATH is $ORIGIN/../../nvidia/{cu13,cudnn,nccl,...}/lib: the image's CUDA 13 wheels
ln -s "$VENV_SP/nvidia" $SP/nvidia
ls "$VENV_SP/nvidia" | tr '\n' ' '; echo
if [ ! -d /usr/local/cuda/include ]; then
  export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
fi
echo "CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}"
export PYTHONPATH=$SP:$PWD PYTHONUNBUFFERED=1 CHATML_HOME=/tmp/chatml CHATML_NATIVE=off
el "installed"
$PY - <<'EOF' || { ldd $SP/mlx/lib/libmlx.so | grep -i "not found"; el "mlx smoke failed"; exit 1; }
import mlx.core as mx
print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available())
a = mx.random.normal((512, 512))
print("matmul", (a @ a).sum().item())
f = mx.compile(lambda x: mx.exp(-x * x) * 2 + 1)  # a JIT (NVRTC) kernel
print("compiled", f(a).sum().item(), "bf16", (a.astype(mx.bfloat16) @ a.astype(mx.bfloat16)).sum().item())
EOF
el "smoke ok"
$PY -m engine.cli doctor 2>&1 | head -30
timeout 300 $PY -m bench.gpu_check --out $OUT/gpu_check.json >$OUT/gpu_check.line 2>$OUT/gpu_check.log
el "gpu_check rc=$?"
grep -v "^\[INFO\]" $OUT/gpu_check.log | tail -25
for tf in 0 1; do MLX_ENABLE_TF32=$tf $PY - <<'EOF2'
import os, numpy as np, mlx.core as mx
from bench.gpu_check import kernels_section
x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
ref = x.astype(np.float64) @ x.astype(np.float64)
got = np.array(mx.array(x) @ mx.array(x), np.float64)
print("MLX_ENABLE_TF32", os.environ["MLX_ENABLE_TF32"], "f32 matmul rel err", np.abs(got - ref).max() / np.abs(ref).max())
for r in kernels_section(["0.8b"], [64, 512]):
    print(" ", r["T"], {m: (r[m].get("err_state"), r[m].get("ms")) for m in ("chunked", "sequential")})
EOF2
done
LEFT=$(( 430 - ($(date +%s) - T0) ))
el "pytest for ${LEFT}s"
timeout $LEFT $PY -m pytest -q -p no:cacheprovider -n 8 --dist loadfile --timeout 150 --tb=line -rfE \
  --durations=10 -k "not fused and not on_the_cpu" tests/test_bfloat16.py tests/test_kernels.py tests/test_model.py tests/test_warm.py \
  tests/test_quantized.py tests/test_threads.py tests/test_memory.py tests/test_step.py \
  tests/test_batch.py tests/test_session.py tests/test_stateless.py tests/test_mtp.py \
  --deselect tests/test_batch.py::test_concurrent_clients_of_the_server_batch_and_answer_as_alone >$OUT/pytest.log 2>&1
el "pytest rc=$?"
tail -60 $OUT/pytest.log
