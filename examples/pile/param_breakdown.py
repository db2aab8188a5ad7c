#!/usr/bin/env python
"""Print the parameter breakdown of every scale x arm of examples/pile (markdown), from the model's own
parameter report (megatron_lev.models.parameter_breakdown) with the configs in configs/*.yaml.

    python examples/pile/param_breakdown.py [--vocab-size 200019]   # o200k_base (default) or 50257 (GPT-2)
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

ARMS = ("tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev")
SCALES = ("200m", "400m", "1.2b")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab-size", type=int, default=200019, help="tokenizer vocabulary (o200k_base: 200019)")
    a = p.parse_args(argv)

    import dataclasses

    from megatron_lev.arguments import parse_run_config
    from megatron_lev.lev.config import ConfigError, lev_param_count
    from megatron_lev.models import parameter_breakdown
    from megatron_lev.models.factory import build_configs
    from megatron_lev.tokenizer import padded_vocab_size

    print(f"Tokenizer vocabulary {a.vocab_size:,}; padded as Megatron pads it (128 x TP).\n")
    print("| scale | arm | input side | transformer | output head | total | input side / dense table |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for scale in SCALES:
        for arm in ARMS:
            rc = parse_run_config(["--config", os.path.join(HERE, "configs", f"{scale}.yaml"), "--mock-data",
                                   "--vocab-size", str(a.vocab_size - 1), "--input-embedding", arm,
                                   "--save", "unused"], world_size=8)
            m = rc.model
            rc = rc.with_padded_vocab(padded_vocab_size(a.vocab_size, m.make_vocab_size_divisible_by, rc.layout.tp))
            note = ""
            try:
                config, model_config = build_configs(rc)
            except ConfigError:
                # albert's width moves the count in steps of V + D: with a 200k vocabulary no width is
                # within 2% of LEV, so the launch script passes the nearest one explicitly.
                rows, hidden = rc.model.padded_vocab_size, rc.model.hidden_size
                budget = lev_param_count(rows, hidden, rc.model.lev)
                width = max(1, round((budget - hidden) / (rows + hidden)))
                note = f" (--albert-dim {width})"
                rc = dataclasses.replace(rc, model=dataclasses.replace(rc.model, albert_dim=width))
                config, model_config = build_configs(rc)
            b = parameter_breakdown(model_config, config)
            ratio = b["input_side"] / max(1, b["dense_table"])
            print(f"| {scale} | {arm}{note} | {b['input_side']:,} | {b['transformer']:,} | {b['output_head']:,} | "
                  f"{b['total']:,} | {ratio:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
