"""Checkpoint conversion: TP/PP resharding of training checkpoints (megatron-core dist_checkpointing),
Hugging Face ``LlamaForCausalLM`` export (the input arm materialised into ``embed_tokens``), and
export of the LEV parameters for the pure-torch ``megatron_lev.lev.LEVEmbedding``.

CLI: ``tools/convert_checkpoint.py {reshard,export-hf,export-lev}``.
"""

from .hf import WEIGHT_MAP, check_hf_compatible, export_hf, hf_tensors, split_fc1, split_qkv
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
]
