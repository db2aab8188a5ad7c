"""Files too large for one call to the GPU machine, carried in pieces: split here, joined there.

A call to the GPU machine takes at most 64 MiB of working tree along, but a warm machine keeps the
git-ignored folders earlier calls carried. ``split`` packs a folder of files into one uncompressed tar
stream (the files are wheels, compressed already) and cuts it into pieces under ``PIECE_BYTES``, one
git-ignored folder per piece (``ROOT/NAME.1``, ``ROOT/NAME.2``, ...), each holding its piece and a copy
of the manifest: the pieces' names, sizes and sha256 in join order, and the whole stream's and each
packed file's. ``join`` (on the GPU machine) checks every piece against the manifest, joins them,
checks the whole, and unpacks it; a missing, short or corrupt piece is refused in one line that names
it. ``bench/carry_pieces.py`` is the command line over these.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Dict, List, Optional

PIECE_BYTES = 60 * 2**20 - 2**16  # under 60 MiB, leaving the rest of a call's 64 MiB for the working tree
MANIFEST = "manifest.json"
CHUNK = 2**22


class CarryError(Exception):
    """A piece or manifest that does not match; the message is the one line to show."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def piece_dir(root: Path, name: str, index: int) -> Path:
    """The folder of piece ``index`` (1-based): ``ROOT/NAME.INDEX``."""
    return Path(root) / f"{name}.{index}"


def _pack(src: Path) -> bytes:
    """The files under ``src`` as an uncompressed tar, in sorted order, with fixed owners and times
    (the same files give the same bytes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in Path(src).rglob("*") if p.is_file()):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(src)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def split(src: Path, root: Path, name: str, piece_bytes: int = PIECE_BYTES) -> Dict[str, Any]:
    """Pack the files under ``src`` and cut the stream into pieces under ``root``; returns the manifest
    (also written into every piece's folder). Earlier pieces of ``name`` under ``root`` are removed."""
    if not 0 < piece_bytes:
        raise CarryError(f"piece size must be positive (got {piece_bytes})")
    files = sorted(p for p in Path(src).rglob("*") if p.is_file())
    if not files:
        raise CarryError(f"{src}: no files to split")
    for old in Path(root).glob(f"{name}.*"):
        if old.is_dir() and old.name[len(name) + 1:].isdigit():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    stream = _pack(Path(src))
    pieces = []
    for i, start in enumerate(range(0, len(stream), piece_bytes), 1):
        part = stream[start:start + piece_bytes]
        folder = piece_dir(root, name, i)
        folder.mkdir(parents=True, exist_ok=True)
        fname = f"{name}.tar.{i:02d}"
        (folder / fname).write_bytes(part)
        pieces.append({"folder": folder.name, "file": fname, "bytes": len(part),
                       "sha256": hashlib.sha256(part).hexdigest()})
    manifest = {"name": name, "format": "tar pieces, joined in the order listed", "bytes": len(stream),
                "sha256": hashlib.sha256(stream).hexdigest(), "pieces": pieces,
                "files": [{"path": str(p.relative_to(src)), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                          for p in files]}
    for p in pieces:
        (Path(root) / p["folder"] / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(root: Path, name: str) -> Dict[str, Any]:
    """The manifest of ``name`` from the first piece folder under ``root`` that holds one."""
    for folder in sorted(Path(root).glob(f"{name}.*")):
        if (folder / MANIFEST).is_file():
            try:
                return json.loads((folder / MANIFEST).read_text())
            except json.JSONDecodeError as e:
                raise CarryError(f"{folder / MANIFEST}: not JSON ({e})") from None
    raise CarryError(f"no manifest of {name!r} under {root} (expected {root}/{name}.1/{MANIFEST}); carry its pieces")


def check_pieces(root: Path, manifest: Dict[str, Any]) -> List[Path]:
    """Every piece present, of its size and sha256; the paths in join order. Raises CarryError naming
    the first piece that is missing or does not match, and the call that carries it."""
    paths = []
    n = len(manifest["pieces"])
    for i, p in enumerate(manifest["pieces"], 1):
        path = Path(root) / p["folder"] / p["file"]
        where = f"piece {i} of {n} ({path})"
        if not path.is_file():
            raise CarryError(f"{where} is missing: carry {Path(root) / p['folder']} in a call first")
        size = path.stat().st_size
        if size != p["bytes"]:
            raise CarryError(f"{where} has {size} bytes, the manifest {p['bytes']}: carry it again")
        if sha256_file(path) != p["sha256"]:
            raise CarryError(f"{where} does not match its sha256 in the manifest: carry it again")
        paths.append(path)
    return paths


def join(root: Path, name: str, dest: Path, manifest: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Check the pieces of ``name`` under ``root``, join them, check the whole stream and unpack it into
    ``dest``; each unpacked file is checked against the manifest too. Returns the manifest."""
    manifest = manifest or read_manifest(root, name)
    paths = check_pieces(root, manifest)
    h, buf = hashlib.sha256(), io.BytesIO()
    for path in paths:
        data = path.read_bytes()
        h.update(data)
        buf.write(data)
    if h.hexdigest() != manifest["sha256"]:
        raise CarryError(f"the joined pieces of {name} do not match the manifest's sha256: split them again here")
    buf.seek(0)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=buf, mode="r:") as tar:
        members = tar.getmembers()
        for m in members:  # only plain files, inside dest
            target = (dest / m.name).resolve()
            if not m.isfile() or os.path.commonpath([target, dest.resolve()]) != str(dest.resolve()):
                raise CarryError(f"{name}: the packed stream holds {m.name!r}, not a plain file under {dest}")
        tar.extractall(dest, members=members)
    for f in manifest["files"]:
        path = dest / f["path"]
        if not path.is_file() or sha256_file(path) != f["sha256"]:
            raise CarryError(f"{path}: unpacked file does not match its sha256 in the manifest")
    return manifest
