"""Megatron-LM options that reach megatron-core through the training loop's own builders:

- ``--no-mmap-bin-files``: the run's datasets read the ``.bin`` files with file reads, not a memory map;
- ``--use-precision-aware-optimizer`` with ``--main-grads-dtype``/``--main-params-dtype``/
  ``--exp-avg-dtype``/``--exp-avg-sq-dtype``: the OptimizerConfig the loop builds carries them as
  Megatron-LM's does; without Transformer Engine, or without the distributed optimizer, it is refused in
  one line naming what is needed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lev.arguments import parse_args
from megatron_lev.lev.config import ConfigError

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"]
MOCK = ["--mock-data", "--vocab-size", "1000"]


# ------------------------------------------------------------------------------------------ data


@pytest.fixture
def dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        builder.add_document(torch.from_numpy(rng.integers(1, 999, size=20).astype(np.int64)), [20])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("flags, mmap", [([], True), (["--no-mmap-bin-files"], False)])
def test_no_mmap_bin_files_reaches_the_indexed_dataset(dataset, flags, mmap):
    from megatron.core.datasets.indexed_dataset import _FileBinReader, _MMapBinReader

    from megatron_lev.training.data import build_datasets
    from megatron_lev.training.loop import _setup_configs

    argv = MODEL + ["--eval-iters", "0", "--split", "1,0,0", "--data-path", dataset,
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"] + flags
    args, tok, _, _ = _setup_configs(argv)
    train, _, _ = build_datasets(args, tok)
    assert train.config.mmap_bin_files is mmap
    indexed = train.dataset
    assert indexed.mmap is mmap
    assert isinstance(indexed.bin_reader, _MMapBinReader if mmap else _FileBinReader)
    assert len(train[0]["tokens"]) == 8  # the file reader reads the same samples
