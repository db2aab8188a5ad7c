"""Train a SentencePiece (BPE/unigram) or HF byte-level BPE tokenizer from jsonl(.gz/.zst), streaming.

The corpus is read through an iterator (never loaded whole); ``max_docs``/``max_chars`` bound how
much text is fed. SentencePiece gets one line of text per "sentence" (it drops sentences longer than
``max_sentence_length`` bytes), HF gets whole documents.

Outputs:
* ``sentencepiece_bpe`` / ``sentencepiece_unigram``: ``{output_prefix}.model`` + ``.vocab``, with
  ``<unk>``=0, ``<s>``=1, ``</s>``=2 (EOD), byte fallback on; load with ``SentencePieceTokenizer``.
  ``normalization="identity"`` also keeps whitespace runs, so that decoding gives back the input text
  exactly (the default ``nmt_nfkc`` applies NFKC and collapses whitespace).
* ``hf_bytelevel_bpe``: ``{output_prefix}/tokenizer.json`` plus GPT-2 style ``vocab.json`` and
  ``merges.txt``, with ``<|endoftext|>`` as the last id; load with ``HuggingFaceTokenizer`` or
  ``GPT2BPETokenizer``.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, List, Optional, Sequence

from megatron_lev.jsonl import iter_json_docs

MODEL_TYPES = ("sentencepiece_bpe", "sentencepiece_unigram", "hf_bytelevel_bpe")


def _limited(docs: Iterable[str], max_docs: Optional[int], max_chars: Optional[int], progress: bool) -> Iterator[str]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit="doc", desc="reading corpus", mininterval=0.5)
    n = chars = 0
    try:
        for d in docs:
            if (max_docs is not None and n >= max_docs) or (max_chars is not None and chars >= max_chars):
                break
            n += 1
            chars += len(d)
            if bar is not None:
                bar.update(1)
            yield d
    finally:
        if bar is not None:
            bar.close()


def train_tokenizer(
    inputs: Sequence[str],
    output_prefix: str,
    vocab_size: int,
    model_type: str = "sentencepiece_bpe",
    *,
    json_key: str = "text",
    max_docs: Optional[int] = None,
    max_chars: Optional[int] = None,
    character_coverage: float = 0.9995,
    normalization: str = "nmt_nfkc",
    max_sentence_length: int = 16384,
    num_threads: Optional[int] = None,
    progress: bool = True,
) -> List[str]:
    """Train and save a tokenizer; returns the written paths."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model type {model_type!r}; choose one of {MODEL_TYPES}")
    docs = _limited(iter_json_docs(inputs, json_key), max_docs, max_chars, progress)
    threads = num_threads or os.cpu_count() or 1
    if model_type.startswith("sentencepiece"):
        import sentencepiece as spm

        def sentences() -> Iterator[str]:
            for d in docs:
                for line in d.split("\n"):
                    if line.strip():
                        yield line

        os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_prefix=output_prefix,
            vocab_size=vocab_size,
            model_type=model_type.split("_", 1)[1],
            character_coverage=character_coverage,
            normalization_rule_name=normalization,
            remove_extra_whitespaces=normalization != "identity",
            byte_fallback=True,
            max_sentence_length=max_sentence_length,
            num_threads=threads,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
        return [output_prefix + ".model", output_prefix + ".vocab"]

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # room for <|endoftext|> as the last id
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    os.makedirs(output_prefix, exist_ok=True)
    path = os.path.join(output_prefix, "tokenizer.json")
    tok.save(path)
    written = [path] + list(tok.model.save(output_prefix))
    # GPT-2 layout: vocab.json holds the special token too (GPT2BPETokenizer reads the EOD from it).
    vocab_path = os.path.join(output_prefix, "vocab.json")
    with open(vocab_path, encoding="utf-8") as f:
        vocab = json.load(f)
    vocab["<|endoftext|>"] = tok.token_to_id("<|endoftext|>")
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    return written
