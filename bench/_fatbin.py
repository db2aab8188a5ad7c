"""A shared library's CUDA fat binaries cut to the GPU architectures one device runs.

A library built for many architectures (``libtransformer_engine.so``: sm_75 ... sm_120) holds, in its
``.nv_fatbin`` section, one container per translation unit, each with a machine-code (ELF) entry per
architecture. The driver loads, for a device of compute capability 9.0, an ELF entry of the 9.x family
or JIT-compiles a PTX entry; cubins of another major version never run there. ``cut`` keeps in each
container only the entries a device of ``keep`` arches can load and moves them to the container's
front (each entry keeps its bytes, offsets stay 8-byte aligned as the linker laid them); the freed
bytes are zeroed, so the section and every address in the library stay where they were and the
file compresses to what is kept. PTX the device could JIT (of at most its arch) is kept beside its
cubin; a container with nothing to keep is left whole.

Layout (as the linker writes it; little-endian): container header ``magic 0xBA55ED50 (u32), version
(u16), header size (u16), size of what follows (u64)``; then entries, each ``kind (u16: 1 PTX,
2 ELF), version (u16), header size (u32), payload size (u64), ..., arch (u32 at byte 28)``, the
payload right after its header. ``scan`` reads it; ``cut`` and ``verify_cut`` use it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

MAGIC = 0xBA55ED50
KIND = {1: "ptx", 2: "elf"}


class FatbinError(ValueError):
    """A library whose fat binaries this module cannot read as laid out above."""


@dataclass(frozen=True)
class Entry:
    offset: int  # in the file
    size: int  # header + payload
    kind: str
    arch: int


@dataclass(frozen=True)
class Container:
    offset: int
    header_size: int
    size: int  # header + entries
    entries: Tuple[Entry, ...]


def section(data: bytes, name: bytes = b".nv_fatbin") -> Tuple[int, int]:
    """(file offset, size) of a section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = sections[shstrndx][4]
    for sh_name, _, _, _, off, size in sections:
        end = data.index(b"\0", names_off + sh_name)
        if data[names_off + sh_name:end] == name:
            return off, size
    raise FatbinError(f"no {name.decode()} section")


def scan(data: bytes) -> List[Container]:
    """The fat-binary containers of the ``.nv_fatbin`` section (zero words between them are skipped)."""
    off, size = section(data)
    pos, end, out = off, off + size, []
    while pos < end:
        magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:
            if data[pos:pos + 8].strip(b"\0"):
                raise FatbinError(f"no fat-binary header at offset {pos}")
            pos += 8
            continue
        e, cend, entries = pos + hsize, pos + hsize + fsize, []
        while e < cend:
            kind, _, ehs, psize = struct.unpack_from("<HHIQ", data, e)
            arch, = struct.unpack_from("<I", data, e + 28)
            if ehs + psize <= 0 or e + ehs + psize > cend:
                raise FatbinError(f"entry at offset {e} runs past its container")
            entries.append(Entry(e, ehs + psize, KIND.get(kind, str(kind)), arch))
            e += ehs + psize
        out.append(Container(pos, hsize, hsize + fsize, tuple(entries)))
        pos = cend
    return out


def loadable(entry: Entry, arch: int) -> bool:
    """Whether a device of ``arch`` (90 for sm_90) can load ``entry``: an ELF entry of its major
    version at most its minor (sm_90a's entry is arch 90 too), or PTX of at most its arch."""
    if entry.kind == "elf":
        return entry.arch // 10 == arch // 10 and entry.arch <= arch
    return entry.kind == "ptx" and entry.arch <= arch


def summary(containers: Iterable[Container]) -> Dict[str, Dict[str, int]]:
    """``{"elf sm_90": {"entries": n, "bytes": b}, ...}``"""
    out: Dict[str, Dict[str, int]] = {}
    for c in containers:
        for e in c.entries:
            s = out.setdefault(f"{e.kind} sm_{e.arch}", {"entries": 0, "bytes": 0})
            s["entries"] += 1
            s["bytes"] += e.size
    return dict(sorted(out.items()))


def cut(src: Path, dst: Path, keep: Tuple[int, ...] = (90,)) -> Dict[str, object]:
    """Write ``src`` to ``dst`` with each container holding only the entries a device of one of ``keep``
    loads (see the module docstring); returns what was kept and dropped."""
    data = bytearray(Path(src).read_bytes())
    containers = scan(bytes(data))
    whole = 0
    for c in containers:
        kept = [e for e in c.entries if any(loadable(e, a) for a in keep)]
        if not kept:
            whole += 1
            continue
        body = b"".join(bytes(data[e.offset:e.offset + e.size]) for e in kept)
        start = c.offset + c.header_size
        data[start:c.offset + c.size] = body + bytes(c.size - c.header_size - len(body))
        struct.pack_into("<Q", data, c.offset + 8, len(body))
    Path(dst).write_bytes(data)
    return {"containers": len(containers), "left_whole": whole, "before": summary(containers),
            "after": summary(scan(bytes(data)))}


def _digest(data: bytes, e: Entry) -> str:
    return hashlib.sha256(data[e.offset:e.offset + e.size]).hexdigest()


def verify_cut(src: Path, dst: Path, keep: Tuple[int, ...] = (90,)) -> None:
    """Raise FatbinError unless ``dst`` is ``src`` cut to ``keep``: the same bytes outside the fat-binary
    section, the same containers at the same offsets, each holding exactly the original's loadable
    entries, byte for byte and in order, and nothing else."""
    a, b = Path(src).read_bytes(), Path(dst).read_bytes()
    off, size = section(a)
    if len(a) != len(b) or a[:off] != b[:off] or a[off + size:] != b[off + size:]:
        raise FatbinError(f"{dst}: differs from {src} outside the .nv_fatbin section")
    before, after = scan(a), scan(b)
    if [c.offset for c in before] != [c.offset for c in after]:
        raise FatbinError(f"{dst}: the fat-binary containers moved")
    for c, d in zip(before, after):
        want = [e for e in c.entries if any(loadable(e, k) for k in keep)] or list(c.entries)
        if [_digest(a, e) for e in want] != [_digest(b, e) for e in d.entries]:
            raise FatbinError(f"{dst}: the container at offset {c.offset} does not hold exactly the loadable "
                              f"entries of {src}")
