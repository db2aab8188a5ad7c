"""Tensor-parallel LEV input embedding for megatron-core.

Layout (spec, "Tensor parallelism"):
- The k codebooks are replicated on every TP rank. The seed z is computed redundantly and passed
  through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so each
  rank's codebook gradient is the full gradient over all heads.
- The h heads are sharded: rank p holds heads p*h/t .. (p+1)*h/t - 1, each with its own A, a,
  LayerNorm, Delta and W. Their parameters carry Megatron's tensor-parallel attributes (dim 0), so
  grad-norm computation and dist_checkpointing treat them as shards.
- Each rank computes the partial sum of its heads; the partial embeddings are reduced exactly where
  Megatron's ``VocabParallelEmbedding`` reduces: all-reduce, or reduce-scatter along the sequence under
  sequence parallelism. Output layout [s, b, D] (or [s/t, b, D]).
- The offset c is replicated and added once, after the reduction. Under sequence parallelism each
  rank adds it to its own sequence shard, so it is marked ``sequence_parallel`` and Megatron's
  ``finalize_model_grads`` all-reduces its gradient over TP, like the sequence-parallel norm weights.

Parameters are created as megatron-core's own layers create theirs: in ``config.params_dtype``, on the
current CUDA device (or the CPU under ``use_cpu_initialization`` or without CUDA), and initialised only when
``config.perform_initialization`` and ``initialize`` (False when a checkpoint load overwrites them). Initialisation draws each
head from its own generator seeded by (init_seed, global head index), so TP = 1, 2, 4 start from the same
function for the same seed; low-precision parameters are initialised in fp32 and rounded once. The
statistics that scale W and set c are computed on the parameters' device from the full G: each chunk's
partial output is all-reduced over TP (on the group's device) before it is accumulated.

Compute modes (``LEVConfig.compute_mode``): the pure layer's own ``lev.layer.ComputeModes`` evaluates
this rank's partial sum of heads (token / unique / table, the id check, the table step); this module adds
only the sharding and the reductions around it. In ``table`` mode the first forward with grad of a step
evaluates the table; the training loop calls ``finish_table_step`` after the last backward, which pushes
the accumulated row gradients back through the heads and codebooks with one gradient delivery per
parameter, as megatron DDP's overlapped grad reduce expects. Starting the table inside forward, not
before the schedule, also means it is computed after megatron DDP's forward pre-hooks have finished any
overlapped parameter all-gather.

The fused separable-product kernels (``megatron_lev.kernels``) are registered when the layer is built
(``register_default_kernels``), so ``--lev-basis auto`` finds them.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_lev.kernels import refuse_unbuildable_triton, register_default_kernels
from megatron_lev.lev.config import LEVConfig
from megatron_lev.lev.layer import ComputeModes, LEVHeads, LEVSeed, compute_table, initialize_lev_parameters
from megatron_lev.parallel.collectives import all_reduce_

__all__ = ["LEVParallelEmbedding"]

# Parameters of LEVHeads; all have the head index as dim 0.
_HEAD_PARAMS = ("proj_weight", "proj_bias", "norm_weight", "norm_bias", "delta", "out_weight")


def parameter_device(config: TransformerConfig) -> torch.device:
    """Where megatron-core's layers create their parameters for ``config``."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class LEVParallelEmbedding(MegatronModule):
    """LEV embedding with replicated codebooks and TP-sharded heads; input [b, s] ids, output [s, b, D]."""

    def __init__(
        self,
        *,
        config: TransformerConfig,
        lev_config: LEVConfig,
        vocab_size: int,
        reduce_scatter_embeddings: bool = False,
        init_seed: int = 0,
        init_statistics: bool = True,
        initialize: bool = True,
    ):
        super().__init__(config=config)
        register_default_kernels()
        refuse_unbuildable_triton(lev_config.basis, parameter_device(config).type)
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        lev_config.validate(vocab_size, config.hidden_size, tp_size)
        self.lev_config = lev_config
        self.vocab_size = int(vocab_size)
        self.hidden_size = config.hidden_size
        self.base = lev_config.resolved_base(vocab_size)
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.num_local_heads = lev_config.num_heads // tp_size
        self._tp_size = tp_size
        self.init_seed = int(init_seed)

        kw = dict(device=parameter_device(config), dtype=config.params_dtype, initialize=False)
        self.seed = LEVSeed(vocab_size, lev_config, base=self.base, **kw)
        self.heads = LEVHeads(
            lev_config, self.hidden_size, self.num_local_heads, head_offset=tp_rank * self.num_local_heads, **kw
        )
        self.offset = torch.nn.Parameter(torch.zeros(self.hidden_size, device=kw["device"], dtype=kw["dtype"]))

        for name in _HEAD_PARAMS:
            set_tensor_model_parallel_attributes(getattr(self.heads, name), True, 0, 1)
        # Only when this module reduce-scatters does each rank add c to its own sequence shard; a
        # full-sequence output (scattered later by the caller) already gives every rank c's full grad.
        self.offset.sequence_parallel = bool(config.sequence_parallel and reduce_scatter_embeddings)

        self._modes = ComputeModes(self.vocab_size, lev_config)
        if initialize and config.perform_initialization:
            self.reset_parameters(init_statistics=init_statistics)

    # ------------------------------------------------------------------ init
    def _reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        if self._tp_size == 1:
            return partial
        return all_reduce_(partial.contiguous(), group=parallel_state.get_tensor_model_parallel_group())

    @torch.no_grad()
    def reset_parameters(self, init_statistics: bool = True) -> None:
        """Random init per head, then (optionally) scale W so each coordinate of G has std
        ``init_method_std`` over the vocabulary and set c = -mean; the statistics see the full G."""
        initialize_lev_parameters(
            self.seed, self.heads, self.offset, self.vocab_size, self.lev_config, self.config.init_method_std,
            init_seed=self.init_seed, statistics=init_statistics, reduce_fn=self._reduce_partial,
        )

    # --------------------------------------------------------------- forward
    def _partial(self, ids: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's heads of W_l M_l for ids [N] -> [N, D] in max(fp32, parameter dtype)
        (no offset, not reduced)."""
        z = self.seed(ids)
        if self._tp_size > 1:
            z = copy_to_tensor_model_parallel_region(z)
        return self.heads(z)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("megatron_lev.lev"):  # its kernels by name in a profile
            return self._forward(input_ids)

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        partial = self._modes(input_ids, self._partial, self.offset.device)
        emb = partial.view(b, s, self.hidden_size).transpose(0, 1).contiguous()
        if self.reduce_scatter_embeddings:
            emb = reduce_scatter_to_sequence_parallel_region(emb)
        elif self._tp_size > 1:
            emb = reduce_from_tensor_model_parallel_region(emb)
        # Partial sums arrive (and are reduced) in at least fp32; G is rounded once, after c is added.
        return (emb + self.offset.to(emb.dtype)).to(self.offset.dtype)

    # ------------------------------------------------------------ table mode
    @property
    def compute_mode(self) -> str:
        return self.lev_config.compute_mode

    def begin_table_step(self) -> None:
        """Evaluate this rank's partial G over all V ids once; micro-batches gather rows from it."""
        self._modes.begin(self._partial, self.offset.device)

    def finish_table_step(self) -> None:
        """Push the rows' accumulated gradients back through G (chunked, only ids that occurred), with
        one gradient delivery per parameter. Every TP rank saw the same ids, so all run the same chunks."""
        self._modes.finish(self._partial, list(self.seed.parameters()) + list(self.heads.parameters()))

    # ---------------------------------------------------------------- export
    @torch.no_grad()
    def materialize(self) -> torch.Tensor:
        """The dense V x D table of G (all heads, reduced over TP), identical on every TP rank, in
        max(fp32, parameter dtype)."""
        # At least fp32 even for a bf16 model: the table is what an export serves.
        dtype = torch.promote_types(torch.float32, self.offset.dtype)
        table = compute_table(
            lambda ids: self._reduce_partial(self._partial(ids).to(dtype)),
            self.vocab_size, self.lev_config.chunk_size, self.offset.device,
        )
        return table + self.offset.to(dtype)

    # ----------------------------------------------------------- checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = self.state_dict(prefix="", keep_vars=True)
        axis_map = {f"heads.{name}": 0 for name in _HEAD_PARAMS}
        return make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets)
