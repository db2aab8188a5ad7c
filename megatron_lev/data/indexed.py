"""Access to megatron-core's indexed dataset module (.bin/.idx): background import, index summary, max id.

Writing and reading go through ``megatron.core.datasets.indexed_dataset`` (``IndexedDatasetBuilder``,
``IndexedDataset``, ``DType``). Importing it costs about 4 s on a small CPU machine (it loads torch
and much of megatron.core), so the preprocessing tool starts :class:`BackgroundImport` at the
beginning of a run and only waits for it before its first write, while the tokenisation runs.
"""

from __future__ import annotations

import importlib
import os
import struct
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import numpy as np

INDEXED_DATASET_MODULE = "megatron.core.datasets.indexed_dataset"


class BackgroundImport:
    """Imports ``megatron.core.datasets.indexed_dataset`` in a daemon thread; :meth:`module` waits for it.

    Start it only when no ``fork`` follows while the import may still run (a forked child would
    inherit module locks held by the importing thread).

    setuptools is imported here, in the caller's thread, before the thread starts: torch imports it
    on the way (``torch.utils.cpp_extension``), and its ``_distutils_hack`` inserts a finder at the
    head of ``sys.meta_path`` and removes it again. A removal while the caller's thread walks
    ``sys.meta_path`` for an import of its own makes that walk skip a finder, and the import fails
    with a ModuleNotFoundError for a module that is installed (seen: ``zstandard`` in the reader).
    """

    def __init__(self, name: str = INDEXED_DATASET_MODULE) -> None:
        try:
            importlib.import_module("setuptools")  # here, not in the thread: see the class docstring
        except ImportError:
            pass  # no setuptools: no import of it can run in the thread either
        self.name = name
        self._module: Optional[ModuleType] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"import {name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._module = importlib.import_module(self.name)
        except BaseException as e:  # re-raised in the caller's thread by module()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def module(self) -> ModuleType:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._module is not None
        return self._module


@dataclass
class IndexInfo:
    dtype: np.dtype
    num_sequences: int
    num_documents: int  # documents, not the index's document_indices length
    num_tokens: int
    idx_bytes: int


def read_index_info(idx_path: str) -> IndexInfo:
    """Totals of an .idx read with megatron-core's index reader; ValueError for truncated or foreign files."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    size = os.path.getsize(idx_path)
    try:
        index = _IndexReader(idx_path, multimodal=False)
    except AssertionError as e:  # megatron asserts on the header and the version
        raise ValueError(f"not a megatron .idx file ({e})") from None
    except (ValueError, KeyError, struct.error) as e:  # unknown dtype code, or shorter than its header says
        raise ValueError(f"truncated or unreadable .idx ({size} bytes): {e}") from None
    try:
        info = IndexInfo(
            dtype=np.dtype(index.dtype),
            num_sequences=int(index.sequence_count),
            num_documents=max(int(index.document_count) - 1, 0),
            num_tokens=int(index.sequence_lengths.sum(dtype=np.int64)),
            idx_bytes=size,
        )
    finally:
        del index  # closes megatron's memory map
    return info


def max_token_id(bin_path: str, dtype, chunk: int = 1 << 26) -> int:
    """Largest id in a .bin (vectorised scan through a numpy memmap; -1 when empty)."""
    dtype = np.dtype(dtype)
    n = os.path.getsize(bin_path) // dtype.itemsize
    if n == 0:
        return -1
    mm = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))
    best = -1
    for s in range(0, n, chunk):
        best = max(best, int(mm[s : s + chunk].max()))
    del mm
    return best


def check_index_pointers(idx_path: str, bin_size: int) -> None:
    """ValueError unless the .idx's byte pointers rise monotonically and every sequence lies inside the
    .bin, and its document boundaries rise from 0 to the sequence count (a damaged index would
    otherwise fail deep inside megatron-core, or read the wrong tokens)."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    index = _IndexReader(idx_path, multimodal=False)
    try:
        ptr = np.asarray(index.sequence_pointers, dtype=np.int64)
        ends = ptr + np.asarray(index.sequence_lengths, dtype=np.int64) * np.dtype(index.dtype).itemsize
        docs = np.asarray(index.document_indices, dtype=np.int64)
        if ptr.size:
            if ptr[0] < 0 or np.any(np.diff(ptr) < 0):
                i = 0 if ptr[0] < 0 else int(np.flatnonzero(np.diff(ptr) < 0)[0]) + 1
                raise ValueError(f"sequence pointer {i} ({int(ptr[i])}) is out of order")
            if np.any(ends > bin_size):
                i = int(np.flatnonzero(ends > bin_size)[0])
                raise ValueError(f"sequence {i} ends at byte {int(ends[i])}, past the end of the .bin ({bin_size} bytes)")
        if docs.size and (docs[0] != 0 or docs[-1] != ptr.size or np.any(np.diff(docs) < 0)):
            raise ValueError("document boundaries are not monotonic from 0 to the sequence count")
    finally:
        del index
