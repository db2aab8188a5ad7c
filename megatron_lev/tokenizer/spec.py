"""The settings that name a tokenizer, read in one place from flags, saved arguments or configs.

Training (``--tokenizer-type ...``), preprocessing (:class:`~megatron_lev.data.PreprocessConfig`),
evaluation (flags over the checkpoint's saved arguments) and the Hugging Face export (the saved
arguments) all build their tokenizer through :meth:`TokenizerSpec.from_args`, so a setting added
here reaches every one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Sequence

from megatron_lev.config_flags import add_config_flags
from megatron_lev.tokenizer.tokenizers import (MEGATRON_NUM_SPECIAL_TOKENS, TIKTOKEN_PATTERNS, TOKENIZER_TYPES,
                                               LevTokenizer, build_tokenizer, tokenizer_type_name)


@dataclass(kw_only=True)
class TokenizerSpec:
    """A tokenizer by Megatron-LM type name and its files (configs that name a tokenizer extend it)."""

    tokenizer_type: str = field(metadata={"choices": TOKENIZER_TYPES})
    """GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer (or GPTSentencePieceTokenizer,
    Llama2Tokenizer: the same), TikTokenizer or NullTokenizer."""

    vocab_file: Optional[str] = None
    """GPT-2 ``vocab.json`` (GPT2BPETokenizer)."""

    merge_file: Optional[str] = None
    """GPT-2 ``merges.txt`` (GPT2BPETokenizer)."""

    tokenizer_model: Optional[str] = None
    """``tokenizer.json`` (or its folder), SentencePiece ``.model`` or ``.tiktoken`` rank file."""

    vocab_size: Optional[int] = field(default=None, metadata={"min": 2})
    """Ids of the NullTokenizer (its EOD is one more); with a TikTokenizer in Megatron-LM's v1/v2 layout, its
    ids in all, special tokens included (the file is cut to fit; default: the whole file, at most 2**17); beside
    another tokenizer with files, in training, the model's vocabulary (at least the tokenizer's ids)."""

    tiktoken_pattern: str = field(default="o200k", metadata={"choices": tuple(sorted(TIKTOKEN_PATTERNS))})
    """Pre-tokenisation pattern of a TikTokenizer: OpenAI's gpt2/r50k/cl100k/o200k over a .tiktoken file, or
    Megatron-LM's v1/v2 (its id layout: the special tokens first, <s>=1, </s>=2 the EOD)."""

    tiktoken_num_special_tokens: int = field(default=MEGATRON_NUM_SPECIAL_TOKENS, metadata={"min": 0})
    """Special-token ids before the vocabulary in Megatron-LM's v1/v2 layout (<unk> <s> </s> <mask> <pad> <cls>
    <sep>, then <SPECIAL_7>, ...)."""

    @staticmethod
    def add_flags(group, *, names: Optional[Sequence[str]] = None, required: bool = False,
                  defaults: Optional[Dict[str, Any]] = None) -> None:
        """``--tokenizer-type``, ``--vocab-file``, ... on an argparse group, generated from the fields
        (type, default, choices, help). ``names``: only these fields. ``required``: the type must be
        given. ``defaults``: other command-line defaults (e.g. None where a saved setting applies)."""
        actions = add_config_flags(group, TokenizerSpec, lambda n: "--" + n.replace("_", "-"), names,
                                   defaults={"tokenizer_type": None, **(defaults or {})})
        actions["tokenizer_type"].required = required
        if "tokenizer_type" in actions:
            actions["tokenizer_type"].type = tokenizer_type_name  # Megatron-LM's other types: refused with why

    @staticmethod
    def from_args(*sources: Any) -> Optional["TokenizerSpec"]:
        """The spec from argparse namespaces, configs or dicts of saved arguments, earlier sources first.

        Each setting takes the first value that is given (not None or empty) in ``sources``, else
        its default; e.g. ``from_args(flags, saved_args)`` lets command-line flags override a
        checkpoint's arguments. None when no source names a tokenizer type.
        """
        values: Dict[str, Any] = {}
        for f in fields(TokenizerSpec):
            for src in sources:
                v = src.get(f.name) if isinstance(src, Mapping) else getattr(src, f.name, None)
                if v is not None and v != "":
                    values[f.name] = v
                    break
        if "tokenizer_type" not in values:
            return None
        return TokenizerSpec(**values)

    def kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of :func:`build_tokenizer` after the type name."""
        return {f.name: getattr(self, f.name) for f in fields(TokenizerSpec) if f.name != "tokenizer_type"}

    def build(self) -> LevTokenizer:
        return build_tokenizer(self.tokenizer_type, **self.kwargs())
