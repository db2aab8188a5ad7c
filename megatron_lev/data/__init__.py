"""Data: streaming jsonl readers, indexed-dataset writing, token counts, dataset providers.

Heavy imports (megatron.core, torch) happen only inside the functions that need them (or, for
preprocessing, in a background thread).
"""

from megatron_lev.data.indexed import BackgroundImport, IndexInfo, max_token_id, read_index_info
from megatron_lev.data.jsonl import expand_inputs, iter_json_docs, iter_lines, open_binary
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
    "expand_inputs",
    "iter_json_docs",
    "iter_lines",
    "open_binary",
    "BadInputError",
    "PreprocessConfig",
    "PreprocessError",
    "PreprocessStats",
    "dataset_prefix",
    "preprocess",
    "token_counts_path",
]
