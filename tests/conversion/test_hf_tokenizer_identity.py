"""The Hugging Face round trip keeps the tokenizer's identity: export-hf writes the checkpoint's tokenizer
(here GPT-2 BPE files) in HF form beside the fingerprint it was trained with (tokenizer_fingerprint.json);
import-hf keeps that record, so the imported checkpoint's tokenizer is still the one its datasets were
preprocessed with. No model is built: the import's tokenizer step runs on a directory of tokenizer files.
"""

from __future__ import annotations

import json

import pytest


def _gpt2_files(folder):
    """A small byte-level GPT-2 BPE (256 byte symbols, 803 merges, <|endoftext|>)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]  # GPT-2's bytes_to_unicode
    # Over 1000 ids: the export reads a smaller vocabulary the way transformers < 5 names its files.
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the")] + [(a, b) for a in letters for b in letters if a + b != "th"][:800]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return str(folder / "vocab.json"), str(folder / "merges.txt"), len(vocab)


def test_import_hf_keeps_the_tokenizer_the_export_recorded(tmp_path):
    from megatron_lev.conversion.hf import export_tokenizer
    from megatron_lev.conversion.hf_import import HFModel, _tokenizer_flags
    from megatron_lev.tokenizer import TokenizerSpec, build_tokenizer, tokenizer_fingerprint
    from megatron_lev.tokenizer.fingerprint import MODEL_DIR_SIDECAR, check_dataset_tokenizer, same_tokenizer, \
        sidecar_path, write_sidecar

    vocab, merges, n = _gpt2_files(tmp_path / "bpe")
    trained = tokenizer_fingerprint(build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    prefix = str(tmp_path / "train_text_document")
    write_sidecar(sidecar_path(prefix), trained)  # the training set, as preprocessing records it
    hf = tmp_path / "hf"
    hf.mkdir()
    # What export-hf writes for the checkpoint: the tokenizer in HF form, and the fingerprint it was trained with.
    export_tokenizer(TokenizerSpec(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges), str(hf))
    write_sidecar(str(hf / MODEL_DIR_SIDECAR), trained)
    (hf / "config.json").write_text(json.dumps({"vocab_size": n}))

    save = tmp_path / "imported"
    flags, ids = _tokenizer_flags(HFModel(str(hf), {"vocab_size": n}, {}, {}), str(save), True, print)
    assert flags == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(save / "tokenizer")]
    imported = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=flags[-1])
    assert ids == n and imported.tokenize(" the thing") == build_tokenizer(
        "GPT2BPETokenizer", vocab_file=vocab, merge_file=merges).tokenize(" the thing")
    fp = tokenizer_fingerprint(imported)
    assert same_tokenizer(fp, trained), (fp, trained)
    check_dataset_tokenizer(prefix, fp)  # the re-imported model trains on its own data

    # The record stands for the files it names only: a changed tokenizer.json is its own tokenizer again.
    path = save / "tokenizer" / "tokenizer.json"
    path.write_text(path.read_text() + "\n")
    changed = tokenizer_fingerprint(build_tokenizer("HuggingFaceTokenizer", tokenizer_model=flags[-1]))
    assert changed["type"] == "HuggingFaceTokenizer" and not same_tokenizer(changed, trained)
    with pytest.raises(ValueError, match="was preprocessed with GPT2BPETokenizer"):
        check_dataset_tokenizer(prefix, changed)
