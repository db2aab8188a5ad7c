"""Training datasets: Megatron blend syntax + split -> megatron-core GPTDatasets, with start-up checks.

``build_train_valid_test_datasets`` turns ``--data-path`` (``"w1 prefix1 w2 prefix2 ..."`` or a single
prefix) with ``--split 969,30,1``, or separate ``--train/valid/test-data-path`` blends, into megatron-core
``GPTDataset``/``BlendedDataset`` objects through ``BlendedMegatronDatasetBuilder``; ``mock=True`` gives
megatron-core's ``MockGPTDataset``. Before building, every prefix is checked (see
:func:`validate_dataset_prefix`) and a failure raises :class:`DatasetValidationError` naming the file.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from megatron_lev.data.indexed import IndexInfo, check_index_pointers, max_token_id, read_index_info
from megatron_lev.data.preprocessing import token_counts_path
from megatron_lev.tokenizer.fingerprint import check_dataset_tokenizer as _check_fingerprint

Blend = Tuple[List[str], Optional[List[float]]]
DataPath = Union[None, str, Sequence[str]]


class DatasetValidationError(ValueError):
    """A dataset file is missing, corrupt, inconsistent, or holds ids outside the model's vocabulary."""


def parse_blend(data_path: DataPath) -> Optional[Blend]:
    """Megatron's blend syntax -> ``(prefixes, weights or None)``.

    Accepts ``"prefix"``, ``"w1 p1 w2 p2"`` or the same as a list of strings (as argparse ``nargs='*'``
    gives). Weights are kept as given (megatron-core normalises them).
    """
    if data_path is None:
        return None
    tokens = data_path.split() if isinstance(data_path, str) else [t for item in data_path for t in str(item).split()]
    if not tokens:
        return None
    if len(tokens) % 2 == 0:
        try:
            weights = [float(w) for w in tokens[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w <= 0 for w in weights):
                raise DatasetValidationError(f"blend weights must be positive, got {weights}")
            return list(tokens[1::2]), weights
    for t in tokens:
        try:
            float(t)
        except ValueError:
            continue
        raise DatasetValidationError(
            f"cannot parse data path {' '.join(tokens)!r}: expected 'prefix' or 'weight prefix weight prefix ...'"
        )
    return list(tokens), None


_UNRECORDED_WARNED: set = set()


def check_dataset_tokenizer(prefix: str, tokenizer_fp: Optional[dict], allow_mismatch: bool = False,
                            warn: Callable[[str], None] = print) -> None:
    """The tokenizer check of :func:`megatron_lev.tokenizer.fingerprint.check_dataset_tokenizer` (a dataset
    made before fingerprints warns once per prefix and process), raising :class:`DatasetValidationError`."""
    try:
        _check_fingerprint(prefix, tokenizer_fp, allow_mismatch=allow_mismatch, warn=warn, warned=_UNRECORDED_WARNED)
    except ValueError as e:
        raise DatasetValidationError(str(e)) from None


def validate_dataset_prefix(prefix: str, vocab_size: Optional[int] = None, check_token_ids: bool = True,
                            tokenizer_fp: Optional[dict] = None, allow_tokenizer_mismatch: bool = False,
                            warn: Callable[[str], None] = print) -> IndexInfo:
    """Check one ``.bin/.idx`` pair; raise :class:`DatasetValidationError` naming the offending file.

    ``tokenizer_fp``: the run's tokenizer fingerprint, compared with the one written beside the pair
    (:func:`check_dataset_tokenizer`).

    Checks: both files exist; the .idx header and size are sane; the .bin size equals
    tokens x itemsize; the .idx pointers rise monotonically and stay inside the .bin; and
    (``check_token_ids``) the largest id is < ``vocab_size`` (:func:`check_dataset_token_ids`).
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for p in (idx, bin_):
        if not os.path.isfile(p):
            raise DatasetValidationError(f"{p}: missing (dataset prefix {prefix!r})")
    try:
        info = read_index_info(idx)
    except (ValueError, OSError) as e:
        raise DatasetValidationError(f"{idx}: corrupt index: {e}") from None
    expected = info.num_tokens * info.dtype.itemsize
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise DatasetValidationError(
            f"{bin_}: {actual} bytes but {idx} describes {info.num_tokens} tokens of {info.dtype} "
            f"({expected} bytes); the pair does not match (truncated or from different runs)"
        )
    try:
        check_index_pointers(idx, actual)
    except ValueError as e:
        raise DatasetValidationError(f"{idx}: corrupt index: {e}; preprocess the data again") from None
    check_dataset_tokenizer(prefix, tokenizer_fp, allow_tokenizer_mismatch, warn)
    if check_token_ids and vocab_size is not None:
        check_dataset_token_ids(prefix, vocab_size, info=info)
    return info


def check_dataset_token_ids(prefix: str, vocab_size: int, vocabulary: str = "the model's vocabulary size",
                            info: Optional[IndexInfo] = None) -> None:
    """Refuse (:class:`DatasetValidationError` naming the .bin) an indexed set holding a token id >=
    ``vocab_size`` (``vocabulary`` says whose size it is). The largest id comes from the
    ``*_token_counts.npy`` file written by the preprocessing tool when it can be tied to this .bin (same
    total, and written after the .bin was last modified), otherwise from a vectorised scan."""
    bin_ = prefix + ".bin"
    info = info if info is not None else read_index_info(prefix + ".idx")
    if not info.num_tokens:
        return
    max_id = None
    counts_path = token_counts_path(prefix)
    # A .bin changed after its counts were written (mtime) is scanned: the counts may be stale.
    if os.path.isfile(counts_path) and os.stat(counts_path).st_mtime_ns >= os.stat(bin_).st_mtime_ns:
        try:
            counts = np.load(counts_path, mmap_mode="r")
            if counts.ndim == 1 and int(counts.sum()) == info.num_tokens:
                max_id = int(np.flatnonzero(counts)[-1])
        except (ValueError, OSError):
            max_id = None
    if max_id is None:
        max_id = max_token_id(bin_, info.dtype)
    if max_id >= vocab_size:
        raise DatasetValidationError(
            f"{bin_}: holds token id {max_id} >= {vocabulary} {vocab_size} (preprocessed with another tokenizer?)")


_SPLIT_NAMES = ("train", "valid", "test")


def _check_split_sizes(blend, per_split, split, sizes) -> None:
    """Refuse a split that would get no documents but is asked for samples.

    megatron-core loops forever building the sample index of an empty split (zero tokens per epoch).
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    def n_seq(prefix: str) -> int:
        try:
            return read_index_info(prefix + ".idx").num_sequences
        except (OSError, ValueError) as e:
            raise DatasetValidationError(f"{prefix}.idx: {e}") from None

    if blend is not None:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for prefix in blend[0]:
            n = n_seq(prefix)
            for i, size in enumerate(sizes):
                if not size or matrix[i] is None:
                    continue
                beg, end = int(round(matrix[i][0] * n)), int(round(matrix[i][1] * n))
                if end <= beg:
                    raise DatasetValidationError(
                        f"{prefix}: the {_SPLIT_NAMES[i]} part of --split {split} gets 0 of its {n} documents "
                        f"but {size} samples are requested; change the split or the sample counts"
                    )
    elif per_split is not None:
        for i, b in enumerate(per_split):
            if b is None or not sizes[i]:
                continue
            for prefix in b[0]:
                if n_seq(prefix) == 0:
                    raise DatasetValidationError(f"{prefix}: empty dataset, but {sizes[i]} {_SPLIT_NAMES[i]} samples are requested")


def _checked_on_every_rank(check: Callable[[], None]) -> None:
    """``check()`` on this rank; under torch.distributed a :class:`DatasetValidationError` (or an unreadable
    file) on any rank stops every rank with the lowest such rank's line. Each rank reads the files itself
    (a node's own copy of the data may be short), and the rest of the build waits in megatron-core's
    barriers for every rank: a rank stopping alone would leave the others there."""
    import torch.distributed as dist

    error = None
    try:
        check()
    except DatasetValidationError as e:
        error = str(e)
    except OSError as e:
        error = f"{e.filename or 'a dataset file'}: cannot be read ({e.strerror or e})"
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)  # once per build
        failed = next((r for r, e in enumerate(errors) if e is not None), None)
        # Another rank's finding says where: its node's copy of the data may be the only bad one.
        error = None if failed is None else errors[failed] + (f" (on rank {failed})" if failed else "")
    if error is not None:
        raise DatasetValidationError(error)


def ensure_process_group() -> bool:
    """Start a single-process gloo group when torch.distributed is not initialised.

    megatron-core's BlendedDataset calls ``torch.distributed.get_rank()`` when it builds a cache.
    Returns True when a group was created here.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    fd, path = tempfile.mkstemp(prefix="megatron_lev_pg_")
    os.close(fd)
    os.remove(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    return True


def build_gpt_dataset_config(
    tokenizer,
    seq_length: int,
    *,
    blend: Optional[Blend] = None,
    blend_per_split: Optional[List[Optional[Blend]]] = None,
    split: Optional[str] = "969,30,1",
    seed: int = 1234,
    data_cache_path: Optional[str] = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    mmap_bin_files: bool = True,
    num_dataset_builder_threads: int = 1,
    **extra,
):
    """A megatron-core ``GPTDatasetConfig`` (mock when neither blend nor blend_per_split is given)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split if blend is not None else None,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=mmap_bin_files,
        num_dataset_builder_threads=num_dataset_builder_threads,
        **extra,
    )


def build_train_valid_test_datasets(
    tokenizer,
    seq_length: int,
    train_valid_test_num_samples: Sequence[Optional[int]],
    *,
    data_path: DataPath = None,
    split: Optional[str] = "969,30,1",
    train_data_path: DataPath = None,
    valid_data_path: DataPath = None,
    test_data_path: DataPath = None,
    mock: bool = False,
    seed: int = 1234,
    data_cache_path: Optional[str] = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    mmap_bin_files: bool = True,
    vocab_size: Optional[int] = None,
    validate: bool = True,
    check_token_ids: bool = True,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    init_process_group: bool = True,
    tokenizer_fp: Optional[dict] = None,
    allow_tokenizer_mismatch: bool = False,
    warn: Callable[[str], None] = print,
    **config_extra,
):
    """Build ``(train, valid, test)`` megatron-core datasets (each may be None).

    ``train_valid_test_num_samples``: samples per split (Megatron computes them from iterations x
    global batch size). ``vocab_size``: the model's vocabulary (ids must be below it); defaults to
    ``tokenizer.vocab_size``. ``is_built_on_rank``: defaults to "always" (pass Megatron's
    ``tensor model parallel rank == 0`` check in multi-rank training). ``tokenizer_fp``: the run's
    tokenizer fingerprint, compared with each dataset's (refused on a mismatch unless
    ``allow_tokenizer_mismatch``); ``warn`` prints the warnings.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    per_split = [parse_blend(p) for p in (train_data_path, valid_data_path, test_data_path)]
    use_per_split = any(b is not None for b in per_split)
    blend = parse_blend(data_path)
    if mock:
        blend, per_split, use_per_split = None, [None, None, None], False
    elif blend is None and not use_per_split:
        raise DatasetValidationError("no data: give data_path, train/valid/test data paths, or mock=True")
    elif blend is not None and use_per_split:
        raise DatasetValidationError("data_path and train/valid/test data paths are mutually exclusive")

    def check() -> None:
        if mock:
            return
        if validate:
            vs = vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)
            prefixes = list(blend[0]) if blend else [p for b in per_split if b for p in b[0]]
            for p in dict.fromkeys(prefixes):
                validate_dataset_prefix(p, vs, check_token_ids=check_token_ids, tokenizer_fp=tokenizer_fp,
                                        allow_tokenizer_mismatch=allow_tokenizer_mismatch, warn=warn)
        _check_split_sizes(blend, per_split if use_per_split else None, split, train_valid_test_num_samples)

    _checked_on_every_rank(check)

    config = build_gpt_dataset_config(
        tokenizer,
        seq_length,
        blend=blend,
        blend_per_split=per_split if use_per_split else None,
        split=None if use_per_split else split,
        seed=seed,
        data_cache_path=data_cache_path,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=mmap_bin_files,
        **config_extra,
    )
    # A split asked for no samples is not built (an empty one would make megatron-core loop forever).
    if not mock and blend is not None and config.split_matrix is not None:
        config.split_matrix = [m if size != 0 else None for m, size in zip(config.split_matrix,
                                                                            train_valid_test_num_samples)]
    elif not mock and use_per_split:
        config.blend_per_split = [b if size != 0 else None for b, size in zip(per_split, train_valid_test_num_samples)]
    blends = [blend] if blend else [b for b in per_split if b]
    if init_process_group and data_cache_path and any(len(b[0]) > 1 for b in blends):
        ensure_process_group()
    cls = MockGPTDataset if mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, list(train_valid_test_num_samples), is_built_on_rank or (lambda: True), config
    )
    train, valid, test = builder.build()
    return train, valid, test
