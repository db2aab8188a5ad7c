"""megatron-lev: Leviathan (LEV) continuous token embeddings on Megatron-core."""

__version__ = "0.1.0"
