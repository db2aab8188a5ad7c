#!/usr/bin/env python
"""Split a folder of files into carry-sized pieces here; join, verify and install them on the GPU machine.

    python bench/carry_pieces.py split SRC --root .carry --name te      # here: .carry/te.1, te.2, ... + manifest
    python bench/carry_pieces.py verify --root .carry --name te         # every piece's size and sha256
    python bench/carry_pieces.py join --root .carry --name te --dest DIR
    python bench/carry_pieces.py install --root .carry --name te --target WORK/site   # there: join + pip --no-deps

``bench/_carry.py`` holds the functions; a missing or corrupt piece is refused in one line (exit 1).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _carry import PIECE_BYTES, CarryError, check_pieces, join, read_manifest, split  # noqa: E402


def install(root: Path, name: str, target: Path) -> int:
    """Join the pieces into a scratch folder and ``pip install --no-index --no-deps --target`` its wheels."""
    with tempfile.TemporaryDirectory(prefix=f"{name}-joined-") as tmp:
        manifest = join(root, name, Path(tmp))
        wheels = sorted(str(p) for p in Path(tmp).rglob("*.whl"))
        if not wheels:
            raise CarryError(f"the pieces of {name} hold no wheel ({len(manifest['files'])} files)")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(target), *wheels])
        if r.returncode:
            raise CarryError(f"pip install of {len(wheels)} wheels into {target} exited {r.returncode}")
    print(f"carry_pieces: {name}: {len(manifest['pieces'])} pieces verified, {len(wheels)} wheels installed in {target}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Carry a folder to the GPU machine in pieces (bench/_carry.py).")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="pack SRC's files and cut them into pieces under --root")
    s.add_argument("src")
    s.add_argument("--piece-mib", type=float, default=PIECE_BYTES / 2**20,
                   help=f"largest piece in MiB (default {PIECE_BYTES / 2**20:.2f})")
    for name in ("verify", "join", "install"):
        sub.add_parser(name)
    for sp in sub.choices.values():
        sp.add_argument("--root", default=".carry", help="folder of the piece folders (default .carry)")
        sp.add_argument("--name", required=True, help="the pieces' name (folders ROOT/NAME.1, NAME.2, ...)")
    sub.choices["join"].add_argument("--dest", required=True, help="folder to unpack into")
    sub.choices["install"].add_argument("--target", required=True, help="pip --target folder")
    a = p.parse_args(argv)
    root = Path(a.root)
    try:
        if a.cmd == "split":
            if not Path(a.src).is_dir():
                p.error(f"{a.src}: not a folder")
            m = split(Path(a.src), root, a.name, int(a.piece_mib * 2**20))
            for piece in m["pieces"]:
                print(f"{root / piece['folder']}: {piece['bytes'] / 2**20:.1f} MiB sha256 {piece['sha256'][:16]}")
            print(f"carry_pieces: {len(m['files'])} files, {m['bytes'] / 2**20:.1f} MiB in {len(m['pieces'])} pieces")
        elif a.cmd == "verify":
            m = read_manifest(root, a.name)
            check_pieces(root, m)
            print(f"carry_pieces: {a.name}: {len(m['pieces'])} pieces match the manifest")
        elif a.cmd == "join":
            m = join(root, a.name, Path(a.dest))
            print(f"carry_pieces: {a.name}: {len(m['files'])} files in {a.dest}")
        else:
            return install(root, a.name, Path(a.target))
    except CarryError as e:
        print(f"carry_pieces: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
