"""Tokenizers with Megatron-LM's type names over tiktoken, HF tokenizers and SentencePiece."""

from megatron_lev.tokenizer.fingerprint import ALLOW_FLAG as ALLOW_TOKENIZER_MISMATCH_FLAG
from megatron_lev.tokenizer.fingerprint import describe as describe_tokenizer
from megatron_lev.tokenizer.fingerprint import fingerprint as tokenizer_fingerprint
from megatron_lev.tokenizer.fingerprint import tokenizer_mismatch
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
    "ALLOW_TOKENIZER_MISMATCH_FLAG",
    "describe_tokenizer",
    "tokenizer_fingerprint",
    "tokenizer_mismatch",
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
