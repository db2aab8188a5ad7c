#!/usr/bin/env python
"""Evaluate a megatron-lev checkpoint (any TP/PP, torchrun-able) or a Hugging Face model directory:
perplexity (indexed or jsonl data, sliding windows), perplexity by training-token frequency,
zero-shot perplexity, LAMBADA and multiple choice (HellaSwag, PIQA, WinoGrande, ARC); or compare
result files. See ``megatron_lev/evaluation/cli.py`` for examples.

Exit status: 0 done; 2 usage, setup or data error (one line on stderr).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    try:
        from megatron_lev.evaluation.cli import main
    except KeyboardInterrupt:  # torch and megatron-core take seconds to import
        print("error: interrupted (Ctrl-C) during start-up; nothing was written", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
