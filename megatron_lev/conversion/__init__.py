"""Checkpoint conversion: TP/PP resharding of training checkpoints (megatron-core dist_checkpointing),
Hugging Face ``LlamaForCausalLM`` export (the input arm materialised into ``embed_tokens``), and
export of the LEV parameters for the pure-torch ``megatron_lev.lev.LEVEmbedding``.

CLI: ``tools/convert_checkpoint.py {reshard,export-hf,export-lev}``.
"""

from .reshard import reshard_checkpoint
from .source import ConversionError, SourceCheckpoint, open_checkpoint

__all__ = ["ConversionError", "SourceCheckpoint", "open_checkpoint", "reshard_checkpoint"]
