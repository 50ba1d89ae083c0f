"""Write a tiny x86-64 ELF shared object that forwards symbols to other names.

numpy's OpenBLAS wheels (``scipy-openblas32``) export ``scipy_cblas_sgemm`` etc., while MLX
links plain ``cblas_sgemm``. This module writes, with no C compiler, a shared library whose
exported ``cblas_sgemm`` is a single ``jmp *GOT`` stub to ``scipy_cblas_sgemm``; the GOT slot
is filled by the dynamic linker (an R_X86_64_64 relocation), so the call costs one jump.

Layout (no section headers; glibc's loader only reads program headers and DT_* entries):
  page 0 (R+X): ELF header, program headers, .hash, .dynsym, .dynstr, .rela.dyn, stubs
  page 1 (RW):  .dynamic, GOT (one 8-byte slot per forwarded symbol)
"""

from __future__ import annotations

import struct

_PAGE = 0x1000
_PT_LOAD, _PT_DYNAMIC, _PT_GNU_STACK = 1, 2, 0x6474E551
_PF_X, _PF_W, _PF_R = 1, 2, 4
_DT = {
    "NULL": 0, "NEEDED": 1, "HASH": 4, "STRTAB": 5, "SYMTAB": 6, "RELA": 7, "RELASZ": 8,
    "RELAENT": 9, "STRSZ": 10, "SYMENT": 11, "SONAME": 14,
}  # fmt: skip
_R_X86_64_64 = 1
_STB_GLOBAL, _STT_FUNC = 1, 2


def _elf_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        hi = h & 0xF0000000
        if hi:
            h ^= hi >> 24
        h &= ~hi & 0xFFFFFFFF
    return h


def forwarding_library(forwards: dict[str, str], soname: str, needed: list[str]) -> bytes:
    """Bytes of an x86-64 ELF shared object exporting each key as a jump to its value."""
    names = list(forwards)
    n = len(names)
    # String table: offset 0 is the empty string.
    strtab = bytearray(b"\0")
    offsets: dict[str, int] = {}
    for s in [soname, *needed, *names, *forwards.values()]:
        if s not in offsets:
            offsets[s] = len(strtab)
            strtab += s.encode() + b"\0"

    nsym = 1 + 2 * n  # null, n exported stubs, n undefined targets
    nphdr = 4
    hash_off = 64 + 56 * nphdr
    hash_size = 4 * (2 + n + nsym)  # nbucket = n, nchain = nsym
    sym_off = hash_off + hash_size
    sym_off += -sym_off % 8
    str_off = sym_off + 24 * nsym
    rela_off = str_off + len(strtab)
    rela_off += -rela_off % 8
    text_off = rela_off + 24 * n
    text_off += -text_off % 16
    text_end = text_off + 8 * n
    if text_end > _PAGE:
        raise ValueError("too many symbols for one page")

    dyn_off = _PAGE
    dyn_entries = [("NEEDED", offsets[s]) for s in needed] + [
        ("SONAME", offsets[soname]),
        ("HASH", hash_off),
        ("STRTAB", str_off),
        ("SYMTAB", sym_off),
        ("STRSZ", len(strtab)),
        ("SYMENT", 24),
        ("RELA", rela_off),
        ("RELASZ", 24 * n),
        ("RELAENT", 24),
        ("NULL", 0),
    ]
    got_off = dyn_off + 16 * len(dyn_entries)
    data_end = got_off + 8 * n

    out = bytearray(data_end)
    # ELF header: 64-bit, little endian, ET_DYN, EM_X86_64, no section headers.
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    out[0:64] = ident + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, 0, 0, 64, 56, nphdr, 64, 0, 0
    )
    phdrs = [
        (_PT_LOAD, _PF_R | _PF_X, 0, 0, text_end, text_end, _PAGE),
        (_PT_LOAD, _PF_R | _PF_W, dyn_off, dyn_off, data_end - dyn_off, data_end - dyn_off, _PAGE),
        (_PT_DYNAMIC, _PF_R | _PF_W, dyn_off, dyn_off, got_off - dyn_off, got_off - dyn_off, 8),
        # Without PT_GNU_STACK the loader assumes an executable stack, which dlopen refuses.
        (_PT_GNU_STACK, _PF_R | _PF_W, 0, 0, 0, 0, 16),
    ]
    for i, (typ, flags, off, addr, filesz, memsz, align) in enumerate(phdrs):
        struct.pack_into(
            "<IIQQQQQQ", out, 64 + 56 * i, typ, flags, off, addr, addr, filesz, memsz, align
        )

    # Symbols 1..n: exported stubs (defined in "section 1"); n+1..2n: undefined targets.
    for i, name in enumerate(names):
        info = (_STB_GLOBAL << 4) | _STT_FUNC
        struct.pack_into("<IBBHQQ", out, sym_off + 24 * (1 + i), offsets[name], info, 0, 1,
                         text_off + 8 * i, 8)  # fmt: skip
        struct.pack_into("<IBBHQQ", out, sym_off + 24 * (1 + n + i), offsets[forwards[name]],
                         info, 0, 0, 0, 0)  # fmt: skip
    # SysV hash over the exported names (undefined symbols need no bucket entry).
    buckets, chains = [0] * n, [0] * nsym
    for i, name in enumerate(names):
        b = _elf_hash(name.encode()) % n
        chains[1 + i], buckets[b] = buckets[b], 1 + i
    struct.pack_into(f"<II{n}I{nsym}I", out, hash_off, n, nsym, *buckets, *chains)
    out[str_off : str_off + len(strtab)] = strtab
    for i in range(n):
        # GOT slot i = address of target symbol (R_X86_64_64: S + A).
        r_info = ((1 + n + i) << 32) | _R_X86_64_64
        struct.pack_into("<QQq", out, rela_off + 24 * i, got_off + 8 * i, r_info, 0)
        # jmp qword ptr [rip + disp32]; rip is the end of this 6-byte instruction.
        stub = text_off + 8 * i
        disp = got_off + 8 * i - (stub + 6)
        out[stub : stub + 8] = b"\xff\x25" + struct.pack("<i", disp) + b"\xcc\xcc"
    for i, (tag, val) in enumerate(dyn_entries):
        struct.pack_into("<qQ", out, dyn_off + 16 * i, _DT[tag], val)
    return bytes(out)
