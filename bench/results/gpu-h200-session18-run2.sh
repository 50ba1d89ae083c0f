#!/bin/bash
# A record of session 18's device runs (BENCHMARKS.md, NVIDIA H200): run from the repo root with the
# wheels and the cut backend (now `python -m bench.gpu_carry`) in .whl/, carried to the machine.
# Second device run: diagnosis of decode speed, bf16 precision, 4-bit JIT, then the GPU tests.
set -u
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
PY=python3
VENV_SP=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SP=/tmp/site
rm -rf $SP && mkdir -p $SP
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SP .whl/*.whl || exit 1
tar xJf .whl/mlx_cuda13_sm90.tar.xz -C $SP || exit 1
# the libraries by path, not a nvidia/ beside mlx/: MLX's NVRTC then takes the toolkit's headers
export LD_LIBRARY_PATH=$(ls -d $VENV_SP/nvidia/*/lib | tr '\n' ':')
export PYTHONPATH=$SP:$PWD PYTHONUNBUFFERED=1 CHATML_HOME=/tmp/chatml CHATML_NATIVE=off
el "installed"
$PY .whl/diag.py decode profile > $OUT/decode.json 2>$OUT/diag.log; el decode; head -c 600 $OUT/decode.json; echo
MLX_DISABLE_COMPILE=1 $PY .whl/diag.py decode >> $OUT/decode.json 2>>$OUT/diag.log; el nocompile; tail -1 $OUT/decode.json
MLX_USE_CUDA_GRAPHS=0 $PY .whl/diag.py decode >> $OUT/decode.json 2>>$OUT/diag.log; el nographs; tail -1 $OUT/decode.json
timeout 100 $PY .whl/diag.py precision > $OUT/precision.json 2>>$OUT/diag.log; el precision; cat $OUT/precision.json
timeout 40 $PY .whl/diag.py quantized > $OUT/quantized.json 2>>$OUT/diag.log; el quantized; cat $OUT/quantized.json
LEFT=$(( 285 - ($(date +%s) - T0) ))
el "pytest for ${LEFT}s"
timeout $LEFT $PY -m pytest -q -p no:cacheprovider -n 12 --dist loadfile --timeout 100 --tb=line -rfE \
  -k "not fused and not on_the_cpu" tests/test_bfloat16.py tests/test_kernels.py tests/test_model.py \
  tests/test_warm.py tests/test_quantized.py tests/test_threads.py tests/test_memory.py tests/test_step.py \
  tests/test_batch.py tests/test_session.py tests/test_stateless.py tests/test_mtp.py \
  --deselect tests/test_batch.py::test_concurrent_clients_of_the_server_batch_and_answer_as_alone >$OUT/pytest.log 2>&1
el "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -40
sed -n '/"profile"/p' $OUT/decode.json | head -c 100 >/dev/null
