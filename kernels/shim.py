"""Write a tiny x86-64 ELF shared object that forwards symbols to other names.

numpy's OpenBLAS wheels (``scipy-openblas32``) export ``scipy_cblas_sgemm`` etc., while MLX
links plain ``cblas_sgemm``. This module writes, with no C compiler, a shared library whose
exported ``cblas_sgemm`` jumps to ``scipy_cblas_sgemm`` through a GOT slot filled by the
dynamic linker (an R_X86_64_64 relocation), so the call costs one jump.

An export may instead be a small routine that picks among several targets: `GEMV_DISPATCH`
sends single-row products (``M == 1``: every matmul of a decode step) to ``sgemv``, which
OpenBLAS runs at several times the memory bandwidth of ``sgemm`` with one row.

Layout (no section headers; glibc's loader only reads program headers and DT_* entries):
  page 0 (R+X): ELF header, program headers, .hash, .dynsym, .dynstr, .rela.dyn, routines
  page 1 (RW):  .dynamic, GOT (one 8-byte slot per target symbol)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Routine:
    """Machine code for one export; each `jumps` entry is (offset of a rip-relative disp32
    inside `code`, target symbol): the disp32 is patched to that target's GOT slot."""

    code: bytes
    jumps: tuple[tuple[int, str], ...]


def jump_to(target: str) -> Routine:
    """`jmp qword ptr [rip + GOT(target)]`: a plain forward."""
    return Routine(b"\xff\x25\0\0\0\0", ((2, target),))


def gemv_dispatch(sgemm: str, sgemv: str) -> Routine:
    """``cblas_sgemm`` that runs a row-major single-row product (M == 1) as ``cblas_sgemv``.

    C[1, N] = alpha * op(A)[1, K] @ op(B)[K, N] + beta * C is y = op(B)^T x + beta * y with x
    the row of op(A) (stride 1, or lda when A is transposed): ``sgemv(RowMajor, B stored
    [N, K] ? NoTrans : Trans, rows, cols, alpha, B, ldb, A, incx, beta, C, 1)``. The seven
    stack arguments of sgemm become sgemv's four in place, then a tail jump. Anything else
    (M > 1, column-major, conjugate transposes) jumps to ``sgemm`` unchanged. Source (GNU as,
    Intel syntax); the bytes below are its assembly:

        cmp ecx, 1 ; jne 9f                      # M == 1
        cmp edi, 101 ; jne 9f                    # CblasRowMajor
        lea eax, [rdx-111] ; cmp eax, 1 ; ja 9f  # TransB in {NoTrans, Trans}
        lea eax, [rsi-111] ; cmp eax, 1 ; ja 9f  # TransA in {NoTrans, Trans}
        cmp esi, 111 ; jne 1f                    # incx = 1, or lda (already in its slot)
        mov qword ptr [rsp+16], 1
    1:  mov eax, r8d ; mov r10d, r9d             # N, K
        cmp edx, 112 ; je 2f
        mov esi, 112 ; mov edx, r10d ; mov ecx, eax ; jmp 3f   # B is [K, N]: y = B^T x
    2:  mov esi, 111 ; mov edx, eax ; mov ecx, r10d            # B is [N, K]: y = B x
    3:  mov r8, [rsp+24] ; mov r9, [rsp+32]      # the matrix B and ldb
        mov rax, [rsp+40] ; mov [rsp+24], rax    # y = C
        mov qword ptr [rsp+32], 1                # incy = 1
        jmp qword ptr [rip + GOT(sgemv)]
    9:  jmp qword ptr [rip + GOT(sgemm)]
    """
    code = bytes.fromhex(
        "83f901756783ff6575628d429183f801775a8d469183f801775283fe6f750948c74424100100"
        "00004489c04589ca83fa70740cbe700000004489d289c1eb0abe6f00000089c24489d14c8b44"
        "24184c8b4c2420488b442428488944241848c744242001000000ff2500000000ff2500000000"
    )
    return Routine(code, ((0x68, sgemv), (0x6E, sgemm)))


def forwarding_library(
    forwards: dict[str, str],
    soname: str,
    needed: list[str],
    routines: dict[str, Routine] | None = None,
) -> bytes:
    """Bytes of an x86-64 ELF shared object exporting each key of `forwards` as a jump to its
    value, and each key of `routines` as that routine."""
    exports = {name: jump_to(target) for name, target in forwards.items()} | (routines or {})
    names = list(exports)
    targets = list(dict.fromkeys(t for r in exports.values() for _, t in r.jumps))
    n, m = len(names), len(targets)
    # String table: offset 0 is the empty string.
    strtab = bytearray(b"\0")
    offsets: dict[str, int] = {}
    for s in [soname, *needed, *names, *targets]:
        if s not in offsets:
            offsets[s] = len(strtab)
            strtab += s.encode() + b"\0"

    nsym = 1 + n + m  # null, the exports, the undefined targets
    nphdr = 4
    hash_off = 64 + 56 * nphdr
    hash_size = 4 * (2 + n + nsym)  # nbucket = n, nchain = nsym
    sym_off = hash_off + hash_size
    sym_off += -sym_off % 8
    str_off = sym_off + 24 * nsym
    rela_off = str_off + len(strtab)
    rela_off += -rela_off % 8
    text_off = rela_off + 24 * m
    code_at = []
    for name in names:  # each routine 16-byte aligned
        text_off += -text_off % 16
        code_at.append(text_off)
        text_off += len(exports[name].code)
    text_end = text_off
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
        ("RELASZ", 24 * m),
        ("RELAENT", 24),
        ("NULL", 0),
    ]
    got_off = dyn_off + 16 * len(dyn_entries)
    data_end = got_off + 8 * m

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

    # Symbols 1..n: the exports (defined in "section 1"); n+1..n+m: undefined targets.
    info = (_STB_GLOBAL << 4) | _STT_FUNC
    for i, name in enumerate(names):
        struct.pack_into("<IBBHQQ", out, sym_off + 24 * (1 + i), offsets[name], info, 0, 1,
                         code_at[i], len(exports[name].code))  # fmt: skip
    for j, target in enumerate(targets):
        struct.pack_into("<IBBHQQ", out, sym_off + 24 * (1 + n + j), offsets[target],
                         info, 0, 0, 0, 0)  # fmt: skip
    # SysV hash over the exported names (undefined symbols need no bucket entry).
    buckets, chains = [0] * n, [0] * nsym
    for i, name in enumerate(names):
        b = _elf_hash(name.encode()) % n
        chains[1 + i], buckets[b] = buckets[b], 1 + i
    struct.pack_into(f"<II{n}I{nsym}I", out, hash_off, n, nsym, *buckets, *chains)
    out[str_off : str_off + len(strtab)] = strtab
    for j in range(m):
        # GOT slot j = address of target symbol j (R_X86_64_64: S + A).
        r_info = ((1 + n + j) << 32) | _R_X86_64_64
        struct.pack_into("<QQq", out, rela_off + 24 * j, got_off + 8 * j, r_info, 0)
    for i, name in enumerate(names):
        routine, at = exports[name], code_at[i]
        out[at : at + len(routine.code)] = routine.code
        for disp_at, target in routine.jumps:
            # rip-relative: the displacement counts from the end of the 4-byte field.
            slot = got_off + 8 * targets.index(target)
            struct.pack_into("<i", out, at + disp_at, slot - (at + disp_at + 4))
    for i, (tag, val) in enumerate(dyn_entries):
        struct.pack_into("<qQ", out, dyn_off + 16 * i, _DT[tag], val)
    return bytes(out)
