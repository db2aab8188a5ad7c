"""Streaming readers for .jsonl, .jsonl.gz and .jsonl.zst (bounded memory, line numbers kept)."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from contextlib import contextmanager
from typing import Iterator, List, Sequence, Tuple

READ_BUFFER = 1 << 20  # 1 MiB


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files and globs -> an ordered list of files (each glob sorted; duplicates dropped).

    Raises FileNotFoundError naming the first pattern that matches nothing.
    """
    out: List[str] = []
    seen = set()
    for pat in patterns:
        if any(c in pat for c in "*?["):
            matches = sorted(p for p in glob.glob(pat) if os.path.isfile(p))
        else:
            matches = [pat] if os.path.isfile(pat) else []
        if not matches:
            raise FileNotFoundError(f"{pat}: no such input file")
        for m in matches:
            key = os.path.abspath(m)
            if key not in seen:
                seen.add(key)
                out.append(m)
    return out


@contextmanager
def open_binary(path: str):
    """Open a (possibly compressed) file for buffered binary reading, decompressing as a stream."""
    raw = open(path, "rb")
    try:
        if path.endswith(".zst") or path.endswith(".zstd"):
            import zstandard

            dctx = zstandard.ZstdDecompressor(max_window_size=2**31)
            stream = dctx.stream_reader(raw, read_size=READ_BUFFER)
            yield io.BufferedReader(stream, buffer_size=READ_BUFFER)
        elif path.endswith(".gz"):
            yield io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), buffer_size=READ_BUFFER)
        else:
            yield io.BufferedReader(raw, buffer_size=READ_BUFFER)
    finally:
        raw.close()


def iter_lines(path: str) -> Iterator[Tuple[int, bytes]]:
    """(1-based line number, raw line bytes without the trailing newline) of one file."""
    with open_binary(path) as f:
        for i, line in enumerate(f, 1):
            yield i, line.rstrip(b"\r\n")


def iter_json_docs(paths: Sequence[str], key: str = "text") -> Iterator[str]:
    """The strings under ``key`` of every well-formed line (bad lines skipped silently).

    A convenience for tokenizer training; the preprocessing tool does its own accounting.
    """
    for path in expand_inputs(paths):
        for _, line in iter_lines(path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                continue
            if isinstance(obj, dict) and isinstance(obj.get(key), str):
                yield obj[key]
