"""The non-LEV input arms of the spec's Baselines table as tensor-parallel modules.

    albert        dense V x e table (vocab-parallel), then a linear e -> D
    flat_mlp      dense V x e table (vocab-parallel), then an MLP e -> m -> D (GELU)
    factored_mlp  the LEV seed z(i) = sum_m C_m[i_m] (k replicated codebooks), then an MLP d_s -> m -> D

(``tied`` and ``untied`` are megatron-core's own ``LanguageModelEmbedding``; which module an arm
builds is its entry in ``models.arms``, the input-arm registry.)

Every arm has the interface of ``LEVParallelEmbedding``: ``forward(input_ids [b, s])`` returns
``[s, b, D]`` identical on every TP rank, or, with ``reduce_scatter_embeddings=True``, this rank's
sequence shard ``[s/t, b, D]``; ``materialize()`` returns the dense ``[V, D]`` table on every rank.

Tensor-parallel layout (chosen so that TP = t gives the results of TP = 1):

- The V x e tables are ``VocabParallelEmbedding`` shards (rows split over TP). Their e-wide
  lookups are reduced across TP exactly where megatron reduces its word embeddings: all-reduce, or
  reduce-scatter along the sequence under sequence parallelism. Reducing the e-wide lookup (e << D)
  is the only communication of the arm.
- The small dense layers after the table (and the factored_mlp codebooks) are *replicated* on every
  TP rank, not split: they hold at most a few million parameters, and a Column+Row parallel pair
  would add a second D-wide reduction per micro-batch.
  * Without sequence parallelism every rank applies them to the whole (already reduced) sequence;
    the gradient arriving from the transformer is the same on all TP ranks (megatron's first
    ColumnParallelLinear all-reduces its input gradient), so their gradients are identical, full
    gradients on every rank and need no reduction.
  * With sequence parallelism every rank applies them to its own sequence shard only (factored_mlp
    even computes the seed for its shard's ids only: no communication at all), so each rank's
    gradient is a partial sum. These parameters carry ``sequence_parallel = True``, and megatron's
    ``finalize_model_grads`` all-reduces them over TP like sequence-parallel norm weights.
- Replicated parameters are broadcast from TP rank 0 after initialisation, so every rank starts
  from the same values whatever the RNG state; in checkpoints they are replicated ShardedTensors
  (replica id set by TP rank), the tables TP-sharded ShardedTensors (megatron's own).

Initialisation (ours; the paper does not say): tables ~ N(0, init_method_std^2) like megatron's word
embeddings. albert's projection ~ N(0, 1/e) so the output coordinates have the table's std. MLPs:
fc1 ~ N(0, 1/(fan_in * s_in^2)) with s_in the std of the MLP input (the table's init std, or the
seed's std measured from the codebooks), giving unit-variance pre-activations; fc2 ~
N(0, init_method_std^2 / (m * E[gelu(u)^2])), u ~ N(0, 1), so the output has std ~ init_method_std
like a dense table row. Biases start at 0.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_lev.parallel.collectives import broadcast_
from megatron_lev.parallel.lev_embedding import parameter_device

__all__ = ["AlbertEmbedding", "FlatMLPEmbedding", "FactoredMLPEmbedding", "TableArm", "gelu_second_moment"]

_GELU_M2: Optional[float] = None


def gelu_second_moment() -> float:
    """E[gelu(u)^2] for u ~ N(0, 1) (about 0.4252), by quadrature."""
    global _GELU_M2
    if _GELU_M2 is None:
        u = torch.linspace(-12.0, 12.0, 200001, dtype=torch.float64)
        pdf = torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
        _GELU_M2 = float(torch.trapezoid(F.gelu(u) ** 2 * pdf, u))
    return _GELU_M2


def _param(shape, config) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=config.params_dtype, device=parameter_device(config)))


class _ArmBase(MegatronModule):
    """Shared plumbing: TP group, replicated-parameter bookkeeping, sequence slicing, checkpoints."""

    def __init__(self, *, config, vocab_size: int, reduce_scatter_embeddings: bool = False, tp_group=None):
        super().__init__(config=config)
        self.vocab_size = int(vocab_size)
        self.hidden_size = config.hidden_size
        self.reduce_scatter_embeddings = bool(reduce_scatter_embeddings)
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)

    # -- replicated parameters
    def _replicated_parameters(self):
        for name, p in self.named_parameters():
            if not getattr(p, "tensor_model_parallel", False):
                yield name, p

    def _finish_replicated(self) -> None:
        """Broadcast replicated parameters from TP rank 0 and set their sequence-parallel flag."""
        params = [p for _, p in self._replicated_parameters()]
        if self.tp_group.size() > 1 and torch.distributed.is_initialized():
            src = torch.distributed.get_global_rank(self.tp_group, 0)
            with torch.no_grad():
                for p in params:
                    broadcast_(p.data, src=src, group=self.tp_group)
        for p in params:
            # Partial gradients (sequence shard per rank) only when this arm works on shards.
            setattr(p, "sequence_parallel", self.reduce_scatter_embeddings)

    # -- sequence parallel helpers
    def _sequence_shard(self, x_sb: Tensor) -> Tensor:
        """This rank's slice of an [s, b, ...] tensor along the sequence (no communication)."""
        t = self.tp_group.size()
        if t == 1:
            return x_sb
        s = x_sb.shape[0]
        if s % t != 0:
            raise ValueError(f"sequence length {s} is not divisible by the tensor-parallel size {t} (sequence parallel)")
        r = self.tp_group.rank()
        return x_sb[r * (s // t):(r + 1) * (s // t)]

    # -- checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """Tables: TP-sharded along the vocabulary (megatron's VocabParallelEmbedding); everything
        else: replicated ShardedTensors (replica id from the TP and DP ranks)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            own, prefix, {}, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )
        for name, module in self.named_children():
            out.update(
                sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group)
            )
        return out

    # -- interface
    def forward(self, input_ids: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def materialize(self, chunk_size: int = 8192) -> Tensor:
        """The dense [V, D] input table (identical on every TP rank; collective over TP)."""
        saved = self.reduce_scatter_embeddings
        self.reduce_scatter_embeddings = False
        table = getattr(self, "word_embeddings", None)
        if table is not None:
            table.reduce_scatter_embeddings = False
        try:
            rows = []
            dev = next(self.parameters()).device
            for start in range(0, self.vocab_size, chunk_size):
                ids = torch.arange(start, min(start + chunk_size, self.vocab_size), device=dev).unsqueeze(0)
                rows.append(self.forward(ids)[:, 0, :])  # [n, 1, D] -> [n, D]
            return torch.cat(rows, dim=0)
        finally:
            self.reduce_scatter_embeddings = saved
            if table is not None:
                table.reduce_scatter_embeddings = saved


class TableArm(_ArmBase):
    """V x e vocab-parallel table; ``_lookup`` returns [s, b, e] (or the sequence shard). The base of a new
    table arm (``models.arms``): a subclass adds its layers after the table and calls ``_finish_replicated``."""

    def __init__(self, *, config, vocab_size: int, table_dim: int, reduce_scatter_embeddings: bool = False,
                 tp_group=None):
        super().__init__(config=config, vocab_size=vocab_size,
                         reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group)
        self.table_dim = int(table_dim)
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=self.vocab_size,
            embedding_dim=self.table_dim,
            init_method=config.embedding_init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
            tp_group=self.tp_group,
        )
        self.word_embeddings.weight.is_embedding_or_output_parameter = True

    def _lookup(self, input_ids: Tensor) -> Tensor:
        x = self.word_embeddings(input_ids)
        if not self.reduce_scatter_embeddings:
            x = x.transpose(0, 1)  # [b, s, e] -> [s, b, e]
        return x


class AlbertEmbedding(TableArm):
    """albert: V x e table, then a linear e -> D (weight [D, e], bias [D])."""

    def __init__(self, *, config, vocab_size: int, albert_dim: int, reduce_scatter_embeddings: bool = False,
                 tp_group=None):
        super().__init__(config=config, vocab_size=vocab_size, table_dim=albert_dim,
                         reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group)
        D, e = config.hidden_size, self.table_dim
        self.proj_weight = _param((D, e), config)
        self.proj_bias = _param((D,), config)
        if config.perform_initialization:
            with torch.no_grad():
                self.proj_weight.normal_(0.0, 1.0 / math.sqrt(e))
        self._finish_replicated()

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self._lookup(input_ids)
        return F.linear(x, self.proj_weight, self.proj_bias)


def _init_mlp(fc1_w: Tensor, fc2_w: Tensor, input_std: float, out_std: float) -> None:
    fan_in, m = fc1_w.shape[1], fc1_w.shape[0]
    with torch.no_grad():
        fc1_w.normal_(0.0, 1.0 / (math.sqrt(fan_in) * max(input_std, 1e-12)))
        fc2_w.normal_(0.0, out_std / math.sqrt(m * gelu_second_moment()))


def _mlp(x: Tensor, fc1_w: Tensor, fc1_b: Tensor, fc2_w: Tensor, fc2_b: Tensor) -> Tensor:
    return F.linear(F.gelu(F.linear(x, fc1_w, fc1_b)), fc2_w, fc2_b)


class FlatMLPEmbedding(TableArm):
    """flat_mlp: V x e table, then an MLP e -> m -> D with GELU (biases on both layers)."""

    def __init__(self, *, config, vocab_size: int, table_dim: int, mlp_hidden: int,
                 reduce_scatter_embeddings: bool = False, tp_group=None):
        super().__init__(config=config, vocab_size=vocab_size, table_dim=table_dim,
                         reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group)
        D, e, m = config.hidden_size, self.table_dim, int(mlp_hidden)
        self.mlp_hidden = m
        self.fc1_weight = _param((m, e), config)
        self.fc1_bias = _param((m,), config)
        self.fc2_weight = _param((D, m), config)
        self.fc2_bias = _param((D,), config)
        if config.perform_initialization:
            _init_mlp(self.fc1_weight, self.fc2_weight, config.init_method_std, config.init_method_std)
        self._finish_replicated()

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self._lookup(input_ids)
        return _mlp(x, self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)


def _make_seed(vocab_size: int, lev_config, config, init_seed: int):
    from megatron_lev.lev import LEVSeed

    seed = LEVSeed(vocab_size, lev_config, base=lev_config.resolved_base(vocab_size),
                   device=parameter_device(config), dtype=config.params_dtype, initialize=False)
    if config.perform_initialization:
        # The codebook stream of ``init_seed`` (drawn in fp32, rounded once): identical on every rank.
        master = LEVSeed(vocab_size, lev_config, base=seed.base, initialize=False)
        master.reset_parameters(init_seed)
        with torch.no_grad():
            seed.codebooks.copy_(master.codebooks)
    return seed


class FactoredMLPEmbedding(_ArmBase):
    """factored_mlp: the LEV seed z(i) (replicated codebooks), then an MLP d_s -> m -> D (GELU)."""

    def __init__(self, *, config, vocab_size: int, lev_config, mlp_hidden: int,
                 reduce_scatter_embeddings: bool = False, tp_group=None, init_seed: int = 0):
        super().__init__(config=config, vocab_size=vocab_size,
                         reduce_scatter_embeddings=reduce_scatter_embeddings, tp_group=tp_group)
        self.seed = _make_seed(self.vocab_size, lev_config, config, init_seed)
        ds, D, m = lev_config.seed_dim, config.hidden_size, int(mlp_hidden)
        self.mlp_hidden = m
        self.fc1_weight = _param((m, ds), config)
        self.fc1_bias = _param((m,), config)
        self.fc2_weight = _param((D, m), config)
        self.fc2_bias = _param((D,), config)
        if config.perform_initialization:
            with torch.no_grad():
                cb = self.seed.codebooks.float()
                z_std = float(cb.var(dim=1).sum(dim=0).mean().sqrt())  # Var z = sum_m Var C_m
            _init_mlp(self.fc1_weight, self.fc2_weight, z_std, config.init_method_std)
        self._finish_replicated()

    def forward(self, input_ids: Tensor) -> Tensor:
        ids = input_ids.transpose(0, 1)  # [s, b]
        if self.reduce_scatter_embeddings:
            ids = self._sequence_shard(ids)
        z = self.seed(ids)  # [s(/t), b, d_s]
        return _mlp(z.to(self.fc1_weight.dtype), self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)
