"""Checksums of a checkpoint's files: recorded at save, verified before a load.

A save's files (the ``.distcp`` shards, ``.metadata``, ``common.pt``, ``metadata.json``) can change after
they were written without changing size: bit rot on a shared filesystem, an interrupted copy between
clusters, a bad object-store upload. Nothing in dist_checkpointing's format tells such a file from a good
one, and a damaged shard loads and trains on. So every save records ``checksums.json`` beside the data,
``{"algorithm": "crc32", "files": {name: {"bytes": N, "crc32": "8 hex digits"}}}``, and every load checks
it first.

Design choices:
- CRC32 from the standard library (``zlib.crc32``, streamed in 8 MiB blocks, about 1.6 GB/s a core): it
  finds any change of a few bytes, costs no dependency, and is not a security measure (it is not meant to).
- Each rank hashes the files it wrote itself (``__RANK_N.distcp``, the global rank, as torch's and
  megatron-core's writers name them; rank 0 also the files written once) once every rank's writes have
  finished (the save's closing barrier), reading them back while they are likely still in the page
  cache: the sum is of what the filesystem holds then, so damage from then on is found (a write the
  kernel took but never stored is not). Rank 0 writes the manifest before ``config.yaml``, the save's
  last file, so a complete checkpoint always has one. A file whose name does not carry its rank (say a
  writer given a ``separation_hint`` prefix) is hashed by rank 0.
- A load spreads the verification over its ranks (file ``i`` on rank ``i % world``): the checkpoint is
  read once more in all, not once per rank. Rank 0 reads the manifest and sends it to the others, and
  every rank's verdict (damage, or an error of its own filesystem) goes through one collective, so all
  ranks stop with the same line or go on together.
- ``config.yaml`` stays the save's last file (with ``metadata.json``, the mark of a complete save): rank 0
  records the CRC32 of the bytes it is about to write there in the manifest written before it. Every load
  also compares it with the arguments saved inside the (covered) common state and names the keys that
  differ, so an edit is refused with or without checksums.
- A checkpoint written before checksums has no manifest: it loads with one warning line. One whose own
  common state says its save recorded checksums (``checksums``, or its saved ``no_ckpt_checksums`` off) is
  refused without its manifest: deleting ``checksums.json`` must not turn the verification off, nor the
  next save record sums of an unverified state (``--allow-missing-ckpt-checksums`` accepts it, said in a
  warning line).

Plain functions over paths; the collectives are the caller's (``sharded``).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Dict, Iterable, List, Optional, Tuple

MANIFEST = "checksums.json"
ALGORITHM = "crc32"
_BLOCK = 8 << 20
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
# Files not hashed from disk: the manifest, and config.yaml, written after it (its entry is of the bytes the
# save is about to write: ``bytes_entry``).
_NOT_COVERED = {MANIFEST, "config.yaml"}

# Kinds of damage, in the order a load reports them.
MISSING, WRONG_SIZE, WRONG_SUM, UNREADABLE = 0, 1, 2, 3
_WHAT = {MISSING: "missing", UNREADABLE: "unreadable"}

Entry = Tuple[int, int]  # (bytes, crc32)


def file_crc32(path: str) -> Entry:
    """(size in bytes, CRC32) of the file ``path``, read in blocks."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def bytes_entry(data: bytes) -> Entry:
    """(size, CRC32) of ``data``, a file's bytes about to be written."""
    return len(data), zlib.crc32(data)


def covered_files(path: str) -> List[str]:
    """The files of the save in ``path`` a manifest covers (sorted names)."""
    return sorted(n for n in os.listdir(path)
                  if n not in _NOT_COVERED and (not n.startswith(".") or n == ".metadata")
                  and os.path.isfile(os.path.join(path, n)))


def files_written_by(path: str, rank: int) -> List[str]:
    """The files of the save in ``path`` that rank ``rank`` wrote: its own shards ``__RANK_0.distcp``,
    ``__RANK_1.distcp``, ... (probed by name: a rank touches about as many paths as it wrote, not the
    whole folder, which on a parallel filesystem would be world x files lookups at every save), and for
    rank 0 every other covered file (``.metadata``, ``common.pt``, ``metadata.json``). A shard past a gap
    in the numbering is not found here; rank 0 hashes it as :func:`uncovered`."""
    names = []
    while os.path.isfile(os.path.join(path, f"__{rank}_{len(names)}.distcp")):
        names.append(f"__{rank}_{len(names)}.distcp")
    if rank == 0:
        names += [n for n in covered_files(path) if not _SHARD.match(n)]
    return names


def hash_files(path: str, names: Iterable[str]) -> Dict[str, Entry]:
    return {name: file_crc32(os.path.join(path, name)) for name in names}


def uncovered(path: str, entries: Dict[str, Entry]) -> List[str]:
    """Covered files of ``path`` missing from ``entries`` (a shard whose name does not tell a rank that
    saved): rank 0 hashes these too."""
    return [n for n in covered_files(path) if n not in entries]


def write_manifest(path: str, entries: Dict[str, Entry]) -> None:
    """Write ``checksums.json`` into ``path`` (under a temporary name, then renamed: never half-written)."""
    body = {"algorithm": ALGORITHM,
            "files": {n: {"bytes": int(b), ALGORITHM: f"{int(c):08x}"} for n, (b, c) in sorted(entries.items())}}
    tmp = os.path.join(path, f".{MANIFEST}.partial")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


class ManifestError(ValueError):
    """``checksums.json`` is unreadable or not one this release writes (the message says which)."""


def read_manifest(path: str) -> Optional[Dict[str, Entry]]:
    """{name: (bytes, crc32)} from ``path``'s manifest; None when the checkpoint has none (written before
    checksums). A manifest that does not parse raises :class:`ManifestError`."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, "r", encoding="utf-8") as f:
            body = json.load(f)
        if body.get("algorithm") != ALGORITHM:
            raise ManifestError(f"algorithm {body.get('algorithm')!r} is not {ALGORITHM!r} (a newer release's?)")
        return {str(n): (int(e["bytes"]), int(e[ALGORITHM], 16)) for n, e in body["files"].items()}
    except ManifestError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestError(f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def check_file(path: str, name: str, expected: Entry) -> Optional[int]:
    """The kind of damage of file ``name`` (MISSING, WRONG_SIZE, WRONG_SUM, UNREADABLE), or None."""
    file = os.path.join(path, name)
    try:
        if not os.path.isfile(file):
            return MISSING
        if os.path.getsize(file) != expected[0]:
            return WRONG_SIZE
        got = file_crc32(file)
    except OSError:  # an I/O error, or the file gone between the two looks
        return UNREADABLE
    return None if got == expected else WRONG_SUM


def first_damage(path: str, manifest: Dict[str, Entry], rank: int = 0, world: int = 1) -> Optional[Tuple[int, int]]:
    """(index in the sorted manifest, kind) of the first damaged file among this rank's share
    (``sorted(manifest)[rank::world]``), or None."""
    names = sorted(manifest)
    for i in range(rank, len(names), world):
        kind = check_file(path, names[i], manifest[names[i]])
        if kind is not None:
            return i, kind
    return None


def describe(path: str, manifest: Dict[str, Entry], index: int, kind: int) -> Tuple[str, str]:
    """(file, what is wrong) for damage ``(index, kind)`` of :func:`first_damage`."""
    name = sorted(manifest)[index]
    size, crc = manifest[name]
    what = _WHAT.get(kind, "unreadable")
    if kind == WRONG_SIZE:
        try:
            what = f"{os.path.getsize(os.path.join(path, name)):,} bytes where the save wrote {size:,}"
        except OSError:  # seen by another rank; gone or unreadable here
            what = f"not the {size:,} bytes the save wrote"
    elif kind == WRONG_SUM:
        what = f"its bytes changed after the save (CRC32 differs from the {crc:08x} recorded in {MANIFEST})"
    return os.path.join(path, name), what


def no_manifest_warning(path: str) -> str:
    return (f"WARNING: {path}: written without {MANIFEST} (an older release, or checksums were off); "
            "its files are checked for size only, not for changed bytes")
