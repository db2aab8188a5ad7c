"""tools/preprocess_data.py and megatron_lev.data.preprocessing: round trips, determinism, bad input."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lev.data import PreprocessConfig, preprocess, read_index_info
from megatron_lev.jsonl import iter_json_docs
from megatron_lev.tokenizer import build_tokenizer
from tests.data.conftest import REPO_ROOT, cli_flags, run_tool


def _read_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    # copies: megatron closes the mmap when the dataset object is collected
    return ds, [np.array(ds[i]) for i in range(len(ds))]


@pytest.fixture(scope="module")
def valid_path(sample_corpus):
    return sample_corpus.valid


@pytest.fixture(scope="module")
def valid_texts(sample_corpus):
    return sample_corpus.docs("valid")


@pytest.fixture(scope="module")
def n_docs(valid_texts):
    assert len(valid_texts) >= 12
    return len(valid_texts)


def _check_round_trip(kw, path, texts, prefix):
    stats = preprocess(PreprocessConfig(inputs=[path], output_prefix=prefix, append_eod=True, **kw))
    assert stats.docs == len(texts) and stats.errors == 0
    tok = build_tokenizer(**kw)
    ds, docs = _read_docs(prefix + "_text_document")
    assert len(docs) == len(texts)
    assert ds.index.dtype == (np.uint16 if tok.vocab_size < 65500 else np.int32)
    assert sum(d.size for d in docs) == stats.tokens
    for text, ids in zip(texts, docs):
        assert ids[-1] == tok.eod
        body = ids[:-1].tolist()
        assert body == tok.tokenize(text)
        # Every tokenizer here decodes to the input text (the SentencePiece models use the identity
        # normaliser and byte fallback), so one exact comparison covers every format.
        assert tok.detokenize(body) == text


@pytest.mark.parametrize("family", ["gpt2", "hf", "sentencepiece", "tiktoken"])
def test_round_trip(family, tok_args, valid_path, valid_texts, tmp_path):
    _check_round_trip(tok_args[family], valid_path, valid_texts, str(tmp_path / family))


@pytest.mark.parametrize("family", ["gpt2", "neox", "mistral"])
def test_round_trip_real_tokenizers(family, real_tok_args, shared_data, tmp_path):
    path = str(shared_data / "corpus" / "valid.jsonl.zst")
    _check_round_trip(real_tok_args[family], path, list(iter_json_docs([path])), str(tmp_path / family))


def test_workers_1_and_2_byte_identical(tok_args, valid_path, n_docs, tmp_path):
    kw = tok_args["gpt2"]
    p1, p2 = str(tmp_path / "w1"), str(tmp_path / "w2")
    preprocess(PreprocessConfig(inputs=[valid_path], output_prefix=p1, append_eod=True, workers=1,
                                batch_docs=16, **kw))
    r = run_tool("preprocess_data.py", "--input", valid_path, "--output-prefix", p2, "--append-eod",
                 "--workers", 2, "--batch-docs", 16, *cli_flags(kw))
    assert r.returncode == 0, r.stderr
    assert f"summary: docs={n_docs}" in r.stderr
    for ext in (".bin", ".idx"):
        a = open(p1 + "_text_document" + ext, "rb").read()
        b = open(p2 + "_text_document" + ext, "rb").read()
        assert a == b, ext


@pytest.mark.parametrize("vocab_size, dtype", [(65498, np.uint16), (65499, np.int32), (70000, np.int32)])
def test_output_dtype_is_megatrons_optimal_dtype(vocab_size, dtype, tmp_path):
    """NullTokenizer(V) has V + 1 ids: uint16 below 65,500 ids (megatron's DType.optimal_dtype), int32 above."""
    ids = [[0, 1, vocab_size - 1], [65535 % vocab_size, vocab_size - 2], [7]]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in ids))
    prefix = str(tmp_path / "o")
    preprocess(PreprocessConfig(inputs=[str(path)], output_prefix=prefix, tokenizer_type="NullTokenizer",
                                vocab_size=vocab_size, append_eod=True, workers=2, batch_docs=1))
    ds, docs = _read_docs(prefix + "_text_document")
    assert ds.index.dtype == dtype
    assert [d.tolist() for d in docs] == [d + [vocab_size] for d in ids]
    info = read_index_info(prefix + "_text_document.idx")
    assert (info.dtype, info.num_documents, info.num_tokens) == (np.dtype(dtype), 3, sum(len(d) + 1 for d in ids))


class _FakeImport:
    def __init__(self, indexed_dataset):
        self.mod, self.ready, self.joined = indexed_dataset, False, 0

    def done(self):
        return self.ready

    def module(self):
        self.joined += 1
        return self.mod


def test_writer_holds_results_until_import_done(tmp_path):
    """Results that arrive while megatron-core is importing are written, in order, once it is imported."""
    from megatron.core.datasets import indexed_dataset

    from megatron_lev.data.preprocessing import _Output, _Writer

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=int(n)).astype(np.uint16) for n in rng.integers(1, 300, size=40)]
    results = [{"text": (np.concatenate(docs[i:i + 8]), np.array([d.size for d in docs[i:i + 8]]))}
               for i in range(0, 40, 8)]
    results.insert(2, {"text": (np.zeros(0, np.uint16), np.zeros(0, np.int64))})  # a batch with no documents
    imp = _FakeImport(indexed_dataset)
    out = _Output(str(tmp_path / "o"), 50257, counts=False)
    w = _Writer(imp, {"text": out}, 50257)
    w.add(results[0])
    w.add(results[1])
    assert out.builder is None and imp.joined == 0 and len(w.held) == 2
    imp.ready = True
    for r in results[2:]:
        w.add(r)
    w.flush()
    assert imp.joined == 1 and not w.held
    out.commit()
    ds = indexed_dataset.IndexedDataset(str(tmp_path / "o"))
    assert ds.index.dtype == np.uint16 and len(ds) == 40
    assert all(np.array_equal(ds[i], d) for i, d in enumerate(docs))
    assert np.array_equal(ds.document_indices, np.arange(41))


def test_background_import_reraises():
    from megatron_lev.data import BackgroundImport

    with pytest.raises(ModuleNotFoundError, match="no_such_module_for_lev"):
        BackgroundImport("no_such_module_for_lev").module()


_META_PATH_PROBE = r"""
import sys, threading
removals = []
def watched(name):
    class Watched(list):
        pass
    # Every list method that can move an entry to a lower index than a walk of the list has reached
    for method in ("remove", "pop", "__delitem__", "__setitem__", "clear", "sort", "reverse"):
        def logged(self, *a, _m=method, _f=getattr(list, method)):
            if threading.current_thread() is not threading.main_thread():
                removals.append(f"{name}.{_m}")
            return _f(self, *a)
        setattr(Watched, method, logged)
    return Watched
sys.meta_path = watched("sys.meta_path")(sys.meta_path)
sys.path = watched("sys.path")(sys.path)
from megatron_lev.data import BackgroundImport
assert "setuptools" not in sys.modules
BackgroundImport().module()
print("removals in the import thread:", removals)
"""


def test_background_import_leaves_sys_meta_path_alone_while_the_caller_imports():
    """A finder removed from sys.meta_path by the import thread can make an import in the caller's thread
    skip the path finder (the reader's ``import zstandard`` failed so); the import thread only adds."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _META_PATH_PROBE], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "removals in the import thread: []" in proc.stdout, proc.stdout


BAD_LINES = [
    b'{"text": "good one"}',                          # 1 kept
    b'{"text": "unterminated',                        # 2 malformed_json
    b'{"content": "no text key"}',                    # 3 missing_key
    b'{"text": 42}',                                  # 4 non_string
    b'{"text": "caf\xe9 latin-1"}',                   # 5 invalid_utf8 (raw byte)
    b"",                                              # 6 blank (not an error)
    b'["a", "list"]',                                 # 7 malformed_json (not an object)
    b'{"text": ""}',                                  # 8 empty (not an error)
    b'{"text": "lone \\ud800 surrogate"}',            # 9 invalid_utf8 (escape)
    b'{"text": "good two", "meta": {"pile_set_name": "X"}}',  # 10 kept
]


@pytest.fixture()
def bad_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    return path


def test_bad_input_counted_and_kept(tok_args, bad_file, tmp_path):
    prefix = tmp_path / "out"
    r = run_tool("preprocess_data.py", "--input", bad_file, "--output-prefix", prefix, "--append-eod",
                 *cli_flags(tok_args["gpt2"]))
    assert r.returncode == 0, r.stderr
    assert "skipped lines: invalid_utf8=2, malformed_json=2, missing_key=1, non_string=1, blank=1, empty=1" in r.stderr
    assert f"{bad_file}:2: malformed_json" in r.stderr and f"{bad_file}:5: invalid_utf8" in r.stderr
    _, docs = _read_docs(str(prefix) + "_text_document")
    tok = build_tokenizer(**tok_args["gpt2"])
    assert [tok.detokenize(d[:-1]) for d in docs] == ["good one", "good two"]


def test_bad_input_strict_stops(tok_args, bad_file, tmp_path):
    prefix = tmp_path / "out"
    r = run_tool("preprocess_data.py", "--input", bad_file, "--output-prefix", prefix, "--strict",
                 *cli_flags(tok_args["gpt2"]))
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bad_file}:2: malformed_json") and "--strict" in err[0]
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # no outputs, no temporary files


def test_refuses_overwrite(tok_args, valid_path, tmp_path):
    prefix = tmp_path / "out"
    args = ["--input", valid_path, "--output-prefix", prefix, *cli_flags(tok_args["gpt2"])]
    assert run_tool("preprocess_data.py", *args).returncode == 0
    before = (tmp_path / "out_text_document.bin").stat().st_mtime_ns
    r = run_tool("preprocess_data.py", *args)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {prefix}_text_document.bin exists; pass --overwrite to replace it"
    assert (tmp_path / "out_text_document.bin").stat().st_mtime_ns == before
    assert run_tool("preprocess_data.py", *args, "--overwrite").returncode == 0


def test_missing_input_is_one_line_error(tok_args, tmp_path):
    r = run_tool("preprocess_data.py", "--input", tmp_path / "nope*.jsonl.zst", "--output-prefix", tmp_path / "o",
                 *cli_flags(tok_args["gpt2"]))
    assert r.returncode == 2 and r.stderr.strip() == f"error: {tmp_path / 'nope*.jsonl.zst'}: no such input file"


@pytest.mark.parametrize("where", ["_consume", "write"])
def test_interrupted_run_leaves_no_pair(where, tok_args, valid_path, tmp_path, monkeypatch):
    """Interrupted before the first write (``_consume``) or with the builder's files open (``write``)."""
    import megatron_lev.data.preprocessing as pp

    owner = pp._Output if where == "write" else pp
    real, calls = getattr(owner, where), []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(owner, where, flaky)
    with pytest.raises(KeyboardInterrupt):
        preprocess(PreprocessConfig(inputs=[valid_path], output_prefix=str(tmp_path / "o"), batch_docs=4,
                                    output_token_counts=True, **tok_args["gpt2"]))
    assert len(calls) == 3
    assert os.listdir(tmp_path) == []


def test_token_counts_and_formats(tok_args, tokenizer_files, valid_path, valid_texts, n_docs, tmp_path):
    """Token counts sum to the tokens written; .jsonl, .jsonl.gz, globs and several inputs work."""
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress(open(valid_path, "rb").read(), max_output_size=1 << 28)
    lines = raw.splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_bytes(b"".join(lines[:6]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b"".join(lines[6:]))
    prefix = str(tmp_path / "out")
    stats = preprocess(PreprocessConfig(inputs=[str(tmp_path / "a.jsonl"), str(tmp_path / "*.gz")],
                                        output_prefix=prefix, append_eod=True, output_token_counts=True,
                                        **tok_args["gpt2"]))
    counts = np.load(prefix + "_text_token_counts.npy")
    ds, docs = _read_docs(prefix + "_text_document")
    v = tokenizer_files.bpe_vocab_size
    assert counts.dtype == np.int64 and counts.shape == (v,)
    assert counts.sum() == stats.tokens == sum(d.size for d in docs) == read_index_info(prefix + "_text_document.idx").num_tokens
    assert counts[v - 1] == n_docs  # one EOD per document, counted
    assert np.array_equal(counts, np.bincount(np.concatenate(docs), minlength=v))
    tok = build_tokenizer(**tok_args["gpt2"])
    assert tok.detokenize(docs[9][:-1]) == valid_texts[9]


def test_pile_set_filter(tok_args, valid_texts, tmp_path):
    domains = ["Gutenberg (PG-19)", "GCIDE", "BrownCorpus", "PythonDocs"]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": t, "meta": {"pile_set_name": domains[i % 4]}}) + "\n"
                            for i, t in enumerate(valid_texts)))
    stats = preprocess(PreprocessConfig(inputs=[str(path)], output_prefix=str(tmp_path / "o"),
                                        pile_set_names=["GCIDE", "BrownCorpus"], append_eod=True, **tok_args["gpt2"]))
    kept = [t for i, t in enumerate(valid_texts) if i % 4 in (1, 2)]
    assert stats.docs == len(kept) and stats.skipped["filtered"] == len(valid_texts) - len(kept)
    tok = build_tokenizer(**tok_args["gpt2"])
    assert [tok.detokenize(d[:-1]) for d in _read_docs(str(tmp_path / "o_text_document"))[1]] == kept


def test_merge_takes_a_prefix_that_training_used(tmp_path, capsys):
    # Training without --data-cache-path leaves megatron-core's sample index in PREFIX/cache/: the prefix is
    # then a directory too, and was taken for a folder of datasets.
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tools.merge_datasets import main as merge_main

    parts = []
    for i in range(2):
        prefix = tmp_path / f"part{i}_text_document"
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        for d in range(3):
            builder.add_document(np.arange(5, dtype=np.uint16) + 10 * i + d, [5])
        builder.finalize(f"{prefix}.idx")
        parts.append(prefix)
    (parts[0] / "cache" / "GPTDataset_indices").mkdir(parents=True)
    (parts[0] / "cache" / "GPTDataset_indices" / "abc-GPTDataset-train-sample_index.npy").write_bytes(b"x")
    merged = tmp_path / "merged_text_document"
    assert merge_main(["--input", *map(str, parts), "--output-prefix", str(merged)]) == 0, capsys.readouterr().err
    _, docs = _read_docs(str(merged))
    assert [d.tolist()[0] for d in docs] == [0, 1, 2, 10, 11, 12]
    # A folder of datasets is still one: its pairs, sorted (the cache folder inside is no dataset).
    assert merge_main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "m2" / "all_text_document")]) == 0
    _, docs = _read_docs(str(tmp_path / "m2" / "all_text_document"))
    assert [d.tolist()[0] for d in docs] == [0, 1, 2, 10, 11, 12] * 2  # merged, then part0 and part1


def test_partitions_and_merge(tok_args, valid_path, n_docs, tmp_path):
    kw = tok_args["gpt2"]
    full = tmp_path / "full"
    preprocess(PreprocessConfig(inputs=[valid_path], output_prefix=str(full), append_eod=True,
                                output_token_counts=True, **kw))
    for i in range(2):
        preprocess(PreprocessConfig(inputs=[valid_path], output_prefix=str(tmp_path / f"part{i}"), append_eod=True,
                                    output_token_counts=True, partitions=2, partition_index=i, **kw))
    r = run_tool("preprocess_data.py", "--input", valid_path, "--output-prefix", tmp_path / "x", "--partitions", 2,
                 *cli_flags(kw))
    assert r.returncode == 2 and "--partition-index" in r.stderr
    merged = tmp_path / "merged_text_document"
    r = run_tool("merge_datasets.py", "--input", tmp_path / "part0_text_document", tmp_path / "part1_text_document",
                 "--output-prefix", merged)
    assert r.returncode == 0, r.stderr
    _, a = _read_docs(str(full) + "_text_document")
    _, b = _read_docs(str(merged))
    # partition-major order: lines 0,2,4,... then 1,3,5,...
    order = list(range(0, n_docs, 2)) + list(range(1, n_docs, 2))
    assert len(b) == n_docs and all(np.array_equal(a[j], d) for j, d in zip(order, b))
    assert np.array_equal(np.load(str(full) + "_text_token_counts.npy"),
                          np.load(str(tmp_path / "merged_text_token_counts.npy")))
    # The tokenizer fingerprint travels with the merge; parts of different tokenizers are refused.
    import json

    from megatron_lev.data.merge import merge_datasets
    from megatron_lev.data.preprocessing import PreprocessError

    side = lambda p: json.loads(open(str(p) + ".tokenizer.json").read())  # noqa: E731
    assert side(merged) == side(str(full) + "_text_document") and side(merged)["type"] == "GPT2BPETokenizer"
    other = dict(side(tmp_path / "part1_text_document"), sha256="0" * 64)
    open(str(tmp_path / "part1_text_document") + ".tokenizer.json", "w").write(json.dumps(other))
    with pytest.raises(PreprocessError, match="cannot merge datasets of different tokenizers: .*part0"):
        merge_datasets([str(tmp_path / "part0_text_document"), str(tmp_path / "part1_text_document")],
                       str(tmp_path / "m2_text_document"))

    with pytest.raises(PreprocessError, match=rf"{merged}.bin exists; pass --overwrite"):
        merge_datasets([str(tmp_path / "part0_text_document")], str(merged))
