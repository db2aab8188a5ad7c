"""Megatron-LM flags this fork does not implement: each is refused in one line naming the feature and
what to use instead, so that no flag of a Megatron-LM script is accepted and ignored; the flags that
are accepted and do nothing here, with the reason (``NO_OPS``); and those accepted at the one value this
fork implements (``FIXED``).

A refused flag is not registered with the parser: argparse leaves it unrecognised and ``refusal`` names
it (an exact flag, or a family by prefix, such as the ``--moe-*`` flags ``arguments.moe`` does not define).
"""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_lev.lev.config import ConfigError

# Accepted flags that change nothing here, and why (the vocabulary test checks every other accepted flag
# changes the resolved arguments).
NO_OPS = {
    "--use-mcore-models": "megatron-core models are the only models here (deprecated in Megatron-LM too)",
    "--log-throughput": "throughput (TFLOP/s/GPU, tokens/s) is on every --log-interval line here, with or without "
                        "it (Megatron-LM prints it only with the flag)",
    "--no-create-attention-mask-in-dataloader": "the loader builds a dense attention mask only for "
                                                "--reset-attention-mask here (elsewhere attention is causal in the "
                                                "kernel): already the behaviour",
    "--use-flash-attn": "deprecated in Megatron-LM, which still accepts it and reads it nowhere; attention is "
                        "chosen by --attention-backend",
    "--auto-detect-ckpt-format": "checkpoints here are read in the one format written (torch_dist), found by "
                                 "itself; a --load directory in another format is refused in one line",
    "--use-dist-ckpt": "deprecated in Megatron-LM: checkpoints are megatron-core dist_checkpointing (torch_dist), "
                       "the only format here",
    "--ckpt-fully-parallel-save": "deprecated in Megatron-LM, where it is the default: every save here is fully "
                                  "parallel (each data-parallel replica writes its share, megatron-core's "
                                  "FullyParallelSaveStrategyWrapper)",
    "--no-position-embedding": "deprecated in Megatron-LM, which accepts it only with --position-embedding-type "
                               "rope, where there is no learned position table to disable; refused with any other "
                               "type (use --position-embedding-type none)",
}

# Flags accepted at the one value this fork implements (its default): the value, another one, and why
# any other value is refused in one line naming the flag.
FIXED = {
    "--ckpt-format": ("torch_dist", "torch",
                      "checkpoints are written and read in torch_dist (megatron-core dist_checkpointing) only here; "
                      "drop the flag or give torch_dist (convert a legacy checkpoint with Megatron-LM first)"),
    "--context-parallel-size": ("1", "2", "context parallelism is not implemented here (the local spec's SDPA "
                                          "attention and the data layout keep whole sequences on a rank); use 1"),
    "--num-distributed-optimizer-instances": ("1", "2", "partial distributed-optimizer groups are not "
                                                        "implemented here; use 1"),
    "--rope-type": ("rope", "yarn", "YaRN rotary scaling is Megatron-LM's for multi-latent attention, not "
                                    "implemented here; the rotary embedding here is --rope-type rope"),
}


def fixed_value_refusal(args) -> Optional[str]:
    """The one-line refusal of the first ``FIXED`` flag given another value than its one (None if none)."""
    for flag, (value, _, reason) in FIXED.items():
        given = getattr(args, flag[2:].replace("-", "_"))
        if str(given) != value:
            return f"{flag} {given}: {reason}"
    return None


_FSDP = "Megatron-FSDP / torch FSDP2 are not supported here; use --use-distributed-optimizer (ZeRO-1 sharding)"
_CUDA_GRAPHS = "CUDA graphs are not supported here; drop the flag"
_INFERENCE = "the inference server and engine are not part of this fork; train here, serve the exported model"
_MOE = ("this mixture-of-experts option is not implemented here; the MoE flags here are those of "
        "megatron_lev/arguments/moe.py (see --help)")

_NCCL_UB = "NCCL user buffers are not used here; drop the flag"
_TP_COMM = ("Transformer Engine's tensor-parallel communication overlap (userbuffers) is not wired here; drop the "
            "flag (TP all-reduces run un-overlapped)")
_GPT_OSS = ("this GPT-OSS architecture option (sliding-window attention, attention sinks, clamped/offset GLU) is "
            "not implemented in the layer specs here; drop the flag")

# Exact flags: the reason and the fix.
REFUSED = {
    "--use-megatron-fsdp": _FSDP,
    "--use-torch-fsdp2": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--init-model-with-meta-device": "meta-device initialisation is for Megatron-FSDP, which is not supported here; "
                                     "drop the flag",
    "--enable-cuda-graph": _CUDA_GRAPHS,
    "--external-cuda-graph": _CUDA_GRAPHS,
    "--checkpoint-activations": "deprecated in Megatron-LM; use --recompute-activations or --recompute-granularity",
    "--spec": "layer specs are chosen by --transformer-impl (transformer_engine or local)",
    "--multi-latent-attention": "multi-latent attention is not implemented here; drop the flag",
    "--use-nccl-ub": _NCCL_UB,
    "--tp-comm-overlap": _TP_COMM,
    "--tp-comm-overlap-cfg": _TP_COMM,
    "--enable-experimental": "megatron-core's experimental features are not enabled here; drop the flag",
    "--async-save": "asynchronous saving is not implemented here: a save's checksums.json and the "
                    "latest-checkpoint tracker are written once its files are complete, so saves are synchronous; "
                    "drop the flag",
    "--eval-micro-batch-size": "evaluation during training runs at --micro-batch-size here (its batches come from "
                               "the training loader's settings); drop the flag (tools/evaluate.py has "
                               "--micro-batch-size of its own)",
    "--use-checkpoint-args": "the model's flags are not taken from the checkpoint here: a resume compares them "
                             "with the checkpoint's config.yaml and names each difference; pass --config "
                             "LOAD/iter_N/config.yaml (the command line still wins) or the same flags",
    # GPT-OSS's architecture: refused until the layer specs here honour it (accepting it would train
    # another model than the one asked for)
    "--window-size": _GPT_OSS,
    "--window-attn-skip-freq": _GPT_OSS,
    "--softmax-type": _GPT_OSS,
    "--glu-linear-offset": _GPT_OSS,
    "--activation-func-clamp-value": _GPT_OSS,
    "--quick-geglu": _GPT_OSS,
}

# Families by prefix: the reason and the fix.
REFUSED_PREFIXES = {
    "--cuda-graph-": _CUDA_GRAPHS,
    "--moe-": _MOE,
    "--inference-": _INFERENCE,
    "--fsdp-": _FSDP,
    "--megatron-fsdp-": _FSDP,
    "--tp-comm-": _TP_COMM,
    "--disable-tp-comm-": _TP_COMM,
    "--no-tp-comm-": _TP_COMM,
    "--fp4-": "FP4 training is not supported here; use --bf16 (or --fp8-format with Transformer Engine)",
}


def refusal(flag: str) -> Optional[str]:
    """The one-line refusal of Megatron-LM flag ``flag`` (``--name``, ``--name=value`` or an argument
    name), or None when it is no Megatron-LM feature refused here."""
    name = "--" + flag.split("=", 1)[0].lstrip("-").replace("_", "-")
    reason = REFUSED.get(name)
    if reason is None:
        reason = next((r for prefix, r in REFUSED_PREFIXES.items() if name.startswith(prefix)), None)
    return None if reason is None else f"{name}: {reason}"


class _NoOp(argparse.Action):
    """A flag accepted for a Megatron-LM script's sake that sets nothing (see ``NO_OPS``)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        pass


def add_megatron_lm_flags(p) -> None:
    """The no-op flags that no other group defines."""
    g = p.add_argument_group("accepted from Megatron-LM, no effect here")
    for flag in ("--use-mcore-models", "--no-create-attention-mask-in-dataloader", "--use-flash-attn",
                 "--log-throughput", "--auto-detect-ckpt-format", "--use-dist-ckpt", "--ckpt-fully-parallel-save"):
        g.add_argument(flag, action=_NoOp, help=NO_OPS[flag])
    # Seen by the check below only (a leading underscore keeps it out of the resolved arguments).
    g.add_argument("--no-position-embedding", dest="_no_position_embedding", action="store_true",
                   help=NO_OPS["--no-position-embedding"])


def check_megatron_lm_flags(args) -> None:
    """The accepted Megatron-LM flags whose combination with others Megatron-LM refuses, refused alike."""
    reason = fixed_value_refusal(args)
    if reason is not None:
        raise ConfigError(reason)
    if getattr(args, "_no_position_embedding", False) and args.position_embedding_type != "rope":
        raise ConfigError(f"--no-position-embedding is deprecated and taken only with --position-embedding-type "
                          f"rope (got {args.position_embedding_type}); use --position-embedding-type none")
