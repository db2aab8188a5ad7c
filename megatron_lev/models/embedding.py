"""``InputArmEmbedding``: megatron's ``LanguageModelEmbedding`` with the word table replaced by an arm.

It mirrors ``megatron/core/models/common/embeddings/language_model_embedding.py`` (0.16.1) step by
step, so the rest of GPTModel cannot tell the difference:

- the arm (albert, flat_mlp, factored_mlp, lev or any registered arm's ``build``; attribute ``arm``) maps ``input_ids [b, s]`` to
  ``[s, b, D]``; under sequence parallelism (and without learned absolute positions or token
  types, the same condition as megatron's ``reduce_scatter_embeddings``) it returns its sequence
  shard ``[s/t, b, D]``, reduce-scattered where the arm reduces;
- learned absolute positions (``position_embeddings``, a serial ``nn.Embedding``) are added to the
  full sequence, which is then scattered to the sequence-parallel region, as megatron does;
- ``fp32_residual_connection``, ``clone_scatter_output_in_embedding`` and embedding dropout (under
  the RNG tracker with sequence parallelism) as in megatron.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_lev.parallel.lev_embedding import parameter_device

from .arms import get_arm


class InputArmEmbedding(MegatronModule):
    """Input representation of a non-megatron arm plus megatron's embedding post-processing."""

    def __init__(
        self,
        config,
        model_config,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "rope",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__(config=config)
        if num_tokentypes:
            raise ValueError("token-type embeddings are not supported by the LEV input arms")
        self.vocab_size = int(vocab_size)
        self.max_sequence_length = int(max_sequence_length)
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = 0
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        self.reduce_scatter_embeddings = (
            (not self.add_position_embedding) and config.sequence_parallel and scatter_to_sequence_parallel
        )
        self.input_embedding = model_config.input_embedding
        self.arm = get_arm(model_config.input_embedding).build(
            config=config,
            vocab_size=self.vocab_size,
            model_config=model_config,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            tp_group=self.tp_group,
        )
        if self.add_position_embedding:
            # Unlike megatron's own (fp32, CPU, left to Float16Module and .cuda()): where the config says.
            self.position_embeddings = torch.nn.Embedding(
                self.max_sequence_length, config.hidden_size, device=parameter_device(config),
                dtype=config.params_dtype)
            if config.perform_initialization:
                config.embedding_init_method(self.position_embeddings.weight)
        self.tokentype_embeddings = None
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: Tensor, position_ids: Tensor, tokentype_ids: Optional[int] = None) -> Tensor:
        if tokentype_ids is not None:
            raise ValueError("token-type embeddings are not supported by the LEV input arms")
        embeddings = self.arm(input_ids)  # [s, b, D] or this rank's [s/t, b, D]
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(position_ids).transpose(0, 1)
        embeddings = embeddings.contiguous()
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.config.sequence_parallel:
            if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
            if self.config.clone_scatter_output_in_embedding and self.scatter_to_sequence_parallel:
                embeddings = embeddings.clone()
            with tensor_parallel.get_cuda_rng_tracker().fork():
                embeddings = self.embedding_dropout(embeddings)
        else:
            embeddings = self.embedding_dropout(embeddings)
        return embeddings

    @torch.no_grad()
    def materialize(self) -> Tensor:
        """The arm's dense [V, D] table (without positions), identical on every TP rank."""
        return self.arm.materialize()
