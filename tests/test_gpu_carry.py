"""bench.gpu_carry: the CUDA backend cut to one architecture, and the device's run script."""

from __future__ import annotations

import importlib.metadata
import struct
import subprocess

import pytest

from bench import gpu_carry


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _elf_with_fatbin(entries: list[bytes]) -> tuple[bytes, int]:
    """A minimal ELF64 file: a null section, .shstrtab and .nv_fatbin (8 bytes of padding,
    then one fatbin holding `entries`). Returns the file and the fatbin section's offset."""
    body = b"".join(entries)
    fatbin = bytes(8) + struct.pack("<IHHQ", gpu_carry.FATBIN_MAGIC, 1, 16, len(body)) + body
    names = b"\0.shstrtab\0.nv_fatbin\0"
    names_at = 64
    fatbin_at = names_at + len(names)
    shoff = fatbin_at + len(fatbin)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 1)
    sections = b""
    for label, offset, size in ((0, 0, 0), (1, names_at, len(names)),
                                (11, fatbin_at, len(fatbin))):  # fmt: skip
        entry = bytearray(64)
        struct.pack_into("<I", entry, 0, label)
        struct.pack_into("<QQ", entry, 0x18, offset, size)
        sections += bytes(entry)
    return bytes(header) + names + fatbin + sections, fatbin_at


def test_one_architecture_kept_the_rest_zeroed(tmp_path):
    sm80, sm90, ptx = b"\x80" * 40, b"\x90" * 48, b"P" * 24
    data, at = _elf_with_fatbin([_entry(2, 80, sm80), _entry(2, 90, sm90), _entry(1, 90, ptx)])
    lib = tmp_path / "libmlx.so"
    lib.write_bytes(data)
    assert gpu_carry.section(data, ".nv_fatbin")[0] == at
    found = [(kind, arch, size) for _, size, kind, arch in
             gpu_carry.fatbin_entries(data, *gpu_carry.section(data, ".nv_fatbin"))]  # fmt: skip
    assert found == [("elf", 80, 40), ("elf", 90, 48), ("ptx", 90, 24)]
    sizes = gpu_carry.keep_one_architecture(lib, 90)
    assert sizes == {"kept": 48, "zeroed": 64}
    cut = lib.read_bytes()
    assert len(cut) == len(data)
    assert sm90 in cut and sm80 not in cut and ptx not in cut
    # Only the payloads changed: every entry's header, and the rest of the file, as it was.
    changed = [i for i, (a, b) in enumerate(zip(data, cut)) if a != b]
    assert len(changed) == 64 and all(data[i] in (0x80, ord("P")) for i in changed)
    with pytest.raises(ValueError, match="no sm_75 machine code"):
        gpu_carry.keep_one_architecture(lib, 75)
    with pytest.raises(ValueError, match="no .nv_fatbin section"):
        gpu_carry.section(data[:64] + bytes(len(data) - 64), ".nv_fatbin")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        gpu_carry.section(b"#!/bin/sh\n" + data[10:], ".nv_fatbin")


def test_requirements_pin_this_environment():
    wanted = gpu_carry.requirements()
    mlx = importlib.metadata.version("mlx")
    assert f"mlx=={mlx}" in wanted and f"mlx-cuda-13=={mlx}" in wanted
    assert f"mlx-lm=={importlib.metadata.version('mlx-lm')}" in wanted
    assert "nvidia-cuda-crt==13.*" in wanted


def test_run_script_installs_the_carried_files_then_checks(tmp_path):
    folder = tmp_path / ".whl"
    folder.mkdir()
    run = gpu_carry.write_run(folder, folder / "mlx_cuda13_sm90.tar.xz", "--quick")
    text = run.read_text()
    assert subprocess.run(["bash", "-n", str(run)]).returncode == 0  # it parses
    assert "--target $SITE \\\n  .whl/*.whl" in text
    assert "tar xJf .whl/mlx_cuda13_sm90.tar.xz -C $SITE" in text
    assert 'python3 -m bench.gpu_check --out "$OUT/gpu_check.json" --quick 2>&1' in text
