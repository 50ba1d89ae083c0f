"""Cut a CUDA shared library's fatbin to one architecture, so MLX's CUDA backend fits the 64 MiB
a lent GPU machine receives (how session 18 got mlx-cuda-13 0.32.4 onto an H200):

    python gpu-h200-session18-fatbin.py libmlx.so            # list the fatbin's entries
    strip --strip-unneeded libmlx.so                         # the 23 MB symbol table
    python gpu-h200-session18-fatbin.py libmlx.so 90 out.so  # zero all but the sm_90 ELFs

The entries' headers stay, so the driver still finds and loads the sm_90 code; only the other
architectures' payloads become zeros, which xz then squeezes away (89.8 MB wheel -> 20 MB
tar.xz with the headers). Layout of a fatbin: a 16-byte header (magic 0xBA55ED50, version,
header size, payload size) followed by entries, each with its own header: kind (1 PTX, 2 ELF),
header size, payload size, and the architecture at byte 28.
"""

import collections
import re
import struct
import subprocess
import sys

MAGIC = 0xBA55ED50


def fatbin_section(path: str) -> tuple[int, int]:
    """(file offset, size) of the .nv_fatbin section."""
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*\[\s*\d+\]\s+\.nv_fatbin\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)",
                     line)  # fmt: skip
        if m:
            return int(m.group(1), 16), int(m.group(2), 16)
    raise SystemExit(f"{path}: no .nv_fatbin section")


def entries(data: bytes, start: int, size: int):
    """Yield (payload offset, payload size, kind, arch) for every entry of every fatbin."""
    pos, end = start, start + size
    while pos < end - 16:
        magic, _, header, payload = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:
            pos += 8  # fatbins are 8-byte aligned within the section
            continue
        p = pos + header
        while p < pos + header + payload:
            kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            yield p + entry_header, entry_size, "ptx" if kind == 1 else "elf", arch
            p += entry_header + entry_size
        pos += header + payload


def main() -> None:
    path = sys.argv[1]
    data = bytearray(open(path, "rb").read())
    found = list(entries(data, *fatbin_section(path)))
    sizes = collections.Counter()
    for _, size, kind, arch in found:
        sizes[(kind, arch)] += size
    for (kind, arch), size in sorted(sizes.items()):
        print(f"{kind} sm_{arch}: {size / 1e6:.1f} MB")
    if len(sys.argv) > 3:
        keep = int(sys.argv[2])
        for start, size, kind, arch in found:
            if not (kind == "elf" and arch == keep):
                data[start : start + size] = bytes(size)
        open(sys.argv[3], "wb").write(data)


if __name__ == "__main__":
    main()
