"""Megatron-LM's TikTokenizer (``--tiktoken-pattern v1|v2``): the same ids as megatron-core's
``TikTokenTokenizer`` on one small vocabulary written both as Megatron-LM's JSON file and as a
``.tiktoken`` rank file; its special-token layout; the one-line refusals."""

from __future__ import annotations

import base64
import json

import pytest

from megatron_lev.arguments import parse_args, parse_run_config
from megatron_lev.lev.config import ConfigError
from megatron_lev.tokenizer import TokenizerSpec, build_tokenizer, write_tiktoken_file

TEXTS = ["Hello world, 12345 times!\n\n  Tabs\tand CamelCaseWords don't split alike in v1 and v2.",
         "caf\u00e9 na\u00efve \U0001F600 //path/to\r\nNEXT line"]


@pytest.fixture(scope="module")
def megatron_vocab(tokenizer_files, tmp_path_factory):
    """The test BPE with the 256 bytes first in byte order (Megatron-LM's JSON format requires it; the merges
    keep their order), as a Megatron-LM JSON vocabulary and as a .tiktoken file."""
    import tiktoken.load

    ranks = tiktoken.load.load_tiktoken_bpe(tokenizer_files.tiktoken_file)
    merges = sorted((t for t in ranks if len(t) > 1), key=ranks.get)
    ordered = {bytes([b]): b for b in range(256)}
    ordered.update({t: 256 + i for i, t in enumerate(merges)})
    root = tmp_path_factory.mktemp("megatron_tiktoken")
    json_path, tik_path = root / "vocab.json", root / "vocab.tiktoken"
    json_path.write_text(json.dumps([{"rank": r, "token_bytes": base64.b64encode(t).decode(),
                                      "token_str": t.decode("utf-8", "replace")} for t, r in ordered.items()]))
    write_tiktoken_file(ordered, str(tik_path))
    return str(json_path), str(tik_path), len(ordered)


def _megatron_core(path, pattern, vocab_size, num_special_tokens=1000):
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

    return TikTokenTokenizer(path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_same_ids_and_special_tokens_as_megatron_core(megatron_vocab, sample_corpus, pattern):
    json_path, tik_path, n = megatron_vocab
    docs = sample_corpus.docs("valid")[:20] + TEXTS
    for vocab_size, num_special in ((None, 1000), (1000 + 300, 1000), (10 + n, 10)):
        ref = _megatron_core(json_path, pattern, vocab_size or 1000 + n, num_special)
        for path in (json_path, tik_path):
            tok = build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern,
                                  tiktoken_num_special_tokens=num_special, vocab_size=vocab_size)
            ids = tok.tokenize_batch(docs)
            assert ids == [ref.text_to_ids(d) for d in docs], (path, vocab_size, num_special)
            assert [tok.tokenize_to_numpy(d).tolist() for d in docs[-2:]] == ids[-2:]
            assert tok.vocab_size == ref.vocab_size == (vocab_size or 1000 + n)
            assert (tok.bos, tok.eod, tok.pad) == (ref.bos_id, ref.eod, ref.pad_id) == (1, 2, 4)
            assert min(min(x) for x in ids) >= num_special and max(max(x) for x in ids) < tok.vocab_size
            assert [tok.detokenize(x) for x in ids] == docs
            assert tok.detokenize([1, 2]) == "<s></s>" and tok.vocab["<SPECIAL_9>"] == 9
    # The pattern is in force: v2 splits "parseHTML" at the case change, v1 does not.
    import regex

    pieces = regex.findall(tok._enc._pat_str, "parseHTML now")
    assert pieces == (["parseHTML", " now"] if pattern == "v1" else ["parse", "HTML", " now"])


def test_special_token_strings_in_text_are_text(megatron_vocab):
    """As every tokenizer here (and Megatron-LM's legacy TikTokenizer): "</s>" in a document is its
    characters, never the EOD id that preprocessing appends itself."""
    tok = build_tokenizer("TikTokenizer", tokenizer_model=megatron_vocab[0], tiktoken_pattern="v2")
    ids = tok.tokenize("end</s><s>start")
    assert min(ids) >= 1000 and tok.detokenize(ids) == "end</s><s>start"


def test_flags_build_the_megatron_layout_and_refuse_what_does_not_apply(megatron_vocab, tmp_path):
    json_path, tik_path, n = megatron_vocab
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--train-iters 4 --lr 1e-3 --mock-data --tokenizer-type TikTokenizer").split()
    args = parse_args(base + ["--tokenizer-model", json_path, "--tiktoken-pattern", "v2", "--vocab-size", "1300",
                              "--tiktoken-num-special-tokens", "500"], world_size=1)
    tok = TokenizerSpec.from_args(args).build()
    assert (tok.vocab_size, tok.eod, tok.tokenize("a")[0] >= 500) == (1300, 2, True)
    refusals = {
        ("--tokenizer-model", tik_path, "--tiktoken-num-special-tokens", "5"): "--tiktoken-num-special-tokens applies",
    }
    for extra, start in refusals.items():
        with pytest.raises(ConfigError) as e:
            parse_args(base + list(extra), world_size=1)
        assert str(e.value).startswith(start) and "\n" not in str(e.value)
    # beside OpenAI's layout --vocab-size is the model's vocabulary, refused once the tokenizer shows it too small
    o200k = base + ["--tokenizer-model", tik_path, "--tiktoken-pattern", "o200k", "--vocab-size", "1300"]
    tok = TokenizerSpec.from_args(parse_args(o200k, world_size=1)).build()
    with pytest.raises(ConfigError, match=rf"^--vocab-size 1300 is smaller than the TikTokenizer's {tok.vocab_size} "):
        parse_run_config(o200k, world_size=1).with_tokenizer(tok)
    with pytest.raises(ConfigError, match="invalid choice: 'v3'"):
        parse_args(base + ["--tokenizer-model", json_path, "--tiktoken-pattern", "v3"], world_size=1)


def test_tokenizer_errors_name_the_fix(megatron_vocab, tmp_path):
    json_path, tik_path, n = megatron_vocab
    cases = [
        (dict(tokenizer_model=json_path, tiktoken_pattern="o200k"), "give --tiktoken-pattern v1 or v2"),
        (dict(tokenizer_model=tik_path, tiktoken_pattern="v2", vocab_size=1000 + n + 1),
         f"give --vocab-size {1000 + n} or less"),
        (dict(tokenizer_model=tik_path, tiktoken_pattern="v2", vocab_size=1000), "leaves no ids"),
        (dict(tokenizer_model=tik_path, tiktoken_pattern="v2", tiktoken_num_special_tokens=3), "less than"),
        (dict(tokenizer_model=tik_path, tiktoken_pattern="v2", vocab_size=1000 + 100), "include the 256 single bytes"),
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"rank": 0, "token_bytes": base64.b64encode(b"b").decode(), "token_str": "b"}]))
    cases.append((dict(tokenizer_model=str(bad), tiktoken_pattern="v1"), "must be the single byte 0"))
    for kw, part in cases:
        with pytest.raises(ValueError) as e:
            build_tokenizer("TikTokenizer", **kw)
        assert part in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
