"""The megatron-core indexed dataset format (.bin/.idx), written and inspected without importing megatron.

``IndexWriter`` writes files byte-identical to ``megatron.core.datasets.indexed_dataset.
IndexedDatasetBuilder`` (checked in tests/data), but takes whole batches of documents as numpy
arrays and computes the sequence pointers vectorised. The reason to have it: importing
``megatron.core`` costs about 4 s on a small CPU machine (it loads torch and the tensor-parallel
layers), a large part of a preprocessing run; readers still use megatron-core's ``IndexedDataset``.

.idx layout (little endian): ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version 1, ``<B`` dtype code,
``<Q`` sequence count, ``<Q`` document count (= documents + 1), int32 sequence lengths,
int64 sequence byte offsets, int64 document indices (sequence index where each document starts,
plus the final count).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import List

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType codes
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> np.dtype:
    """megatron-core's ``DType.optimal_dtype``: uint16 below 65500 ids, int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


class IndexWriter:
    """Streams documents (one sequence each) into ``bin_path``; ``finalize(idx_path)`` writes the index."""

    def __init__(self, bin_path: str, dtype) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported dtype {self.dtype}")
        self.bin_path = bin_path
        self._f = open(bin_path, "wb")
        self._lengths: List[np.ndarray] = []
        self.num_docs = 0
        self.num_tokens = 0

    def add_batch(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` documents whose ids, concatenated, are ``tokens``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            return
        if int(lengths.sum()) != tokens.size:
            raise ValueError("document lengths do not add up to the number of tokens")
        self._f.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self.num_docs += int(lengths.size)
        self.num_tokens += int(tokens.size)

    def add_document(self, ids) -> None:
        ids = np.asarray(ids)
        self.add_batch(ids, np.array([ids.size]))

    def finalize(self, idx_path: str) -> None:
        self._f.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(lengths.size + 1, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", doc_idx.size))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


@dataclass
class IndexInfo:
    dtype: np.dtype
    num_sequences: int
    num_documents: int  # documents, not the index's document_indices length
    num_tokens: int
    idx_bytes: int


def read_index_info(idx_path: str) -> IndexInfo:
    """Header and totals of an .idx, with clear ValueErrors for truncated or foreign files."""
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(len(INDEX_HEADER) + 8 + 1 + 8 + 8)
        if len(head) < len(INDEX_HEADER) + 25 or not head.startswith(INDEX_HEADER):
            raise ValueError("not a megatron .idx file (bad header)")
        (version,) = struct.unpack_from("<Q", head, 9)
        (code,) = struct.unpack_from("<B", head, 17)
        seq_count, doc_count = struct.unpack_from("<QQ", head, 18)
        if version != 1 or code not in CODE_DTYPES:
            raise ValueError(f"unsupported .idx version {version} / dtype code {code}")
        expected = 34 + seq_count * (4 + 8) + doc_count * 8
        if size < expected:
            raise ValueError(f"truncated .idx: {size} bytes, header says at least {expected}")
        lengths = np.fromfile(f, dtype=np.int32, count=seq_count)
    return IndexInfo(
        dtype=CODE_DTYPES[code],
        num_sequences=int(seq_count),
        num_documents=max(int(doc_count) - 1, 0),
        num_tokens=int(lengths.astype(np.int64).sum()),
        idx_bytes=size,
    )


def max_token_id(bin_path: str, dtype, chunk: int = 1 << 26) -> int:
    """Largest id in a .bin (vectorised scan through a memmap; -1 when empty)."""
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
