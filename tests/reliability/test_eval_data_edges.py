"""Evaluation sets that hold nothing to score or cannot be read: tools/evaluate.py refuses each in one line
naming the flag and the file, before any model is loaded, and writes no results (an empty set used to be
reported as PPL 1.000, a perfect score). All data is made here; no model is built.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from megatron_lev.evaluation import DataFormatError, LogitsScorer, evaluate_perplexity, jsonl_documents


def _indexed(prefix, docs):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in docs:
        builder.add_document(np.asarray(d, dtype=np.uint16), [len(d)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture()
def evaluate(tmp_path, capsys, monkeypatch):
    """evaluate.py's main on ``--load`` of a folder that holds no checkpoint: each refusal below must come
    first. Returns (exit code, error lines, stderr)."""
    from megatron_lev.evaluation import cli

    def no_checkpoint(_args, *_):
        raise AssertionError("the checkpoint was opened before the data was checked")

    monkeypatch.setattr(cli, "_checkpoint_tokenizer", no_checkpoint)

    def run(*flags):
        code = cli.main(["--load", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "out"), *map(str, flags)])
        err = capsys.readouterr().err
        assert not (tmp_path / "out").exists()  # no results.json with a fake score, no folder either
        return code, [ln for ln in err.splitlines() if ln.startswith("error:")], err

    return run


def test_an_evaluation_set_with_nothing_to_score_is_refused_in_one_line_naming_the_file(tmp_path, evaluate):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n\n" + json.dumps({"text": ""}) + "\n")
    for path in (empty, blank):
        code, errors, err = evaluate("--valid-data", path)
        assert code == 2 and errors == [f"error: --valid-data {path}: no document (no line with a non-empty string "
                                        "under 'text'); nothing to evaluate, give a file with documents (or the "
                                        "right --json-key)"], err
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"body": "some text"}) + "\n")
    code, errors, err = evaluate("--valid-data", good, "--zeroshot-data", f"wiki={empty}")
    assert code == 2 and len(errors) == 1, err  # the valid set first: its key is not 'text'
    assert errors[0] == f"error: {good}:1: expected a JSON object with a string field 'text'", errors
    code, errors, err = evaluate("--valid-data", good, "--json-key", "body", "--zeroshot-data", f"wiki={empty}")
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: --zeroshot-data {empty}: no document"), err

    prefix = _indexed(tmp_path / "none_text_document", [])
    code, errors, err = evaluate("--valid-data", prefix)
    assert code == 2 and errors == [f"error: --valid-data {prefix}: an empty indexed set ({prefix}.idx lists 0 "
                                    "tokens); nothing to evaluate, give a set with documents"], err
    assert "Exception ignored" not in err and "Traceback" not in err, err

    for flag in ("--max-tokens", "--max-documents"):
        code, errors, err = evaluate("--valid-data", good, "--json-key", "body", flag, "0")
        assert code == 2 and errors == [f"error: {flag} 0: nothing would be evaluated; give at least 1 (or leave "
                                        "it out)"], err


def test_a_damaged_indexed_evaluation_set_is_one_line_naming_the_file_without_megatron_s_del_traces(tmp_path,
                                                                                                  evaluate):
    prefix = _indexed(tmp_path / "val_text_document", [[1, 2, 3, 4], [5, 6, 7]])
    idx = tmp_path / "val_text_document.idx"
    whole = idx.read_bytes()
    idx.write_bytes(whole[:40])  # cut inside its arrays
    code, errors, err = evaluate("--valid-data", prefix)
    assert code == 2 and len(errors) == 1 and "Exception ignored" not in err and "Traceback" not in err, err
    assert errors[0].startswith(f"error: --valid-data {idx}: corrupt index: truncated or unreadable .idx (40 bytes"), errors
    idx.write_bytes(whole)
    bin_ = tmp_path / "val_text_document.bin"
    bin_.write_bytes(bin_.read_bytes()[:6])  # a .bin shorter than its .idx says
    code, errors, err = evaluate("--valid-data", prefix)
    assert code == 2 and len(errors) == 1 and "Exception ignored" not in err, err
    assert errors[0].startswith(f"error: --valid-data {bin_}: 6 bytes but {idx} describes 7 tokens of uint16"), errors


def test_a_perplexity_over_no_tokens_is_an_error_not_ppl_1(tmp_path):
    import torch

    scorer = LogitsScorer(lambda t: torch.zeros(t.shape[0], t.shape[1], 8), max_length=16, vocab_size=8)
    path = tmp_path / "blank.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n")

    class Bytes:
        eod = 0

        def tokenize(self, text):
            return list(text.encode())

    with pytest.raises(DataFormatError, match=f"^{path}: 0 tokens to score"):
        evaluate_perplexity(scorer, jsonl_documents([str(path)], Bytes()), eod=0, source=str(path), progress=False)
    with pytest.raises(DataFormatError, match="^valid: 0 tokens to score"):
        evaluate_perplexity(scorer, iter([]), eod=0, name="valid", progress=False)


def test_a_full_output_dir_is_refused_before_the_evaluation_runs(tmp_path, evaluate, monkeypatch):
    import errno
    import os

    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "some text"}) + "\n")
    taken = []

    def full(fd, offset, size):
        taken.append(size)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    code, errors, err = evaluate("--valid-data", good, "--zeroshot-data", good)
    assert code == 2 and len(errors) == 1, err
    assert re.fullmatch(rf"error: --output-dir {tmp_path / 'out'}: no space left in {tmp_path} for the 9 MiB its "
                        r"results need \([0-9.]+ MiB free\); free space or choose another directory", errors[0]), errors
    assert taken == [9 * 2**20]  # 1 MiB of reports, 4 MiB per set's per-token file

    # A file system without fallocate: the bytes are written (and synced); a full disk fails the write.
    def unsupported(fd, offset, size):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    real_write, written = os.write, []

    def write(fd, data):
        written.append(len(data))
        if sum(written) > 3 * 2**20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    monkeypatch.setattr(os, "write", write)
    code, errors, err = evaluate("--valid-data", good)
    monkeypatch.setattr(os, "write", real_write)
    assert code == 2 and len(errors) == 1 and f"no space left in {tmp_path} for the 5 MiB" in errors[0], err
    assert sum(written) == 4 * 2**20 and not [p for p in os.listdir(tmp_path) if p.startswith(".write-test")]
