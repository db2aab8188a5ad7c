#!/usr/bin/env python
r"""Pretrain a GPT model with the LEV input embedding (or a baseline arm) on megatron-core.

    torchrun --nproc-per-node 8 pretrain_lev.py --config examples/pile/configs/400m.yaml --input-embedding lev \
        --data-path DATA_text_document --tokenizer-type TikTokenizer --tokenizer-model o200k_base.tiktoken \
        --save ckpt --load ckpt

(``examples/pile/configs/`` holds the shipped 200M/400M/1.2B configs; ``examples/pile/train.sh`` is the full
launch over the preprocessed Pile.)

Flags follow Megatron-LM's names; ``--config FILE.yaml`` holds any of them and the command line
overrides it. ``python pretrain_lev.py --help`` lists them all.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":  # imported inside: a spawned helper re-runs this file without the heavy imports
    try:
        from megatron_lev.training import pretrain
    except KeyboardInterrupt:  # torch and megatron-core take seconds to import
        print("error: interrupted (Ctrl-C) during start-up; nothing was written", file=sys.stderr)
        sys.exit(130)
    sys.exit(pretrain(sys.argv[1:]))
