"""Checkpoint conversion: TP/PP resharding of training checkpoints (megatron-core dist_checkpointing),
Hugging Face export as ``LlamaForCausalLM``, ``GPT2LMHeadModel`` or ``MixtralForCausalLM`` (the input arm
materialised into the input table) and ``LlamaForCausalLM`` import (Llama's weight map, both directions), export of the LEV parameters for the pure-torch
``megatron_lev.lev.LEVEmbedding``, and dense -> LEV conversion (a LEV layer fitted to a trained table).

CLI: ``tools/convert_checkpoint.py {reshard,export-hf,export-lev,import-hf,to-lev}``.
"""

from .hf import WEIGHT_MAP, MappedWeight, check_hf_compatible, export_hf, hf_tensors, join_fc1, join_qkv, megatron_tensors, split_fc1, split_qkv
from .dense_to_lev import FitConfig, FitReport, fit_lev, to_lev
from .hf_import import import_hf, read_hf_model
from .lev_export import export_lev, load_lev_embedding
from .reshard import reshard_checkpoint
from .source import ConversionError, SourceCheckpoint, open_checkpoint

__all__ = [
    "ConversionError",
    "SourceCheckpoint",
    "open_checkpoint",
    "reshard_checkpoint",
    "export_hf",
    "export_lev",
    "load_lev_embedding",
    "check_hf_compatible",
    "hf_tensors",
    "split_qkv",
    "split_fc1",
    "WEIGHT_MAP",
    "MappedWeight",
    "join_qkv",
    "join_fc1",
    "megatron_tensors",
    "import_hf",
    "read_hf_model",
    "FitConfig",
    "FitReport",
    "fit_lev",
    "to_lev",
]
