#!/usr/bin/env python
"""Convert megatron-lev checkpoints.

  reshard     write a training checkpoint at another TP/PP layout (model weights, iteration, data
              position, LR-scheduler state; no optimizer state). Resume with pretrain_lev.py --load DST.
  export-hf   a Hugging Face directory of the class that computes the model: LlamaForCausalLM (RMSNorm,
              SwiGLU, RoPE, no biases), GPT2LMHeadModel (LayerNorm, GeLU, learned positions: Megatron-LM's
              GPT-3) or MixtralForCausalLM (Llama-style MoE); the input arm is materialised into the
              input table; for lev also DST/lev/.
  export-lev  the LEV layer's parameters (safetensors + JSON config) for megatron_lev.lev.LEVEmbedding.
  import-hf   a Hugging Face LlamaForCausalLM directory (safetensors; Llama 3.1-3.3's rope_scaling too) as a
              training checkpoint at TP x PP.
  to-lev      fit a LEV layer to a dense (tied/untied) checkpoint's input table; write a lev checkpoint.

Examples:
  python tools/convert_checkpoint.py reshard --load ckpt --save ckpt_tp1 --target-tp 1 --target-pp 1
  python tools/convert_checkpoint.py export-hf --load ckpt --save hf_model --dtype bfloat16
  python tools/convert_checkpoint.py export-lev --load ckpt --save lev_params
  python tools/convert_checkpoint.py import-hf --hf-model llama_dir --save ckpt --tensor-model-parallel-size 2
  python tools/convert_checkpoint.py to-lev --load ckpt --save ckpt_lev --token-counts counts.npy --lev-heads 8

Exit status: 0 done; 2 usage or checkpoint error (one line on stderr); 1 unexpected failure.
"""

import argparse
import dataclasses
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The LEV flags come from LEVConfig's fields (light: torch only); the conversion code itself, which
# pulls in megatron-core, is imported only when a command runs.
from megatron_lev.config_flags import add_config_flags  # noqa: E402
from megatron_lev.lev.config import LEVConfig, lev_arg, lev_flag  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--load", required=True, help="checkpoint root (with latest_checkpointed_iteration.txt) "
                                                      "or an iter_XXXXXXX directory")
        sp.add_argument("--save", required=True, help="output directory")
        sp.add_argument("--iteration", type=int, default=None, help="convert iter_N instead of the latest")
        sp.add_argument("--quiet", action="store_true", help="no progress output")
        sp.add_argument("--allow-missing-ckpt-checksums", action="store_true",
                        help="convert a checkpoint whose checksums.json is missing though its save recorded one "
                             "(its files checked for size only)")

    r = sub.add_parser("reshard", help="checkpoint at another TP/PP layout")
    common(r)
    r.add_argument("--target-tp", type=int, required=True, help="tensor-model-parallel size of the output")
    r.add_argument("--target-pp", type=int, default=1, help="pipeline-model-parallel size of the output")
    r.add_argument("--target-vpp", type=int, default=None, help="virtual pipeline stages per rank (interleaved)")

    h = sub.add_parser("export-hf", help="Hugging Face LlamaForCausalLM, GPT2LMHeadModel or MixtralForCausalLM directory")
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

    i = sub.add_parser("import-hf", help="Hugging Face LlamaForCausalLM directory -> training checkpoint")
    i.add_argument("--hf-model", required=True, help="directory with config.json and safetensors weights")
    i.add_argument("--save", required=True, help="output checkpoint root (empty or new)")
    i.add_argument("--tensor-model-parallel-size", type=int, default=1)
    i.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    i.add_argument("--seq-length", type=int, default=None, help="default: max_position_embeddings")
    i.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    i.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="parameter dtype (default: config.json's dtype, else float32)")
    i.add_argument("--no-tokenizer", action="store_true", help="ignore tokenizer.json (NullTokenizer over the ids)")
    i.add_argument("--quiet", action="store_true", help="no progress output")

    t = sub.add_parser("to-lev", help="fit LEV to a dense checkpoint's input table; write a lev checkpoint")
    common(t)
    t.add_argument("--token-counts", default=None, help=".npy of counts per token id: frequency-weighted fit and "
                                                        "per-bucket errors")
    t.add_argument("--count-power", type=float, default=1.0, help="weights (count+1)**power (0: uniform)")
    lv = t.add_argument_group("LEV layer (unset: the checkpoint's saved value, else LEVConfig's default)")
    add_config_flags(lv, LEVConfig, lev_flag, defaults={f.name: None for f in dataclasses.fields(LEVConfig)})
    t.add_argument("--fit-lr", type=float, default=3e-3)
    t.add_argument("--fit-batch-size", type=int, default=4096, help="ids per step")
    t.add_argument("--fit-max-steps", type=int, default=2000)
    t.add_argument("--fit-eval-interval", type=int, default=50, help="steps between full-table error checks")
    t.add_argument("--fit-patience", type=int, default=4, help="stop after N checks without 1%% improvement")
    t.add_argument("--fit-target-error", type=float, default=0.0, help="stop at this relative error")
    t.add_argument("--fit-seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="where to fit: cpu, cuda, cuda:N")
    t.add_argument("--report", default=None, help="also write the fit report as JSON here")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    from megatron_lev._procutil import interrupted
    from megatron_lev.conversion import ConversionError, export_hf, export_lev, import_hf, reshard_checkpoint, to_lev
    from megatron_lev.conversion.source import ConversionInterrupted
    from megatron_lev.conversion.dense_to_lev import FitConfig

    progress = not a.quiet
    try:
        if a.command == "reshard":
            reshard_checkpoint(a.load, a.save, tp=a.target_tp, pp=a.target_pp, vpp=a.target_vpp,
                               iteration=a.iteration, progress=progress,
                               allow_missing_checksums=a.allow_missing_ckpt_checksums)
        elif a.command == "export-hf":
            export_hf(a.load, a.save, iteration=a.iteration, dtype=a.dtype, max_shard_size=a.max_shard_size,
                      trim_vocab=a.trim_vocab, tokenizer=not a.no_tokenizer, lev=not a.no_lev,
                      overwrite=a.overwrite, progress=progress,
                      allow_missing_checksums=a.allow_missing_ckpt_checksums)
        elif a.command == "export-lev":
            export_lev(a.load, a.save, iteration=a.iteration, progress=progress,
                       allow_missing_checksums=a.allow_missing_ckpt_checksums)
        elif a.command == "import-hf":
            import_hf(a.hf_model, a.save, tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size,
                      seq_length=a.seq_length, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                      dtype=a.dtype, tokenizer=not a.no_tokenizer, progress=progress)
        else:
            lev = {f.name: getattr(a, lev_arg(f.name)) for f in dataclasses.fields(LEVConfig)}
            fit = FitConfig(lr=a.fit_lr, batch_size=a.fit_batch_size, max_steps=a.fit_max_steps,
                            eval_interval=a.fit_eval_interval, patience=a.fit_patience,
                            target_error=a.fit_target_error, count_power=a.count_power, seed=a.fit_seed,
                            device=a.device, progress=progress)
            to_lev(a.load, a.save, lev=lev, token_counts=a.token_counts, fit=fit, iteration=a.iteration,
                   report_file=a.report, progress=progress, allow_missing_checksums=a.allow_missing_ckpt_checksums)
    except ConversionInterrupted as err:
        return interrupted(str(err))
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # before anything was written (the writes above say what they left)
        return interrupted(f"{a.command}: interrupted (Ctrl-C) before its output was written; nothing was "
                           f"written to --save {a.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
