"""Tokenizer backends: reference ids, backend agreement, vocab padding, training."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_lev.data.jsonl import iter_json_docs
from megatron_lev.tokenizer import build_tokenizer, padded_vocab_size, write_tiktoken_file


@pytest.fixture(scope="module")
def gpt2_files(shared_data):
    d = shared_data / "tokenizers" / "gpt2"
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="module")
def gpt2_tiktoken_file(gpt2_files, tmp_path_factory):
    import tiktoken.load

    vocab, merges = gpt2_files
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(merges, vocab)
    path = tmp_path_factory.mktemp("tik") / "gpt2.tiktoken"
    write_tiktoken_file(ranks, str(path))
    return str(path)


def test_gpt2_hello_world_every_backend(gpt2_files, gpt2_tiktoken_file):
    vocab, merges = gpt2_files
    toks = [
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),  # tiktoken
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, backend="hf"),
        build_tokenizer("TikTokenizer", tokenizer_model=gpt2_tiktoken_file, tiktoken_pattern="gpt2"),
    ]
    for tok in toks:
        assert tok.tokenize("Hello world") == [15496, 995], tok
        assert tok.tokenize_to_numpy("Hello world").tolist() == [15496, 995]
        assert tok.detokenize([15496, 995]) == "Hello world"
        assert tok.vocab_size == 50257 and tok.eod == 50256 and tok.pad == -1
        assert tok.unique_identifiers["class"] == type(tok).__name__


def test_gpt2_tiktoken_equals_hf_on_corpus(gpt2_files, shared_data):
    vocab, merges = gpt2_files
    tik = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    hf = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, backend="hf")
    docs = list(iter_json_docs([str(shared_data / "corpus" / "valid.jsonl.zst")]))
    docs.append("a <|endoftext|> in the text is plain text 'll 've \u00e9\u00e8 \U0001F600  \n\n  x")
    a = tik.tokenize_batch(docs)
    b = hf.tokenize_batch(docs)
    assert sum(map(len, a)) > 400_000
    assert a == b
    assert [x.tolist() for x in tik.tokenize_batch_to_numpy(docs[-3:])] == a[-3:]


def test_neox_tokenizer_json(shared_data):
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(shared_data / "tokenizers" / "neox" / "tokenizer.json"))
    assert tok.tokenize("Hello world") == [12092, 1533]
    assert tok.eod == 0  # <|endoftext|>
    assert tok.vocab_size >= 50277
    assert tok.detokenize([12092, 1533]) == "Hello world"
    # a directory holding tokenizer.json works too
    tok2 = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(shared_data / "tokenizers" / "neox"))
    assert tok2.tokenize("Hello world") == [12092, 1533]


def test_mistral_sentencepiece_no_bos(shared_data):
    path = str(shared_data / "tokenizers" / "mistral" / "tokenizer.model")
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)
    # tokenize adds no BOS (id 1) and no EOS; EOD is the model's </s> (2)
    assert tok.tokenize("Hello world") == [22557, 1526]
    assert tok.bos == 1 and tok.eod == 2 and tok.vocab_size == 32000
    assert build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=path).tokenize("Hello world") == [22557, 1526]


def test_null_tokenizer_and_padding():
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert tok.vocab_size == 1001 and tok.eod == 1000
    assert tok.tokenize("5 7 11") == [5, 7, 11]
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(32000, 128, 2) == 32000


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        build_tokenizer("NoSuchTokenizer")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))


@pytest.mark.parametrize("model_type", ["sentencepiece_bpe", "hf_bytelevel_bpe"])
def test_train_tokenizer(model_type, shared_data, tmp_path):
    from megatron_lev.tokenizer.train import train_tokenizer

    written = train_tokenizer(
        [str(shared_data / "corpus" / "valid.jsonl.zst")], str(tmp_path / "tok"), 1000, model_type,
        max_docs=60, progress=False,
    )
    text = "The quick brown fox jumps over the lazy dog."
    if model_type.startswith("sentencepiece"):
        tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=written[0])
    else:
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"))
        gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "tok" / "vocab.json"),
                               merge_file=str(tmp_path / "tok" / "merges.txt"))
        assert gpt2.tokenize(text) == tok.tokenize(text) and gpt2.eod == tok.eod == 999
        assert json.load(open(tmp_path / "tok" / "vocab.json"))["<|endoftext|>"] == 999
    assert tok.vocab_size == 1000
    ids = tok.tokenize(text)
    assert max(ids) < 1000 and tok.detokenize(ids) == text
