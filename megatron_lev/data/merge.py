"""Merge several indexed datasets (e.g. the partitions of a multi-node run) into one."""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import numpy as np

from megatron_lev.data.indexed import read_index_info
from megatron_lev.data.preprocessing import PreprocessError, token_counts_path
from megatron_lev.tokenizer import describe_tokenizer, tokenizer_mismatch
from megatron_lev.tokenizer.fingerprint import read_sidecar, sidecar_path, write_sidecar


def list_prefixes(inputs: Sequence[str]) -> List[str]:
    """Dataset prefixes from prefixes (``x`` with ``x.bin``/``x.idx``) or directories (all pairs, sorted).

    A prefix that is also a directory is a prefix: megatron-core keeps a dataset's sample index in
    ``PREFIX/cache/`` when training is given no --data-cache-path."""
    out: List[str] = []
    for item in inputs:
        if os.path.isdir(item) and not _is_pair(item):
            found = sorted(
                os.path.join(item, f[:-4])
                for f in os.listdir(item)
                if f.endswith(".idx") and os.path.exists(os.path.join(item, f[:-4] + ".bin"))
            )
            if not found:
                raise PreprocessError(f"{item}: no .bin/.idx pairs in this directory")
            out += found
        else:
            for ext in (".bin", ".idx"):
                if not os.path.exists(item + ext):
                    raise PreprocessError(f"{item + ext}: no such file")
            out.append(item)
    return out


def _is_pair(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def merge_datasets(inputs: Sequence[str], output_prefix: str, *, overwrite: bool = False) -> List[str]:
    """Concatenate datasets in the given order with megatron-core's ``IndexedDatasetBuilder.add_index``.

    ``output_prefix`` is the full dataset prefix (``..._text_document``). Token-count files next to
    the inputs (``..._token_counts.npy``) are summed into one next to the output when every input
    has one. Writes temporary files and renames them at the end. Returns the written paths.
    """
    prefixes = list_prefixes(inputs)
    if not prefixes:
        raise PreprocessError("nothing to merge")
    outs = [output_prefix + ".bin", output_prefix + ".idx", token_counts_path(output_prefix),
            sidecar_path(output_prefix)]
    for p in outs:
        if os.path.exists(p) and not overwrite:
            raise PreprocessError(f"{p} exists; pass --overwrite to replace it")
    infos = []
    for p in prefixes:
        try:
            infos.append(read_index_info(p + ".idx"))
        except ValueError as e:
            raise PreprocessError(f"{p}.idx: {e}") from None
    dtypes = {i.dtype for i in infos}
    if len(dtypes) != 1:
        raise PreprocessError(
            "cannot merge datasets of different dtypes: "
            + ", ".join(f"{p} ({i.dtype})" for p, i in zip(prefixes, infos))
        )
    fp = _common_tokenizer(prefixes)
    dtype = infos[0].dtype.type
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp_bin, tmp_idx = output_prefix + ".bin.partial", output_prefix + ".idx.partial"
    written: List[str] = []
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        for p in prefixes:
            builder.add_index(p)
        builder.finalize(tmp_idx)
        counts = _sum_counts(prefixes)
        if counts is not None:
            tmp = token_counts_path(output_prefix) + ".partial"
            with open(tmp, "wb") as f:
                np.save(f, counts)
            os.replace(tmp, token_counts_path(output_prefix))
            written.append(token_counts_path(output_prefix))
        if fp is not None:
            write_sidecar(sidecar_path(output_prefix) + ".partial", fp)
            os.replace(sidecar_path(output_prefix) + ".partial", sidecar_path(output_prefix))
            written.append(sidecar_path(output_prefix))
        os.replace(tmp_bin, output_prefix + ".bin")
        os.replace(tmp_idx, output_prefix + ".idx")
    except BaseException:
        for t in (tmp_bin, tmp_idx):
            if os.path.exists(t):
                os.remove(t)
        raise
    return [output_prefix + ".bin", output_prefix + ".idx"] + written


def _common_tokenizer(prefixes: Sequence[str]) -> Optional[dict]:
    """The inputs' tokenizer fingerprint (None when one has none); inputs of different tokenizers are refused."""
    fps = []
    for p in prefixes:
        try:
            fps.append(read_sidecar(sidecar_path(p)))
        except ValueError as e:
            raise PreprocessError(str(e)) from None
    if any(f is None for f in fps):
        return None
    for p, f in zip(prefixes[1:], fps[1:]):
        msg = tokenizer_mismatch(fps[0], f, f"{prefixes[0]}.bin", made="preprocessed")
        if msg is not None:
            raise PreprocessError(f"cannot merge datasets of different tokenizers: {prefixes[0]} "
                                  f"({describe_tokenizer(fps[0])}) and {p} ({describe_tokenizer(f)})")
    return fps[0]


def _sum_counts(prefixes: Sequence[str]) -> Optional[np.ndarray]:
    paths = [token_counts_path(p) for p in prefixes]
    if not all(os.path.exists(p) for p in paths):
        return None
    total = None
    for p in paths:
        c = np.load(p)
        if total is None:
            total = c.astype(np.int64)
        elif c.shape != total.shape:
            raise PreprocessError(f"{p}: token counts of length {c.size}, expected {total.size} (another tokenizer?)")
        else:
            total += c
    return total
