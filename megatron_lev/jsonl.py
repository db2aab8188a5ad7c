"""Streaming readers for .jsonl, .jsonl.gz and .jsonl.zst (bounded memory, line numbers kept).

This module sits at the package root, below every package that reads text corpora: ``tokenizer/``
(tokenizer training), ``data/`` (preprocessing) and ``evaluation/`` (raw-text perplexity, task
files) all import it, and it imports only the standard library (plus ``zstandard`` for ``.zst``).
Under ``data/`` it would make ``tokenizer/`` import the package above it.
"""

from __future__ import annotations

import glob
import gzip
import importlib
import io
import json
import os
import zlib
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

READ_BUFFER = 1 << 20  # 1 MiB


class TruncatedInputError(ValueError):
    """An input file ends early or is corrupt; the message names the file and the complete lines read."""


class _StreamDamage(Exception):
    """Raised inside the decompressing readers; :func:`iter_lines` adds the file and line count."""


class _ZstdFrames(io.RawIOBase):
    """Decompress every zstd frame of a file in turn; a file that ends inside a frame is an error.

    (zstandard's stream reader returns a frame cut short as if it were complete.)
    """

    def __init__(self, raw) -> None:
        import zstandard

        self._zstd = zstandard
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor(max_window_size=2**31)
        self._dobj = None
        self._input = b""
        self._output = b""
        self._consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._output:
            if not self._input:
                self._input = self._raw.read(READ_BUFFER)
                if not self._input:
                    if self._dobj is not None:
                        raise _StreamDamage(f"ends inside a zstd frame at byte {self._consumed} (truncated)")
                    return 0
            if self._dobj is None:
                self._dobj = self._dctx.decompressobj()
            chunk, self._input = self._input, b""
            try:
                self._output = self._dobj.decompress(chunk)
            except self._zstd.ZstdError as e:
                raise _StreamDamage(f"corrupt zstd data near byte {self._consumed} ({e})") from None
            if self._dobj.eof:  # frame done; what follows belongs to the next frame
                self._input = self._dobj.unused_data
                self._dobj = None
            self._consumed += len(chunk) - len(self._input)
        n = min(len(buf), len(self._output))
        buf[:n] = self._output[:n]
        self._output = self._output[n:]
        return n


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
        if not matches and os.path.isdir(pat):
            raise FileNotFoundError(f"{pat}: a directory, not an input file; give its files "
                                    f"(e.g. '{os.path.join(pat, '*.jsonl*')}')")
        if not matches:
            raise FileNotFoundError(f"{pat}: no such input file")
        for m in matches:
            key = os.path.abspath(m)
            if key not in seen:
                seen.add(key)
                out.append(m)
    return out


def import_codecs(paths: Sequence[str]) -> None:
    """Import now the decompressor that ``paths`` need (``zstandard`` for .zst), not at their first read: a
    caller about to import in another thread does so first (``data.indexed.BackgroundImport``)."""
    if any(p.endswith((".zst", ".zstd")) for p in paths):
        importlib.import_module("zstandard")


@contextmanager
def open_binary(path: str):
    """Open a (possibly compressed) file for buffered binary reading, decompressing as a stream."""
    raw = open(path, "rb")
    try:
        if path.endswith(".zst") or path.endswith(".zstd"):
            yield io.BufferedReader(_ZstdFrames(raw), buffer_size=READ_BUFFER)
        elif path.endswith(".gz"):
            yield io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), buffer_size=READ_BUFFER)
        else:
            yield io.BufferedReader(raw, buffer_size=READ_BUFFER)
    finally:
        raw.close()


def _parses(line: bytes) -> bool:
    try:
        json.loads(line.decode("utf-8"))
        return True
    except (UnicodeDecodeError, ValueError):
        return False


def iter_lines(path: str, on_damage: Optional[Callable[[str], None]] = None) -> Iterator[Tuple[int, bytes]]:
    """(1-based line number, raw line bytes without the trailing newline) of one file.

    A compressed file that ends early or is corrupt, or a last line that is cut off (no newline and
    not valid JSON), raises :class:`TruncatedInputError` naming the file and the complete lines read;
    with ``on_damage``, that message is passed to it instead and the complete lines are kept.
    """
    n = 0
    try:
        with open_binary(path) as f:
            for line in f:
                if not line.endswith(b"\n") and line.strip() and not _parses(line):
                    raise _StreamDamage(f"last line {n + 1} is cut off (no newline, not valid JSON)")
                n += 1
                yield n, line.rstrip(b"\r\n")
    except (_StreamDamage, EOFError, zlib.error, gzip.BadGzipFile) as e:
        what = str(e) if isinstance(e, _StreamDamage) else f"damaged gzip data ({e})"
        msg = f"{path}: {what}; {n} complete lines read before it"
        if on_damage is None:
            raise TruncatedInputError(msg) from None
        on_damage(msg)


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
