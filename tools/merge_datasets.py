#!/usr/bin/env python
"""Merge indexed datasets (.bin/.idx prefixes, or directories of them) into one, in the given order.

Token-count files (``*_token_counts.npy``) next to every input are summed into one next to the output.
Exit status: 0 done; 2 usage or input error (missing files, mixed dtypes, existing output).
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lev.data.merge import merge_datasets  # noqa: E402
from megatron_lev.data.preprocessing import PreprocessError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input", nargs="+", required=True,
                   help="dataset prefixes (e.g. part0_text_document) or directories, merged in this order")
    p.add_argument("--output-prefix", required=True, help="merged dataset prefix, e.g. out_text_document")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    # megatron-core's import notes that fused kernels are missing; add_index needs none.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    try:
        written = merge_datasets(a.input, a.output_prefix, overwrite=a.overwrite)
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in written:
        print(f"wrote {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
