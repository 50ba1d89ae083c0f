"""Side by side with llama.cpp on the same checkpoint: prefill and decode tokens/s.

Run: ``chatml bench peer --model qwen3.5-0.8b [--formats f32,q8_0,q4_k_m] [--threads 2]
[--repeats 2] [--json FILE]``. Not part of CI: the first run builds llama.cpp (~15 minutes on
2 cores).

llama.cpp comes from PyPI, as source: the ``llama-cpp-python`` sdist vendors a llama.cpp tree
with ``convert_hf_to_gguf.py``, ``llama-bench`` and ``llama-quantize``. It is built once under
``CHATML_HOME/peer`` (CMake + Ninja, ``GGML_NATIVE=ON`` without AMX: `_no_amx`, no curl), the
checkpoint is converted to GGUF (``--no-mtp``: both sides decode without the MTP head) in each
format asked for, and then ``llama-bench`` and this engine's throughput bench (the ``chatml``
configuration of ``bench.throughput``: prefill of a 512-token prompt, 64 tokens decoded after
a 512-token prompt) run interleaved, ``--repeats`` times each, the best kept. Both decode at
the same depth: llama.cpp's ``tg64`` after 512 tokens of context (``-d 512``; its tg64 on an
empty context is kept as ``decode_tps_depth0``, what this bench compared against before
session 27), and its prefill is ``pp512`` on an empty context, as the engine's. Each
llama.cpp format is paired with the engine at the matching precision: F32 with float32, Q8_0
with ``quantize=8`` and Q4_K_M with ``quantize=4`` (MLX's affine layout, group 64; the
engine's activations stay float32, as mlx-lm's do). The ratios in the table are the engine
over its pair.

llama.cpp picks its kernels for this CPU; so does OpenBLAS here: ``OPENBLAS_CORETYPE`` and
``OPENBLAS_L2_SIZE``, which some machines set to pin older kernels (Haswell's AVX2 on an
AVX-512 CPU halves sgemm), are dropped for the engine's runs, and the JSON records the kernel
set OpenBLAS ran (``blas_core``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.common import ROOT, child_env, conditions, model_path, write_json

LLAMA_CPP_PYTHON = "0.3.36"  # its vendored llama.cpp is the peer (commit in its vendor tree)
TARGETS = ("llama-bench", "llama-server", "llama-quantize")
PROMPT, DECODE = 512, 64
# llama.cpp format -> the engine's configuration at that precision (bench.throughput)
PAIRS = {"f32": "chatml", "q8_0": "chatml_q8", "q4_k_m": "chatml_q4"}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def llama_cpp(work: Path, jobs: int) -> Path:
    """The llama.cpp source tree and its build under `work` (downloaded and built once)."""
    src = work / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        work.mkdir(parents=True, exist_ok=True)
        sdist = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.exists():
            _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                  ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)])  # fmt: skip
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(src, members=[m for m in members if m.name], **safe)
    build = work / "build"
    stamp = build / "chatml-cmake-flags"  # a build configured otherwise is reconfigured
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DBUILD_SHARED_LIBS=OFF", *_no_amx()]  # fmt: skip
    made = stamp.exists() and stamp.read_text() == " ".join(flags)
    if not (made and all((build / "bin" / t).exists() for t in TARGETS)):
        _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *flags],
             stdout=subprocess.DEVNULL)  # fmt: skip
        _run(["ninja", "-C", str(build), f"-j{jobs}", *TARGETS])
        stamp.write_text(" ".join(flags))
    return src


def _no_amx() -> list[str]:
    """Compiler flags that keep llama.cpp's AMX kernels out of a native x86 build.

    `GGML_NATIVE` compiles them in wherever the CPU lists AMX, and on Xeons after Sapphire
    Rapids (measured here: a Xeon with AVX512-FP16 and AMX) its int8 path dies with SIGILL on
    its first `tilezero` (Q8_0 / Q4_K_M, F32 unaffected): the tile configuration is left
    unloaded on the worker threads (llama.cpp PR #26954). Without them llama.cpp runs its
    AVX-512 (VNNI) kernels, as on any AVX-512 CPU without AMX.
    """
    if os.uname().machine not in ("x86_64", "AMD64"):
        return []
    off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={off}", f"-DCMAKE_CXX_FLAGS={off}"]


def gguf(src: Path, work: Path, ckpt: Path, fmt: str) -> Path:
    """The checkpoint as a GGUF file in `fmt` (f32, or a llama-quantize type such as q8_0)."""
    out = work / "gguf" / f"{ckpt.name}-{fmt}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    f32 = work / "gguf" / f"{ckpt.name}-f32.gguf"
    if not f32.exists():
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
        _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(ckpt), "--no-mtp",
              "--outtype", "f32", "--outfile", str(f32)], env=env, stdout=subprocess.DEVNULL)  # fmt: skip
    if fmt != "f32":
        _run([str(work / "build" / "bin" / "llama-quantize"), str(f32), str(out), fmt.upper()],
             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return out


def llama_bench(work: Path, path: Path, threads: int) -> dict:
    """pp512 and tg64 on an empty context, and tg64 after `PROMPT` tokens: the depth this
    engine's decode is timed at (each token then attends over the prompt; llama.cpp's tg64
    at depth 512 was ~0.8x its empty-context figure in the issue's table)."""

    def bench(*args: str) -> list[dict]:
        res = _run([str(work / "build" / "bin" / "llama-bench"), "-m", str(path), *args,
                    "-t", str(threads), "-o", "json"],
                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        return json.loads(res.stdout)

    rows = bench("-p", str(PROMPT), "-n", str(DECODE))
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    tg0 = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    deep = bench("-p", "0", "-n", str(DECODE), "-d", str(PROMPT))
    tg = next(r["avg_ts"] for r in deep if r["n_gen"] and r.get("n_depth") == PROMPT)
    return {"prefill_tps": pp, "decode_tps": tg, "decode_tps_depth0": tg0}


def engine_env(threads: int) -> dict[str, str]:
    """The environment of the engine's side: `threads` for OpenBLAS and the native pool, and
    OpenBLAS free to pick this CPU's kernels (as llama.cpp picks its own)."""
    env = child_env("1")
    env["OPENBLAS_NUM_THREADS"] = env["CHATML_GEMV_THREADS"] = str(threads)  # BLAS, native pool
    for pinned in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        env.pop(pinned, None)
    return env


def chatml(ckpt: Path, threads: int, config: str = "chatml") -> dict:
    env = engine_env(threads)
    cmd = [sys.executable, "-m", "bench.throughput", "--child", config, "--model", str(ckpt),
           "--ts", str(PROMPT), "--decode", str(DECODE), "--repeats", "1"]  # fmt: skip
    res = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return {"prefill_tps": r["prefill"][str(PROMPT)]["tokens_per_s"],
            "decode_tps": r["decode"]["tokens_per_s"], "peak_rss_bytes": r["peak_rss_bytes"],
            "blas_core": r.get("blas_core", "")}  # fmt: skip


def _best(runs: list[dict]) -> dict:
    rates = [k for k in ("prefill_tps", "decode_tps", "decode_tps_depth0") if k in runs[0]]
    best = {k: max(r[k] for r in runs) for k in rates}
    if "peak_rss_bytes" in runs[0]:
        best["peak_rss_bytes"] = min(r["peak_rss_bytes"] for r in runs)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-0.8b", help="registry name or checkpoint folder")
    ap.add_argument("--formats", default="f32,q8_0,q4_k_m", help="GGUF formats for llama.cpp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build parallelism")
    ap.add_argument("--work", help="build folder (default: CHATML_HOME/peer)")
    ap.add_argument("--prepare-only", action="store_true", help="build and convert, no timing")
    ap.add_argument("--json")
    a = ap.parse_args()

    import engine  # noqa: F401  (the fast BLAS, before mlx; conditions() reports it)
    from engine.paths import chatml_home

    work = Path(a.work).expanduser() if a.work else chatml_home() / "peer"
    src = llama_cpp(work, a.jobs)
    ckpt = model_path(a.model)
    formats = [fmt.strip().lower() for fmt in a.formats.split(",") if fmt.strip()]  # Q8_0 = q8_0
    files = {fmt: gguf(src, work, ckpt, fmt) for fmt in formats}
    if a.prepare_only:
        return
    runs: dict[str, list[dict]] = {}
    for _ in range(a.repeats):  # interleaved, so both sides see the same machine
        for fmt, path in files.items():
            if fmt in PAIRS:
                runs.setdefault(f"chatml {fmt}", []).append(chatml(ckpt, a.threads, PAIRS[fmt]))
            runs.setdefault(f"llama.cpp {fmt}", []).append(llama_bench(work, path, a.threads))
    best = {name: _best(r) for name, r in runs.items()}
    print(f"{'engine, format':<22}{'prefill 512':>13}{'decode':>9}{'peak RSS':>10}"
          f"{'vs llama.cpp, same format':>28}{'llama.cpp decode, empty context':>33}")  # fmt: skip
    for name, r in best.items():
        engine_, fmt = name.split(" ", 1)
        ref = best.get(f"llama.cpp {fmt}") if engine_ == "chatml" else None
        ratio = (f"{r['prefill_tps'] / ref['prefill_tps']:.2f}x / "
                 f"{r['decode_tps'] / ref['decode_tps']:.2f}x") if ref else "-"  # fmt: skip
        rss = f"{r['peak_rss_bytes'] / 2**30:.2f}G" if "peak_rss_bytes" in r else "-"
        empty = f"{r['decode_tps_depth0']:.2f}" if "decode_tps_depth0" in r else "-"
        print(f"{name:<22}{r['prefill_tps']:>13.1f}{r['decode_tps']:>9.2f}{rss:>10}{ratio:>28}"
              f"{empty:>33}")  # fmt: skip
    result = {
        "conditions": conditions(model=a.model, checkpoint=str(ckpt), threads=a.threads,
                                 llama_cpp_python=LLAMA_CPP_PYTHON, prompt=PROMPT, decode=DECODE),
        "best": best, "runs": runs,
    }  # fmt: skip
    print(f"(tokens/s; decode after {PROMPT} tokens on both sides)")
    print(json.dumps({"bench": "peer", **result}))
    write_json(a.json, result)


if __name__ == "__main__":
    main()
