"""One tokenizer interface over GPT-2 BPE files, tiktoken rank files, HF tokenizer.json and SentencePiece.

Every tokenizer exposes what megatron-core's dataset code reads (``vocab_size``, ``eod``, ``pad``,
``unique_identifiers``) plus ``tokenize``, ``tokenize_batch``, ``tokenize_to_numpy``, ``detokenize``
and, where cheap, ``vocab`` / ``inv_vocab``.

Conventions (the same for every backend, so ``--append-eod`` means one thing):

* ``tokenize`` never adds BOS/EOS or any other special token; special-token strings that occur in
  the text (e.g. ``<|endoftext|>``) are encoded as ordinary text, as Megatron-LM's GPT-2 tokenizer
  does. The preprocessing tool appends ``eod`` itself.
* ``pad`` is ``-1`` when the vocabulary has no pad token; megatron-core then uses its own
  "no pad" id (-1) and masks nothing.
* ``vocab_size`` is the size of the tokenizer's id space (every id it can emit is ``< vocab_size``);
  the model's embedding size is ``padded_vocab_size(vocab_size, divisible_by, tp)``.
"""

from __future__ import annotations

import base64
import json
import os
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

# Pre-tokenisation patterns of the OpenAI encodings (as in tiktoken_ext.openai_public).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Megatron-LM's TikTokenizer patterns (``--tiktoken-pattern v1|v2``), read from megatron-core when used (its
# module imports torch). With them the ids follow Megatron-LM's layout: see ``megatron_special_tokens``.
MEGATRON_TIKTOKEN_PATTERNS = ("v1", "v2")
TIKTOKEN_PATTERNS = {"gpt2": GPT2_PATTERN, "r50k": GPT2_PATTERN, "cl100k": CL100K_PATTERN, "o200k": O200K_PATTERN,
                     **{name: None for name in MEGATRON_TIKTOKEN_PATTERNS}}
# Megatron-LM's default --tiktoken-num-special-tokens and vocabulary size (its DEFAULT_TIKTOKEN_MAX_VOCAB).
MEGATRON_NUM_SPECIAL_TOKENS = 1000
MEGATRON_TIKTOKEN_MAX_VOCAB = 2**17


def vocab_size_sets_tokenizer(tokenizer_type: str, tiktoken_pattern: Optional[str]) -> bool:
    """Whether ``--vocab-size`` makes the tokenizer's ids: NullTokenizer, and a TikTokenizer in Megatron-LM's id
    layout (``--tiktoken-pattern v1/v2``), which cuts its file there. Other tokenizers take theirs from files."""
    return tokenizer_type == "NullTokenizer" or (tokenizer_type == "TikTokenizer"
                                                 and tiktoken_pattern in MEGATRON_TIKTOKEN_PATTERNS)


def vocab_size_refusal(tokenizer_type: str, vocab_size: Optional[int],
                       tiktoken_pattern: Optional[str]) -> Optional[str]:
    """Why ``--vocab-size`` does not apply to this tokenizer where no model is built (preprocessing; one line),
    or None where it does (see :func:`vocab_size_sets_tokenizer`)."""
    if vocab_size is None or vocab_size_sets_tokenizer(tokenizer_type, tiktoken_pattern):
        return None
    return (f"--vocab-size {vocab_size} applies to NullTokenizer (and TikTokenizer with --tiktoken-pattern v1/v2) "
            f"only; {tokenizer_type} takes its vocabulary from its files: drop --vocab-size")


def model_vocab_size(tokenizer: "LevTokenizer", tokenizer_type: str, vocab_size: Optional[int],
                     tiktoken_pattern: Optional[str]) -> int:
    """The model's vocabulary before padding: the tokenizer's ids, or a ``--vocab-size`` given beside a
    tokenizer with files (Megatron-LM's Llama-3 scripts pass ``--vocab-size 128256`` with its tokenizer.json),
    which must hold every id the tokenizer emits (ValueError, one line, if smaller)."""
    if vocab_size is None or vocab_size_sets_tokenizer(tokenizer_type, tiktoken_pattern):
        return tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"--vocab-size {vocab_size} is smaller than the {tokenizer_type}'s {tokenizer.vocab_size} "
                         f"ids: give at least {tokenizer.vocab_size}, or drop --vocab-size")
    return vocab_size


def hub_cached_tokenizer(repo_id: str) -> tuple:
    """(path, cache): the ``tokenizer.json`` of Hugging Face hub id ``repo_id`` in the local Hugging Face cache
    (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``: where ``huggingface-cli download``
    puts it), its ``main`` revision, or None; and that cache folder. Nothing is downloaded."""
    from huggingface_hub import constants, try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "tokenizer.json", cache_dir=constants.HF_HUB_CACHE)
    return (found if isinstance(found, str) else None), constants.HF_HUB_CACHE


def _pattern_regex(pattern: str) -> str:
    if pattern not in TIKTOKEN_PATTERNS:
        raise ValueError(f"unknown tiktoken pattern {pattern!r}; choose one of {sorted(TIKTOKEN_PATTERNS)}")
    if pattern in MEGATRON_TIKTOKEN_PATTERNS:
        from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as mt

        return {"v1": mt._PATTERN_TIKTOKEN_V1, "v2": mt._PATTERN_TIKTOKEN_V2}[pattern]
    return TIKTOKEN_PATTERNS[pattern]


def megatron_special_tokens(num_special_tokens: int) -> List[str]:
    """Megatron-LM's TikTokenizer special tokens, ids 0..num_special_tokens-1: ``<unk> <s> </s> <mask>
    <pad> <cls> <sep>`` then ``<SPECIAL_7>``, ... (megatron-core's ``SPECIAL_TOKENS`` and template)."""
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as mt

    named = list(mt.SPECIAL_TOKENS)
    if not len(named) <= num_special_tokens:
        raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens} is less than Megatron-LM's "
                         f"{len(named)} named special tokens ({' '.join(named)})")
    return named + [mt.SPECIAL_TOKEN_TEMPLATE.format(id=i) for i in range(len(named), num_special_tokens)]


def load_megatron_vocab(path: str) -> Dict[bytes, int]:
    """Mergeable ranks of Megatron-LM's TikTokenizer vocabulary file (a JSON list of ``{"rank",
    "token_bytes" (base64), "token_str"}`` in rank order, the 256 single bytes first), checked as
    megatron-core's ``reload_mergeable_ranks`` checks it."""
    with open(path, encoding="utf-8") as f:
        vocab = json.load(f)
    if not isinstance(vocab, list):
        raise ValueError(f"--tokenizer-model {path}: expected Megatron-LM's TikTokenizer vocabulary, a JSON list "
                         "of {rank, token_bytes, token_str}")
    ranks: Dict[bytes, int] = {}
    for i, x in enumerate(vocab):
        if not isinstance(x, dict) or x.keys() != {"rank", "token_bytes", "token_str"} or x["rank"] != i:
            raise ValueError(f"--tokenizer-model {path}: entry {i} is not {{rank: {i}, token_bytes, token_str}}")
        token = base64.b64decode(x["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise ValueError(f"--tokenizer-model {path}: entry {i} must be the single byte {i} (the first 256 "
                             "entries are the bytes)")
        ranks[token] = i
    if len(ranks) != len(vocab):
        raise ValueError(f"--tokenizer-model {path}: repeated tokens")
    return ranks


def _default_special_tokens(pattern: str, n_ranks: int) -> Dict[str, int]:
    if pattern in ("gpt2", "r50k"):
        return {"<|endoftext|>": n_ranks}
    if pattern == "cl100k":
        return {
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        }
    if pattern == "o200k":
        return {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
    raise ValueError(f"unknown tiktoken pattern {pattern!r}; choose one of {sorted(TIKTOKEN_PATTERNS)}")


def padded_vocab_size(orig_vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's vocabulary padding: round up to a multiple of ``divisible_by * tp``."""
    if orig_vocab_size <= 0:
        raise ValueError(f"vocab size must be positive, got {orig_vocab_size}")
    multiple = max(1, int(divisible_by)) * max(1, int(tp))
    return ((int(orig_vocab_size) + multiple - 1) // multiple) * multiple


class LevTokenizer:
    """Base class. Subclasses set ``_vocab_size``, ``_eod``, ``_pad`` and implement ``tokenize``."""

    tokenizer_type: str = "base"

    def __init__(self, *paths: Optional[str], **options: Any) -> None:
        self.unique_identifiers: "OrderedDict[str, Any]" = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [os.path.abspath(p) for p in paths if p]
        for k, v in options.items():
            self.unique_identifiers[k] = str(v)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self._pad = -1
        self._bos: Optional[int] = None

    # --- what megatron-core reads -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    # --- encoding -----------------------------------------------------------------------------
    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(t) for t in texts]

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        """Ids of one text as an integer numpy array (fast path used by preprocessing)."""
        return np.asarray(self.tokenize(text), dtype=np.int64)

    def tokenize_batch_to_numpy(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.tokenize_batch(texts)]

    def detokenize(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    # --- vocab --------------------------------------------------------------------------------
    @property
    def vocab(self) -> Dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} has no string vocabulary")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


class TikTokenizer(LevTokenizer):
    """A tiktoken ``Encoding`` over a ``.tiktoken`` rank file, GPT-2 vocab.json + merges.txt, or (with
    Megatron-LM's patterns) Megatron-LM's JSON vocabulary.

    With an OpenAI pattern (gpt2, r50k, cl100k, o200k) the ids are the file's ranks and the special
    tokens follow them (``<|endoftext|>`` is EOD). With Megatron-LM's ``v1``/``v2`` the ids are laid out
    as Megatron-LM's TikTokenizer lays them out: ids ``0..num_special_tokens-1`` are the special tokens
    (:func:`megatron_special_tokens`; ``<s>`` = 1 is BOS, ``</s>`` = 2 is EOD, ``<pad>`` = 4 the pad),
    the file's ranks follow, shifted by ``num_special_tokens``, cut to ``vocab_size`` ids in all
    (Megatron-LM's ``--vocab-size``, default 2**17; here at most the file's size, where Megatron-LM
    requires the file to fill it). Special-token strings in the text are encoded as text, as by every
    tokenizer here and Megatron-LM's legacy TikTokenizer (megatron-core's encodes them as their ids).
    """

    tokenizer_type = "TikTokenizer"

    def __init__(
        self,
        tokenizer_model: Optional[str] = None,
        *,
        pattern: str = "o200k",
        special_tokens: Optional[Dict[str, int]] = None,
        eod_token: Optional[str] = None,
        vocab_file: Optional[str] = None,
        merge_file: Optional[str] = None,
        num_special_tokens: int = MEGATRON_NUM_SPECIAL_TOKENS,
        vocab_size: Optional[int] = None,
    ) -> None:
        import tiktoken
        import tiktoken.load

        regex = _pattern_regex(pattern)
        megatron = pattern in MEGATRON_TIKTOKEN_PATTERNS
        if tokenizer_model is not None:
            _require_file(tokenizer_model, "--tokenizer-model")
            if tokenizer_model.endswith(".json"):
                if not megatron:
                    raise ValueError(f"--tokenizer-model {tokenizer_model}: a JSON vocabulary is Megatron-LM's "
                                     "TikTokenizer format; give --tiktoken-pattern v1 or v2")
                ranks = load_megatron_vocab(tokenizer_model)
            else:
                ranks = tiktoken.load.load_tiktoken_bpe(tokenizer_model)
            paths = (tokenizer_model,)
        else:
            _check_gpt2_files(vocab_file, merge_file)
            try:
                ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(merge_file, vocab_file)
            except (AssertionError, KeyError):  # tiktoken checks the pair with bare asserts
                raise ValueError(f"--vocab-file {vocab_file} and --merge-file {merge_file} do not make one GPT-2 "
                                 "BPE: vocab.json must hold the 256 byte tokens, then each merge's result with ids "
                                 "in merge order (are they from the same tokenizer?)") from None
            paths = (vocab_file, merge_file)
        if megatron:
            if special_tokens is not None:
                raise ValueError("--tiktoken-pattern v1/v2 lays out Megatron-LM's special tokens; give no others")
            names = megatron_special_tokens(num_special_tokens)
            ranks, vocab_size = _megatron_ranks(ranks, num_special_tokens, vocab_size, paths[0])
            special_tokens = {t: i for i, t in enumerate(names)}
            eod_token = eod_token or "</s>"
            super().__init__(*paths, pattern=pattern, num_special_tokens=num_special_tokens, vocab_size=vocab_size)
        else:
            if vocab_size is not None:
                raise ValueError(f"--vocab-size {vocab_size}: a TikTokenizer with pattern {pattern} takes its "
                                 "vocabulary from its file (only Megatron-LM's v1/v2 layout is cut to --vocab-size)")
            super().__init__(*paths, pattern=pattern)
        eod_token = eod_token or "<|endoftext|>"
        if special_tokens is None:
            special_tokens = _default_special_tokens(pattern, len(ranks))
            if vocab_file is not None:  # take the ids of special tokens from vocab.json
                with open(vocab_file, encoding="utf-8") as f:
                    vocab = json.load(f)
                special_tokens = {k: vocab[k] for k in special_tokens if k in vocab} or special_tokens
        self._enc = tiktoken.Encoding(
            name=os.path.basename(paths[0]),
            pat_str=regex,
            mergeable_ranks=ranks,
            special_tokens=dict(special_tokens),
        )
        self._special = dict(special_tokens)
        self._vocab_size = int(self._enc.n_vocab)
        if eod_token not in self._special:
            raise ValueError(f"eod token {eod_token!r} is not a special token of this encoding")
        self._eod = self._special[eod_token]
        if megatron:
            self._bos, self._pad = self._special["<s>"], self._special["<pad>"]
        self._core = self._enc._core_bpe
        self._has_buffer = hasattr(self._core, "encode_to_tiktoken_buffer")  # private; not in every tiktoken release

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self._enc.encode_ordinary(t) for t in texts]

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        if self._has_buffer:
            try:
                # allowed_special=set(): special-token strings are plain text, as in encode_ordinary.
                return np.frombuffer(self._core.encode_to_tiktoken_buffer(text, set()), dtype=np.uint32)
            except UnicodeEncodeError:
                pass
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def tokenize_batch_to_numpy(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [self.tokenize_to_numpy(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    @property
    def vocab(self) -> Dict[str, int]:
        # Tokens are bytes; decode with replacement (ids of partial UTF-8 sequences are lossy here).
        out = {}
        for i in range(self._vocab_size):
            try:
                out[self._enc.decode_single_token_bytes(i).decode("utf-8", "replace")] = i
            except KeyError:
                continue
        return out


def _megatron_ranks(ranks: Dict[bytes, int], num_special_tokens: int, vocab_size: Optional[int],
                    path: str):
    """The ranks shifted past ``num_special_tokens`` and cut to ``vocab_size`` ids in all, as Megatron-LM's
    TikTokenizer does; returns (ranks, vocab_size)."""
    if vocab_size is None:
        vocab_size = min(MEGATRON_TIKTOKEN_MAX_VOCAB, num_special_tokens + len(ranks))
    if not num_special_tokens < vocab_size:
        raise ValueError(f"--vocab-size {vocab_size} leaves no ids after the --tiktoken-num-special-tokens "
                         f"{num_special_tokens} special tokens")
    inner = vocab_size - num_special_tokens
    if inner > len(ranks):
        raise ValueError(f"--vocab-size {vocab_size} is more than the {num_special_tokens} special tokens plus the "
                         f"{len(ranks)} tokens of {path}; give --vocab-size {num_special_tokens + len(ranks)} or less")
    kept = {t: r + num_special_tokens for t, r in ranks.items() if r < inner}
    if len(kept) != inner or any(bytes([b]) not in kept for b in range(256)):
        raise ValueError(f"{path}: its first {inner} ranks (--vocab-size {vocab_size} minus the special tokens) "
                         "must be distinct and include the 256 single bytes")
    return kept, vocab_size


class GPT2BPETokenizer(TikTokenizer):
    """Megatron's ``GPT2BPETokenizer`` (vocab.json + merges.txt).

    ``backend="tiktoken"`` (default, ~10x faster) or ``"hf"`` (HF ``tokenizers`` ByteLevel BPE);
    the two give the same ids (checked in the tests).
    """

    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, *, backend: str = "tiktoken") -> None:
        if backend not in ("tiktoken", "hf"):
            raise ValueError(f"unknown GPT-2 backend {backend!r} (tiktoken or hf)")
        self.backend = backend
        super().__init__(vocab_file=vocab_file, merge_file=merge_file, pattern="gpt2")
        with open(vocab_file, encoding="utf-8") as f:
            self._vocab = json.load(f)
        self._vocab_size = len(self._vocab)
        self._eod = self._vocab["<|endoftext|>"]
        if backend == "hf":
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers

            tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            self._hf = tok

    def tokenize(self, text: str) -> List[int]:
        if self.backend == "hf":
            return self._hf.encode(text, add_special_tokens=False).ids
        return super().tokenize(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if self.backend == "hf":
            return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]
        return super().tokenize_batch(texts)

    def tokenize_to_numpy(self, text: str) -> np.ndarray:
        if self.backend == "hf":
            return np.asarray(self.tokenize(text), dtype=np.uint32)
        return super().tokenize_to_numpy(text)

    def tokenize_batch_to_numpy(self, texts: Sequence[str]) -> List[np.ndarray]:
        if self.backend == "hf":
            return [np.asarray(ids, dtype=np.uint32) for ids in self.tokenize_batch(texts)]
        return super().tokenize_batch_to_numpy(texts)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab


class HuggingFaceTokenizer(LevTokenizer):
    """Any HF ``tokenizer.json`` (a file or a directory holding one), through the ``tokenizers`` library.

    ``add_special_tokens=False`` by default (no BOS from the post-processor; EOD appended by the tool).
    ``eod`` is the first of ``eod_token`` or the usual end tokens that the vocabulary holds.
    """

    tokenizer_type = "HuggingFaceTokenizer"
    _EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]", "<|eot_id|>")
    _PAD_CANDIDATES = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>")

    def __init__(
        self,
        tokenizer_model: str,
        *,
        eod_token: Optional[str] = None,
        add_special_tokens: bool = False,
    ) -> None:
        from tokenizers import Tokenizer

        path = tokenizer_model
        if path is not None and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        _require_file(path, "--tokenizer-model")
        super().__init__(path, add_special_tokens=add_special_tokens, eod_token=eod_token)
        self._tok = Tokenizer.from_file(path)
        self._add_special = add_special_tokens
        self._vocab_cache: Optional[Dict[str, int]] = None
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(self._vocab_size, max(vocab.values()) + 1)
        candidates = (eod_token,) if eod_token else self._EOD_CANDIDATES
        eod = next((vocab[c] for c in candidates if c in vocab), None)
        if eod is None:
            raise ValueError(f"{path}: no end-of-document token among {candidates}; pass eod_token=")
        self._eod = eod
        self._pad = next((vocab[c] for c in self._PAD_CANDIDATES if c in vocab), -1)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=self._add_special)]

    def tokenize_batch_to_numpy(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32) for ids in self.tokenize_batch(texts)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab_cache is None:
            self._vocab_cache = self._tok.get_vocab(with_added_tokens=True)
        return self._vocab_cache


class SentencePieceTokenizer(LevTokenizer):
    """A SentencePiece ``.model`` (Megatron's ``SentencePieceTokenizer``/``GPTSentencePieceTokenizer``/
    ``Llama2Tokenizer``).

    ``tokenize`` is ``encode(text)`` with neither BOS nor EOS (SentencePiece adds them only when asked;
    Megatron's GPT SentencePiece tokenizer does the same); ``eod`` is the model's EOS id.
    Decoding is lossy where the model normalises text (see the tests).
    """

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model: str, *, add_bos: bool = False) -> None:
        import sentencepiece as spm

        _require_file(tokenizer_model, "--tokenizer-model")
        super().__init__(tokenizer_model, add_bos=add_bos)
        self._sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
        self._add_bos = add_bos
        self._vocab_size = int(self._sp.get_piece_size())
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"{tokenizer_model}: the SentencePiece model has no EOS token to use as EOD")
        self._eod = eos
        self._pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else -1
        self._bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text, add_bos=self._add_bos)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), add_bos=self._add_bos, num_threads=1)

    def tokenize_batch_to_numpy(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32) for ids in self.tokenize_batch(texts)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab(self) -> Dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._vocab_size)}


class NullTokenizer(LevTokenizer):
    """Megatron's ``NullTokenizer``: text is whitespace-separated ids; ``eod`` = ``vocab_size - 1``.

    ``NullTokenizer(vocab_size=V)`` has ids ``0..V-1`` for data and EOD ``V``, so ``self.vocab_size = V + 1``
    (as in Megatron-LM).
    """

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError("NullTokenizer needs a positive vocab_size")
        super().__init__(vocab_size=int(vocab_size))
        self._vocab_size = int(vocab_size) + 1
        self._eod = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _require_file(path: Optional[str], flag: str) -> None:
    if not path:
        raise ValueError(f"this tokenizer needs {flag}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such tokenizer file ({flag})")


def _check_gpt2_files(vocab_file: Optional[str], merge_file: Optional[str]) -> None:
    """vocab.json must be a JSON object and merges.txt must not be one (the two are easily swapped)."""
    _require_file(vocab_file, "--vocab-file")
    _require_file(merge_file, "--merge-file")
    with open(merge_file, "rb") as f:
        head = f.read(64).lstrip()
    swapped = "; are --vocab-file and --merge-file swapped?"
    if head.startswith(b"{"):
        raise ValueError(f"--merge-file {merge_file}: a JSON file, expected GPT-2 merges.txt{swapped}")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({e}){swapped}") from None
    if not isinstance(vocab, dict):
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object of token -> id")


# Megatron-LM's names of a SentencePiece .model tokenizer (its megatron-core tokenizers build all three
# with the sentencepiece library).
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    *SENTENCEPIECE_TYPES,
    "TikTokenizer",
    "NullTokenizer",
)

# Megatron-LM's other tokenizer types, each with why it is not offered here and what to use.
UNSUPPORTED_TOKENIZER_TYPES = {
    "BertWordPieceLowerCase": "Megatron-LM's BERT WordPiece tokenizers are not implemented here (GPT pretraining); a "
                              "WordPiece tokenizer.json loads with --tokenizer-type HuggingFaceTokenizer",
    "BertWordPieceCase": "Megatron-LM's BERT WordPiece tokenizers are not implemented here (GPT pretraining); a "
                         "WordPiece tokenizer.json loads with --tokenizer-type HuggingFaceTokenizer",
    "MultimodalTokenizer": "multimodal models are not part of this fork (text-only GPT pretraining)",
    "NullMultimodalTokenizer": "multimodal models are not part of this fork (text-only GPT pretraining)",
    "SFTTokenizer": "supervised fine-tuning's prompt formats are not part of this fork (pretraining); use "
                    "--tokenizer-type HuggingFaceTokenizer with the model's tokenizer.json",
}


def tokenizer_type_name(text: str) -> str:
    """``--tokenizer-type``'s value: one of Megatron-LM's other types is refused with its reason (argparse's
    choices then refuse an unknown name)."""
    import argparse

    if text in UNSUPPORTED_TOKENIZER_TYPES:
        raise argparse.ArgumentTypeError(f"{text}: {UNSUPPORTED_TOKENIZER_TYPES[text]}")
    return text


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    tiktoken_pattern: str = "o200k",
    tiktoken_num_special_tokens: int = MEGATRON_NUM_SPECIAL_TOKENS,
    tiktoken_special_tokens: Optional[Dict[str, int]] = None,
    eod_token: Optional[str] = None,
    backend: str = "tiktoken",
) -> LevTokenizer:
    """Build a tokenizer by Megatron-LM type name.

    GPT2BPETokenizer: vocab_file + merge_file (backend "tiktoken" or "hf").
    HuggingFaceTokenizer: tokenizer_model = tokenizer.json (or its directory).
    SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer: tokenizer_model = .model (as
    Megatron-LM's megatron-core tokenizers: no BOS or EOS added, EOD the model's EOS).
    TikTokenizer: tokenizer_model = .tiktoken rank file, tiktoken_pattern in gpt2/r50k/cl100k/o200k; or
    Megatron-LM's v1/v2 over a .tiktoken file or Megatron-LM's JSON vocabulary, with
    tiktoken_num_special_tokens and vocab_size as Megatron-LM's (see TikTokenizer).
    NullTokenizer: vocab_size.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file, backend=backend)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, eod_token=eod_token)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern,
            special_tokens=tiktoken_special_tokens,
            eod_token=eod_token,
            num_special_tokens=tiktoken_num_special_tokens,
            vocab_size=vocab_size if tiktoken_pattern in MEGATRON_TIKTOKEN_PATTERNS else None,
        )
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")


def write_tiktoken_file(ranks: Dict[bytes, int], path: str) -> None:
    """Write mergeable ranks in the ``.tiktoken`` format (base64 token, space, rank)."""
    with open(path, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")
