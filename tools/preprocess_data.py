#!/usr/bin/env python
"""Tokenise jsonl(.gz/.zst) into megatron-core .bin/.idx (flags follow Megatron-LM's tool).

Exit status: 0 done (bad lines, if any, are skipped and reported); 1 bad input with --strict, a
truncated/corrupt input file (unless --allow-truncated-input), or no document at all (unless
--allow-empty-output), or a full disk (partial files removed); 2 usage or setup error (bad flags, missing input, existing output without --overwrite).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lev._procutil import interrupted  # noqa: E402
from megatron_lev.data.preprocessing import BadInputError, EmptyOutputError, OutputWriteError, PreprocessConfig, \
    PreprocessError, preprocess  # noqa: E402
from megatron_lev.tokenizer import TokenizerSpec  # noqa: E402
from megatron_lev.tokenizer.tokenizers import vocab_size_refusal  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help=".jsonl/.jsonl.gz/.jsonl.zst files or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    g.add_argument("--pile-set-name", nargs="+", default=None, help="keep only docs whose meta.pile_set_name is one of these")
    g.add_argument("--strict", action="store_true", help="stop at the first bad input line (exit 1)")
    g.add_argument("--allow-truncated-input", action="store_true",
                   help="keep the complete lines of a truncated or corrupt input file (reported) instead "
                        "of stopping with exit 1")
    g.add_argument("--allow-empty-output", action="store_true",
                   help="write a dataset of 0 documents instead of stopping with exit 1 when no line gives one")
    g = p.add_argument_group("tokenizer")
    TokenizerSpec.add_flags(g, required=True)
    g.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--output-token-counts", action="store_true",
                   help="also write {prefix}_{key}_token_counts.npy (int64 unigram counts, EODs included)")
    g.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="encoder processes")
    g.add_argument("--partitions", type=int, default=1, help="split the input lines round-robin into N parts")
    g.add_argument("--partition-index", type=int, default=None, help="which part this run processes (0-based)")
    g.add_argument("--log-interval", type=int, default=1000, help="docs between progress lines (no terminal)")
    g.add_argument("--batch-docs", type=int, default=128, help="documents per batch sent to a worker")
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--keep-sequential-samples", action="store_true", help=argparse.SUPPRESS)  # Megatron flag, no-op
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    refusal = vocab_size_refusal(a.tokenizer_type, a.vocab_size, getattr(a, "tiktoken_pattern", None))
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        sys.exit(2)
    if a.partitions > 1 and a.partition_index is None:
        p.error("--partitions N needs --partition-index I (run one part per node, then tools/merge_datasets.py)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = PreprocessConfig(
        **vars(TokenizerSpec.from_args(a)),
        inputs=a.input, output_prefix=a.output_prefix, json_keys=a.json_keys,
        append_eod=a.append_eod, workers=a.workers, log_interval=a.log_interval,
        partitions=a.partitions, partition_index=a.partition_index or 0,
        pile_set_names=a.pile_set_name, strict=a.strict, allow_truncated_input=a.allow_truncated_input,
        allow_empty_output=a.allow_empty_output,
        overwrite=a.overwrite,
        output_token_counts=a.output_token_counts, batch_docs=a.batch_docs,
        progress=False if a.no_progress_bar else None,
    )
    try:
        stats = preprocess(cfg)
    except (BadInputError, EmptyOutputError, OutputWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted(f"interrupted (Ctrl-C); nothing was written to --output-prefix {a.output_prefix} "
                           "(its partial files were removed)")
    print(stats.summary(), file=sys.stderr)
    for path in stats.outputs:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
