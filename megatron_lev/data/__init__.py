"""Data: indexed-dataset writing, token counts, dataset providers (the jsonl readers are
:mod:`megatron_lev.jsonl`).

Heavy imports (megatron.core, torch) happen only inside the functions that need them (or, for
preprocessing, in a background thread).
"""

from megatron_lev.data.indexed import BackgroundImport, IndexInfo, max_token_id, read_index_info
from megatron_lev.data.preprocessing import (
    BadInputError,
    PreprocessConfig,
    PreprocessError,
    PreprocessStats,
    dataset_prefix,
    preprocess,
    token_counts_path,
)

__all__ = [
    "BackgroundImport",
    "IndexInfo",
    "max_token_id",
    "read_index_info",
    "BadInputError",
    "PreprocessConfig",
    "PreprocessError",
    "PreprocessStats",
    "dataset_prefix",
    "preprocess",
    "token_counts_path",
]
