#!/usr/bin/env python
"""Train a SentencePiece (BPE or unigram) or HF byte-level BPE tokenizer from .jsonl/.jsonl.gz/.jsonl.zst.

Examples:
  tools/train_tokenizer.py --input data/sample/train.jsonl.zst --model-type sentencepiece_bpe \
      --vocab-size 8000 --output-prefix data/tok/sp8k          # -> sp8k.model, sp8k.vocab
  tools/train_tokenizer.py --input 'pile/*.jsonl.zst' --model-type hf_bytelevel_bpe \
      --vocab-size 32000 --max-docs 200000 --output-prefix data/tok/bpe32k   # -> bpe32k/tokenizer.json
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lev.tokenizer.train import MODEL_TYPES, train_tokenizer  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="files or globs")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=MODEL_TYPES, default="sentencepiece_bpe")
    p.add_argument("--json-key", default="text")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--max-chars", type=int, default=None)
    p.add_argument("--character-coverage", type=float, default=0.9995, help="SentencePiece only")
    p.add_argument("--normalization", default="nmt_nfkc",
                   help="SentencePiece only: nmt_nfkc, nfkc, identity (identity decodes back to the exact input)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress-bar", action="store_true")
    a = p.parse_args(argv)
    try:
        written = train_tokenizer(
            a.input, a.output_prefix, a.vocab_size, a.model_type, json_key=a.json_key,
            max_docs=a.max_docs, max_chars=a.max_chars, character_coverage=a.character_coverage,
            normalization=a.normalization,
            num_threads=a.threads, progress=not a.no_progress_bar,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in written:
        print(f"wrote {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
