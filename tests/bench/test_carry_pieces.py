"""bench/_carry.py and bench/carry_pieces.py: a folder split into pieces, joined and verified, and a
missing, short or corrupt piece refused in one line; bench/_fatbin.py's cut on a synthetic library."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from tests.bench import BENCH, REPO, bench_module


@pytest.fixture(scope="module")
def carry():
    return bench_module("_carry")


def _folder(tmp_path):
    src = tmp_path / "src"
    (src / "wheels").mkdir(parents=True)
    (src / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(os.urandom(5000))
    (src / "build").mkdir()
    (src / "build" / "b.tar.gz").write_bytes(os.urandom(2345))
    return src


def test_split_join_verify_round_trip(carry, tmp_path):
    src = _folder(tmp_path)
    root = tmp_path / ".carry"
    m = carry.split(src, root, "te", piece_bytes=4096)
    assert len(m["pieces"]) == -(-m["bytes"] // 4096) >= 3
    assert [p["folder"] for p in m["pieces"]] == [f"te.{i}" for i in range(1, len(m["pieces"]) + 1)]
    assert all(p["bytes"] <= 4096 for p in m["pieces"]) and sum(p["bytes"] for p in m["pieces"]) == m["bytes"]
    for p in m["pieces"]:  # one folder per piece, each with the manifest
        assert sorted(f.name for f in (root / p["folder"]).iterdir()) == sorted([p["file"], "manifest.json"])
    assert carry.read_manifest(root, "te") == m
    out = tmp_path / "out"
    carry.join(root, "te", out)
    for f in ("wheels/a-1.0-py3-none-any.whl", "build/b.tar.gz"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    again = carry.split(src, root, "te", piece_bytes=4096)  # the same files give the same pieces
    assert again["sha256"] == m["sha256"] and again["pieces"] == m["pieces"]


def test_a_missing_short_or_corrupt_piece_is_refused_in_one_line(carry, tmp_path, capsys):
    import carry_pieces

    def _cli(*args):
        code = carry_pieces.main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    src = _folder(tmp_path)
    root = tmp_path / ".carry"
    r = _cli("split", str(src), "--root", str(root), "--name", "te", "--piece-mib", str(4096 / 2**20))
    assert r.returncode == 0 and "in 3 pieces" in r.stdout, r.stderr
    assert _cli("verify", "--root", str(root), "--name", "te").returncode == 0
    piece2 = root / "te.2" / "te.tar.02"
    good = piece2.read_bytes()

    def refused(expect):
        r = _cli("join", "--root", str(root), "--name", "te", "--dest", str(tmp_path / "out"))
        assert r.returncode == 1 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert expect in r.stderr, r.stderr
        assert not (tmp_path / "out").exists()  # nothing unpacked

    piece2.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    refused("piece 2 of ")
    refused("does not match its sha256 in the manifest: carry it again")
    piece2.write_bytes(good[:100])
    refused(f"has 100 bytes, the manifest {len(good)}")
    piece2.unlink()
    refused(f"is missing: carry {root / 'te.2'} in a call first")
    piece2.write_bytes(good)
    for folder in root.iterdir():
        (folder / "manifest.json").unlink()
    refused("no manifest of 'te'")


# ------------------------------------------------------------------------------ the fat-binary cut


def _elf_with_fatbin(containers):
    """A minimal 64-bit ELF: a .nv_fatbin section of the given containers (lists of (arch, payload)),
    bytes before and after it, and the section header table."""
    fat = b""
    for entries in containers:
        body = b""
        for arch, payload, *kind in entries:  # kind 2 (ELF) unless given: 1 is PTX
            header = struct.pack("<HHIQIIHHIIIQQQ", kind[0] if kind else 2, 0x101, 64, len(payload), 0, 0, 0, 0, arch,
                                 0, 0, 0x8011, 0, 0)
            body += header + payload
        fat += struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
    head, tail = b"\x7fELF\x02\x01" + bytes(58) + b"code" * 10, b"symbols" * 3
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_off = len(head)
    names_off = fat_off + len(fat) + len(tail)
    shoff = names_off + len(names)
    sh = bytes(64)  # the null section
    sh += struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, fat_off, len(fat), 0, 0, 8, 0)
    sh += struct.pack("<IIQQQQIIQQ", 12, 3, 0, 0, names_off, len(names), 0, 0, 1, 0)
    data = bytearray(head + fat + tail + names + sh)
    struct.pack_into("<Q", data, 0x28, shoff)
    struct.pack_into("<HHH", data, 0x3A, 64, 3, 2)
    return bytes(data)


def test_the_fatbin_cut_keeps_the_loadable_entries_byte_for_byte(tmp_path):
    _fatbin = bench_module("_fatbin")

    p = lambda tag, n: (tag * n)[:n]  # noqa: E731
    lib = _elf_with_fatbin([[(75, p(b"a", 40)), (80, p(b"b", 48)), (90, p(b"c", 56)), (100, p(b"d", 64)),
                             (90, p(b"e", 24))],
                            [(80, p(b"f", 16)), (120, p(b"g", 32))]])  # no sm_90 entry: left whole
    src, dst = tmp_path / "lib.so", tmp_path / "cut.so"
    src.write_bytes(lib)
    r = _fatbin.cut(src, dst, (90,))
    assert r["containers"] == 2 and r["left_whole"] == 1
    assert r["after"] == {"elf sm_120": {"entries": 1, "bytes": 96}, "elf sm_80": {"entries": 1, "bytes": 80},
                          "elf sm_90": {"entries": 2, "bytes": 208}}
    assert dst.stat().st_size == src.stat().st_size and dst.read_bytes().endswith(lib[-200:])
    _fatbin.verify_cut(src, dst, (90,))
    first = _fatbin.scan(dst.read_bytes())[0]
    assert [(e.arch, dst.read_bytes()[e.offset + 64:e.offset + e.size]) for e in first.entries] == [
        (90, p(b"c", 56)), (90, p(b"e", 24))]
    bad = bytearray(dst.read_bytes())
    bad[first.entries[0].offset + 70] ^= 1  # a kept entry's byte changed
    (tmp_path / "bad.so").write_bytes(bytes(bad))
    with pytest.raises(_fatbin.FatbinError, match="does not hold exactly the loadable entries"):
        _fatbin.verify_cut(src, tmp_path / "bad.so", (90,))
    assert _fatbin.loadable(_fatbin.Entry(0, 8, "elf", 90), 90) and not _fatbin.loadable(_fatbin.Entry(0, 8, "elf", 80), 90)
    assert json.loads(json.dumps(r))  # the report is JSON (prepare.json)


def _wheel(path, name="carried_demo", version="1.0"):
    """A minimal pure wheel holding one module."""
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for f, text in files.items():
            z.writestr(f, text)


def test_install_joins_the_pieces_and_installs_their_wheels(carry, tmp_path, capsys):
    """What the first call runs on the GPU machine: join, check, pip install --no-index --no-deps --target."""
    import carry_pieces

    src = tmp_path / "src" / "wheels"
    src.mkdir(parents=True)
    _wheel(src)
    carry.split(tmp_path / "src", tmp_path / ".carry", "te", piece_bytes=700)
    site = tmp_path / "site"
    assert carry_pieces.main(["install", "--root", str(tmp_path / ".carry"), "--name", "te", "--target", str(site)]) == 0
    assert "pieces verified, 1 wheels installed" in capsys.readouterr().out
    r = subprocess.run([sys.executable, "-c", "import carried_demo; print(carried_demo.VALUE)"],
                       env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True)
    assert r.stdout.strip() == "42", r.stderr


def test_prepare_te_rewrites_the_core_wheel_with_the_cut_library_and_its_record(tmp_path):
    """bench/prepare_te.py's cut step on a wheel holding a synthetic library: the library cut and checked,
    its RECORD line's sha256 and size those of the new bytes, every other member as it was."""
    import base64
    import hashlib
    import zipfile

    _fatbin = bench_module("_fatbin")
    import prepare_te

    lib = _elf_with_fatbin([[(80, b"b" * 48), (90, b"c" * 56), (120, b"d" * 64)]])
    src, dst = tmp_path / "core.whl", tmp_path / "out" / "core.whl"
    record = f"{prepare_te.LIB},sha256=old,{len(lib)}\ntransformer_engine/__init__.py,sha256=x,3\nte.dist-info/RECORD,,\n"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr(prepare_te.LIB, lib)
        z.writestr("transformer_engine/__init__.py", "x=1")
        z.writestr("te.dist-info/RECORD", record)
    r = prepare_te.cut_core(src, dst, 90, tmp_path / "scratch")
    assert r["entries_after"] == {"elf sm_90": {"entries": 1, "bytes": 120}} and r["left_whole"] == 0
    with zipfile.ZipFile(dst) as z:
        new = z.read(prepare_te.LIB)
        assert z.read("transformer_engine/__init__.py") == b"x=1"
        lines = z.read("te.dist-info/RECORD").decode().splitlines()
    (tmp_path / "a.so").write_bytes(lib)
    (tmp_path / "b.so").write_bytes(new)
    _fatbin.verify_cut(tmp_path / "a.so", tmp_path / "b.so", (90,))
    digest = base64.urlsafe_b64encode(hashlib.sha256(new).digest()).rstrip(b"=").decode()
    assert lines == [f"{prepare_te.LIB},sha256={digest},{len(new)}", "transformer_engine/__init__.py,sha256=x,3",
                     "te.dist-info/RECORD,,"]


def test_the_fatbin_cut_keeps_ptx_the_device_could_jit_beside_its_cubin(tmp_path):
    """TE 2.12.0's fat binaries hold PTX too: kept where its arch is at most the device's, dropped above."""
    _fatbin = bench_module("_fatbin")

    lib = _elf_with_fatbin([[(80, b"a" * 16), (80, b"p" * 24, 1), (90, b"c" * 32), (90, b"q" * 40, 1),
                             (100, b"r" * 8, 1)]])
    src, dst = tmp_path / "lib.so", tmp_path / "cut.so"
    src.write_bytes(lib)
    r = _fatbin.cut(src, dst, (90,))
    assert r["left_whole"] == 0 and r["after"] == {"elf sm_90": {"entries": 1, "bytes": 96},
                                                   "ptx sm_80": {"entries": 1, "bytes": 88},
                                                   "ptx sm_90": {"entries": 1, "bytes": 104}}
    _fatbin.verify_cut(src, dst, (90,))
