#!/usr/bin/env python
"""Convert megatron-lev checkpoints.

  reshard     write a training checkpoint at another TP/PP layout (model weights, iteration, data
              position, LR-scheduler state; no optimizer state). Resume with pretrain_lev.py --load DST.
  export-hf   a Hugging Face LlamaForCausalLM directory (Llama-style models only: RMSNorm, SwiGLU, RoPE,
              no biases); the input arm is materialised into embed_tokens; for lev also DST/lev/.
  export-lev  the LEV layer's parameters (safetensors + JSON config) for megatron_lev.lev.LEVEmbedding.

Examples:
  python tools/convert_checkpoint.py reshard --load ckpt --save ckpt_tp1 --target-tp 1 --target-pp 1
  python tools/convert_checkpoint.py export-hf --load ckpt --save hf_model --dtype bfloat16
  python tools/convert_checkpoint.py export-lev --load ckpt --save lev_params

Exit status: 0 done; 2 usage or checkpoint error (one line on stderr); 1 unexpected failure.
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--load", required=True, help="checkpoint root (with latest_checkpointed_iteration.txt) "
                                                      "or an iter_XXXXXXX directory")
        sp.add_argument("--save", required=True, help="output directory")
        sp.add_argument("--iteration", type=int, default=None, help="convert iter_N instead of the latest")
        sp.add_argument("--quiet", action="store_true", help="no progress output")

    r = sub.add_parser("reshard", help="checkpoint at another TP/PP layout")
    common(r)
    r.add_argument("--target-tp", type=int, required=True, help="tensor-model-parallel size of the output")
    r.add_argument("--target-pp", type=int, default=1, help="pipeline-model-parallel size of the output")
    r.add_argument("--target-vpp", type=int, default=None, help="virtual pipeline stages per rank (interleaved)")

    h = sub.add_parser("export-hf", help="Hugging Face LlamaForCausalLM directory")
    common(h)
    h.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="weights dtype (default: the training dtype)")
    h.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    h.add_argument("--trim-vocab", action="store_true",
                   help="keep only the tokenizer's ids in embed_tokens/lm_head (default: the padded vocabulary)")
    h.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    h.add_argument("--no-lev", action="store_true", help="lev arm: do not write the LEV parameters to SAVE/lev")
    h.add_argument("--overwrite", action="store_true", help="replace model files in a non-empty --save")

    e = sub.add_parser("export-lev", help="LEV parameters + config (lev arm)")
    common(e)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    from megatron_lev.conversion import ConversionError, export_hf, export_lev, reshard_checkpoint

    progress = not a.quiet
    try:
        if a.command == "reshard":
            reshard_checkpoint(a.load, a.save, tp=a.target_tp, pp=a.target_pp, vpp=a.target_vpp,
                               iteration=a.iteration, progress=progress)
        elif a.command == "export-hf":
            export_hf(a.load, a.save, iteration=a.iteration, dtype=a.dtype, max_shard_size=a.max_shard_size,
                      trim_vocab=a.trim_vocab, tokenizer=not a.no_tokenizer, lev=not a.no_lev,
                      overwrite=a.overwrite, progress=progress)
        else:
            export_lev(a.load, a.save, iteration=a.iteration, progress=progress)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
