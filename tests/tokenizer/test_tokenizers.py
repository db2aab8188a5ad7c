"""Tokenizer backends: reference ids, backend agreement, vocab padding, training."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import pytest

from megatron_lev.jsonl import iter_json_docs
from megatron_lev.tokenizer import TOKENIZER_TYPES, TokenizerSpec, build_tokenizer, padded_vocab_size, \
    write_tiktoken_file
from tests.conftest import BPE_VOCAB, REPO_ROOT, SENTENCEPIECE_VOCAB


TRICKY = "a <|endoftext|> in the text is plain text 'll 've \u00e9\u00e8 \U0001F600  \n\n  x"


def test_bpe_every_format_and_backend_agree(tok_args, tokenizer_files, sample_corpus):
    """One byte-level BPE as GPT-2 files (tiktoken and HF backends), tokenizer.json (file and directory)
    and .tiktoken: the same ids on the whole validation corpus, and a lossless round trip."""
    ref = build_tokenizer(**tok_args["gpt2"])  # tiktoken backend
    others = [
        build_tokenizer(**tok_args["gpt2"], backend="hf"),
        build_tokenizer(**tok_args["hf"]),
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_files.bpe_dir),
        build_tokenizer(**tok_args["tiktoken"]),
    ]
    docs = sample_corpus.docs("valid") + [TRICKY]
    ids = ref.tokenize_batch(docs)
    assert sum(map(len, ids)) > 100_000
    assert all(max(x) < BPE_VOCAB for x in ids)
    assert ref.vocab_size == BPE_VOCAB and ref.eod == BPE_VOCAB - 1 and ref.pad == -1
    assert [ref.detokenize(x) for x in ids] == docs
    assert [x.tolist() for x in ref.tokenize_batch_to_numpy(docs[-3:])] == ids[-3:]
    assert ref.tokenize_to_numpy(docs[0]).tolist() == ids[0]
    for tok in others:
        # tokenizer.json declares <|endoftext|> special, so HF matches it inside text: compare without TRICKY
        n = len(docs) if tok.unique_identifiers["class"] != "HuggingFaceTokenizer" else -1
        assert tok.tokenize_batch(docs[:n]) == ids[:n], tok
        assert tok.vocab_size == BPE_VOCAB, tok
        assert tok.detokenize(ids[1]) == docs[1], tok
        assert tok.unique_identifiers["class"] == type(tok).__name__
    assert others[0].eod == others[1].eod == BPE_VOCAB - 1


def test_sentencepiece_no_bos_and_lossless(tok_args, sample_corpus):
    tok = build_tokenizer(**tok_args["sentencepiece"])
    # tokenize adds no BOS (id 1) and no EOS; EOD is the model's </s> (2)
    assert tok.bos == 1 and tok.eod == 2 and tok.vocab_size == SENTENCEPIECE_VOCAB
    docs = sample_corpus.docs("valid")[:4]
    ids = [tok.tokenize(d) for d in docs]
    assert all(x[0] != 1 and x[-1] != 2 for x in ids)
    assert [tok.detokenize(x) for x in ids] == docs  # identity normalisation keeps the text exact
    gpt_sp = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=tok_args["sentencepiece"]["tokenizer_model"])
    assert [gpt_sp.tokenize(d) for d in docs] == ids


# ---------------------------------------------------------------------------------------------- real files


@pytest.fixture(scope="module")
def gpt2_tiktoken_file(real_tok_args, tmp_path_factory):
    import tiktoken.load

    g = real_tok_args["gpt2"]
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(g["merge_file"], g["vocab_file"])
    path = tmp_path_factory.mktemp("tik") / "gpt2.tiktoken"
    write_tiktoken_file(ranks, str(path))
    return str(path)


def test_real_gpt2_hello_world_every_backend(real_tok_args, gpt2_tiktoken_file):
    g = real_tok_args["gpt2"]
    toks = [
        build_tokenizer(**g),  # tiktoken
        build_tokenizer(**g, backend="hf"),
        build_tokenizer("TikTokenizer", tokenizer_model=gpt2_tiktoken_file, tiktoken_pattern="gpt2"),
    ]
    for tok in toks:
        assert tok.tokenize("Hello world") == [15496, 995], tok
        assert tok.tokenize_to_numpy("Hello world").tolist() == [15496, 995]
        assert tok.detokenize([15496, 995]) == "Hello world"
        assert tok.vocab_size == 50257 and tok.eod == 50256 and tok.pad == -1


def test_real_gpt2_tiktoken_equals_hf_on_corpus(real_tok_args, shared_data):
    tik = build_tokenizer(**real_tok_args["gpt2"])
    hf = build_tokenizer(**real_tok_args["gpt2"], backend="hf")
    docs = list(iter_json_docs([str(shared_data / "corpus" / "valid.jsonl.zst")])) + [TRICKY]
    a = tik.tokenize_batch(docs)
    assert sum(map(len, a)) > 400_000
    assert a == hf.tokenize_batch(docs)


def test_real_neox_tokenizer_json(real_tok_args):
    path = real_tok_args["neox"]["tokenizer_model"]
    tok = build_tokenizer(**real_tok_args["neox"])
    assert tok.tokenize("Hello world") == [12092, 1533]
    assert tok.eod == 0  # <|endoftext|>
    assert tok.vocab_size >= 50277
    assert tok.detokenize([12092, 1533]) == "Hello world"
    tok2 = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=os.path.dirname(path))
    assert tok2.tokenize("Hello world") == [12092, 1533]


def test_real_mistral_sentencepiece_no_bos(real_tok_args):
    path = real_tok_args["mistral"]["tokenizer_model"]
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)
    assert tok.tokenize("Hello world") == [22557, 1526]
    assert tok.bos == 1 and tok.eod == 2 and tok.vocab_size == 32000
    assert build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=path).tokenize("Hello world") == [22557, 1526]


# ---------------------------------------------------------------------------------------------- misc


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
def test_train_tokenizer(model_type, sample_corpus, tmp_path):
    from megatron_lev.tokenizer.train import train_tokenizer

    written = train_tokenizer(
        [sample_corpus.valid], str(tmp_path / "tok"), 1000, model_type,
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


def test_tokenizer_spec_takes_each_setting_from_the_first_source_that_gives_it():
    flags = argparse.Namespace(tokenizer_type=None, tokenizer_model="flag.tiktoken", vocab_file="", json_key="text")
    saved = {"tokenizer_type": "TikTokenizer", "tokenizer_model": "saved.tiktoken", "tiktoken_pattern": "gpt2",
             "vocab_file": "saved.json", "num_layers": 2}
    spec = TokenizerSpec.from_args(flags, saved)
    assert spec == TokenizerSpec(tokenizer_type="TikTokenizer", tokenizer_model="flag.tiktoken",
                                 vocab_file="saved.json", tiktoken_pattern="gpt2")
    assert spec.kwargs() == dict(vocab_file="saved.json", merge_file=None, tokenizer_model="flag.tiktoken",
                                 vocab_size=None, tiktoken_pattern="gpt2", tiktoken_num_special_tokens=1000)
    # a setting no source gives keeps its default; no tokenizer type at all is no spec
    assert TokenizerSpec.from_args({"tokenizer_type": "NullTokenizer", "tiktoken_pattern": None}).tiktoken_pattern == "o200k"
    assert TokenizerSpec.from_args(flags, {}) is None


def test_training_preprocessing_evaluation_and_export_build_the_same_tokenizer(tok_args):
    """The four places that name a tokenizer read its settings through TokenizerSpec: training flags,
    PreprocessConfig, evaluation flags over a checkpoint's saved arguments, the export's saved arguments."""
    from megatron_lev.conversion.hf import tokenizer_info
    from megatron_lev.data import PreprocessConfig
    from megatron_lev.evaluation.cli import _tokenizer_for_checkpoint
    from megatron_lev.evaluation.cli import build_parser as eval_parser
    from megatron_lev.arguments import build_parser as train_parser
    from megatron_lev.training.data import build_tokenizer_from_args
    from tests.conftest import tokenizer_flags

    from megatron_lev.arguments import parse_run_config

    kw = tok_args["tiktoken"]  # a pattern other than the default: every path has to carry it
    ref = build_tokenizer(**kw)
    # a checkpoint's saved configuration, as evaluation reads it (typed)
    saved = parse_run_config(tokenizer_flags(kw) + "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                             "--seq-length 32 --micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data".split(),
                             world_size=1)
    built = {
        "training": build_tokenizer_from_args(train_parser().parse_args(tokenizer_flags(kw))),
        "preprocessing": TokenizerSpec.from_args(PreprocessConfig(inputs=["x"], output_prefix="y", **kw)).build(),
        "evaluation": _tokenizer_for_checkpoint(eval_parser().parse_args(["--load", "ckpt"]), saved),
    }
    for name, tok in built.items():
        assert type(tok) is type(ref) and tok.tokenize(TRICKY) == ref.tokenize(TRICKY), name
        assert (tok.vocab_size, tok.eod) == (ref.vocab_size, ref.eod), name
    info = tokenizer_info(saved.data)
    assert (info["type"], info["vocab_size"], info["eod"]) == ("TikTokenizer", ref.vocab_size, ref.eod)
    # evaluation flags override the saved files
    other = dict(tok_args["sentencepiece"])
    flags = eval_parser().parse_args(["--load", "ckpt", "--tokenizer-type", other["tokenizer_type"],
                                      "--tokenizer-model", other["tokenizer_model"]])
    assert _tokenizer_for_checkpoint(flags, saved).tokenize(TRICKY) == build_tokenizer(**other).tokenize(TRICKY)


def _tokenizer_actions(parser: argparse.ArgumentParser):
    return {a.dest: a for a in parser._actions if a.dest in {f.name for f in dataclasses.fields(TokenizerSpec)}}


def test_every_tool_takes_its_tokenizer_flags_from_tokenizer_spec():
    from megatron_lev.arguments import build_parser
    from megatron_lev.evaluation.cli import build_parser as eval_parser

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        import preprocess_data
    finally:
        sys.path.remove(str(REPO_ROOT / "tools"))
    spec_fields = {f.name: f for f in dataclasses.fields(TokenizerSpec)}
    for parser in (build_parser(), preprocess_data.build_parser()):
        actions = _tokenizer_actions(parser)
        assert set(actions) == set(spec_fields)
        for name, action in actions.items():
            f = spec_fields[name]
            assert tuple(action.choices or ()) == tuple(f.metadata.get("choices", ())), name
            assert action.default == (None if name == "tokenizer_type" else f.default), name
    # Preprocessing cannot fall back on anything: there the type is required.
    assert _tokenizer_actions(preprocess_data.build_parser())["tokenizer_type"].required
    assert not _tokenizer_actions(build_parser())["tokenizer_type"].required
    ev = _tokenizer_actions(eval_parser())
    # evaluate.py: unset means "the checkpoint's", so no flag there may carry a default of its own.
    assert set(ev) == {"tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"}
    assert all(a.default is None for a in ev.values())
    assert tuple(ev["tokenizer_type"].choices) == TOKENIZER_TYPES
