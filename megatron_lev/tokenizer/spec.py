"""The settings that name a tokenizer, read in one place from flags, saved arguments or configs.

Training (``--tokenizer-type ...``), preprocessing (:class:`~megatron_lev.data.PreprocessConfig`),
evaluation (flags over the checkpoint's saved arguments) and the Hugging Face export (the saved
arguments) all build their tokenizer through :meth:`TokenizerSpec.from_args`, so a setting added
here reaches every one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from megatron_lev.tokenizer.tokenizers import LevTokenizer, build_tokenizer


@dataclass(kw_only=True)
class TokenizerSpec:
    """A tokenizer by Megatron-LM type name and its files (configs that name a tokenizer extend it)."""

    tokenizer_type: str
    """GPT2BPETokenizer, HuggingFaceTokenizer, (GPT)SentencePieceTokenizer, TikTokenizer or NullTokenizer."""

    vocab_file: Optional[str] = None
    """GPT-2 ``vocab.json`` (GPT2BPETokenizer)."""

    merge_file: Optional[str] = None
    """GPT-2 ``merges.txt`` (GPT2BPETokenizer)."""

    tokenizer_model: Optional[str] = None
    """``tokenizer.json`` (or its folder), SentencePiece ``.model`` or ``.tiktoken`` rank file."""

    vocab_size: Optional[int] = None
    """Ids of the NullTokenizer (its EOD is one more)."""

    tiktoken_pattern: str = "o200k"
    """Pre-tokenisation pattern of a TikTokenizer: gpt2, r50k, cl100k or o200k."""

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
