"""Tokenizers with Megatron-LM's type names over tiktoken, HF tokenizers and SentencePiece."""

from megatron_lev.tokenizer.spec import TokenizerSpec

from megatron_lev.tokenizer.tokenizers import (
    TIKTOKEN_PATTERNS,
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    LevTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    build_tokenizer,
    padded_vocab_size,
    write_tiktoken_file,
)

__all__ = [
    "TIKTOKEN_PATTERNS",
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "LevTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "TokenizerSpec",
    "build_tokenizer",
    "padded_vocab_size",
    "write_tiktoken_file",
]
