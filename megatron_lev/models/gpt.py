"""``LevGPTModel``: megatron-core's GPTModel with a choice of input representation.

megatron-core has no spec slot for the embedding, so this subclasses ``GPTModel``:

- ``tied``: megatron's own ``LanguageModelEmbedding`` with ``share_embeddings_and_output_weights``
  (one V x D matrix; under pipeline parallelism megatron keeps the last stage's copy in sync
  through its embedding group).
- ``untied``: megatron's own ``LanguageModelEmbedding`` and a separate ColumnParallelLinear head.
- ``albert``, ``flat_mlp``, ``factored_mlp``, ``lev`` (every arm of the registry, ``models.arms``, but
  megatron's own two): the first stage's ``embedding`` is an
  ``InputArmEmbedding`` (same interface as megatron's). megatron-core's GPTModel has no slot for another
  embedding class (its constructor builds ``LanguageModelEmbedding`` whenever ``pre_process``), so
  ``LevGPTModel`` builds the GPTModel as a stage without an input layer and then makes it the first
  stage with its own input module (``_set_input_module``): no V x D table is ever allocated for these
  arms. The output head is megatron's untied vocab-parallel ColumnParallelLinear.

Initial weights (``init_streams.InputSideStreams``): the input side of every arm draws from streams forked
from the generators, and the decoder and head from the generators as the seed left them, so every arm of a
seed starts from the same transformer body and the untied-head arms from the same head (TP, PP alike; the
arms' own input modules still allocate nothing V x D). With MTP the block of an arm of ours is built after
the head (megatron's before it), so there the head and the MTP block differ between arm families.

Untied arms and pipeline parallelism (checked against megatron-core 0.16.1): ``GPTModel`` builds the
embedding only where ``pre_process`` and the head only where ``post_process``;
``setup_embeddings_and_output_layer`` returns before allocating or all-reducing a last-stage copy
unless weights are shared (or MTP is on); ``finalize_model_grads`` reduces the embedding group only
for ``share_embeddings_and_output_weights`` (``_get_shared_word_embedding_weight`` returns None
otherwise). So no dead copy exists and the embedding group carries no traffic for untied arms.

Multi-token prediction (``config.mtp_num_layers``, megatron-core's ``MultiTokenPredictionBlock``): GPTModel
builds a ``LanguageModelEmbedding`` wherever the MTP block is (``pre_process or mtp_process``) and passes
``embedding=self.embedding`` to the block, which embeds the shifted tokens with it. For megatron's arms
this is megatron's own path (under PP a V x D copy on the last stage, tied to the first stage's through
the sharded state dict). For the other arms the MTP block is added by ``_set_mtp_block`` beside the one
input arm, so both losses train the same arm parameters. The block sits on the last stage; an arm of
ours lives on the first, so MTP with such an arm needs PP=1 (refused otherwise: a copy of the arm on
the last stage would need its parameters all-reduced over the embedding group each step, as megatron
does for the tied table).

Linear cross-entropy (``config.cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl == "linear"``,
Megatron-LM's names): the last stage's output layer becomes a ``LinearCrossEntropyHead`` (the same
ColumnParallelLinear, its class changed in place). While ``_postprocess`` computes a loss (labels given,
no inference context, no output processor) the head returns its input and weight instead of the logits,
and ``compute_language_model_loss`` turns them into the per-token loss chunk by chunk, for the main head
and each MTP head alike (megatron-core 0.16 and 0.19 call the output layer and then this method in both
places). Without labels the head computes logits as before.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock


from megatron_lev.parallel.lev_embedding import LEVParallelEmbedding
from megatron_lev.parallel.linear_cross_entropy import DeferredLogits, LinearCrossEntropyHead

from .config import LevModelConfig, check_mtp_stage, linear_cross_entropy_on
from .embedding import InputArmEmbedding
from .init_streams import InputSideStreams
from .specs import get_block_spec, get_mtp_block_spec

class LevGPTModel(GPTModel):
    """GPT on megatron-core whose input representation is ``model_config.input_embedding``.

    Args:
        config: megatron-core TransformerConfig (e.g. from ``build_transformer_config``).
        model_config: the ``LevModelConfig`` (vocabulary, arm, LEV knobs, positions).
        transformer_layer_spec: layer ``ModuleSpec`` or block spec; None = ``get_block_spec``
            (Transformer Engine where available, else the CPU-capable local spec).
        pre_process / post_process: first / last pipeline stage (input arm / head).
        vp_stage: virtual pipeline stage of this chunk (interleaved schedule), or None.
    """

    def __init__(
        self,
        config,
        model_config: LevModelConfig,
        transformer_layer_spec=None,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
        parallel_output: bool = True,
        fp16_lm_cross_entropy: bool = False,
        pg_collection=None,
    ) -> None:
        model_config.validate(config)
        # Read by the overridden setup hooks during GPTModel.__init__ (plain attribute, not a module).
        object.__setattr__(self, "model_config", model_config)
        if transformer_layer_spec is None:
            transformer_layer_spec = get_block_spec(config, model_config, vp_stage=vp_stage)
        arm = model_config.input_embedding
        own_input = not model_config.arm.megatron_embedding
        mtp_spec = get_mtp_block_spec(config, model_config, transformer_layer_spec, vp_stage=vp_stage)
        if mtp_spec is not None and not pre_process:
            check_mtp_stage(arm, config.mtp_num_layers, config.pipeline_model_parallel_size)
        # The same body and head for every arm of a seed: the input side draws from streams of its own
        # (init_streams). megatron builds its embedding first: switched back in __setattr__ once it is set.
        streams = InputSideStreams()
        if not own_input and (pre_process or mtp_spec is not None):
            object.__setattr__(self, "_init_streams", streams)
            streams.input_side()
        super().__init__(
            config=config,
            transformer_layer_spec=transformer_layer_spec,
            vocab_size=model_config.vocab_size,
            max_sequence_length=model_config.max_sequence_length,
            # An arm of ours: megatron builds no input layer, _set_input_module adds ours below.
            pre_process=pre_process and not own_input,
            post_process=post_process,
            fp16_lm_cross_entropy=fp16_lm_cross_entropy,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=model_config.share_embeddings_and_output_weights,
            position_embedding_type=model_config.position_embedding_type,
            rotary_percent=model_config.rotary_percent,
            rotary_base=model_config.rotary_base,
            rope_scaling=model_config.use_rope_scaling,
            rope_scaling_factor=model_config.rope_scaling_factor,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
            # An arm of ours: megatron would build a LanguageModelEmbedding for the MTP block.
            mtp_block_spec=None if own_input else mtp_spec,
        )
        object.__setattr__(self, "_init_streams", None)
        if own_input and pre_process:
            streams.input_side()
            self._set_input_module(InputArmEmbedding(
                config=self.config,
                model_config=model_config,
                vocab_size=self.vocab_size,
                max_sequence_length=self.max_sequence_length,
                position_embedding_type=model_config.position_embedding_type,
                tp_group=self.pg_collection.tp,
            ))
            streams.body()
        if own_input and mtp_spec is not None:
            self._set_mtp_block(mtp_spec, vp_stage)
        if self.post_process and linear_cross_entropy_on(config):
            LinearCrossEntropyHead.adopt(self.output_layer, model_config.linear_cross_entropy_chunk_size)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "embedding" and self.__dict__.get("_init_streams") is not None:
            self._init_streams.body()  # megatron's table is drawn: the decoder and head draw from the seed's streams

    # -- the loss without the logits (linear cross-entropy)
    def _postprocess(self, *args, **kwargs):
        head = getattr(self, "output_layer", None) if self.post_process else None
        labels = kwargs["labels"] if "labels" in kwargs else (args[3] if len(args) > 3 else None)
        defer = (isinstance(head, LinearCrossEntropyHead) and labels is not None
                 and kwargs.get("inference_context") is None and kwargs.get("output_processor") is None)
        if not defer:
            return super()._postprocess(*args, **kwargs)
        head.defer_logits = True
        try:
            return super()._postprocess(*args, **kwargs)
        finally:
            head.defer_logits = False

    def compute_language_model_loss(self, labels: Tensor, logits) -> Tensor:
        # A named range in a profile (the training loop's are megatron_lev.*): the loss's kernels by name.
        with torch.profiler.record_function("megatron_lev.cross_entropy"):
            return self._language_model_loss(labels, logits)

    def _language_model_loss(self, labels: Tensor, logits) -> Tensor:
        if isinstance(logits, DeferredLogits):
            return logits.head.loss(logits, labels)
        if linear_cross_entropy_on(self.config):
            # Logits computed anyway (a caller of megatron's with an inference context or an output
            # processor): megatron-core's own unfused loss; its fused branch does not know "linear".
            return tensor_parallel.vocab_parallel_cross_entropy(
                logits, labels.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        return super().compute_language_model_loss(labels, logits)

    def _set_mtp_block(self, spec, vp_stage: Optional[int]) -> None:
        """Give this chunk (the first and last stage) megatron's MTP block, as GPTModel builds it from
        ``mtp_block_spec``, without the second input layer GPTModel would build for it: the block is called
        with ``embedding=self.embedding`` (GPTModel's ``_postprocess``), so the shifted tokens go through
        this chunk's one input arm and both losses' gradients reach the same parameters."""
        self.mtp_block_spec = spec
        self.mtp_process = True
        # The model's process groups, as GPTModel passes them from megatron-core 0.19: without them the block
        # takes only the tensor- and context-parallel groups, and an MoE layer inside it has no expert group.
        self.mtp = MultiTokenPredictionBlock(config=self.config, spec=spec, vp_stage=vp_stage,
                                             pg_collection=self.pg_collection)
        # Registered where megatron registers it (before the head): the parameter order fixes DDP's buffers.
        modules = dict(self._modules)
        mtp = modules.pop("mtp")
        order = list(modules)
        at = order.index("output_layer") if "output_layer" in order else len(order)
        order.insert(at, "mtp")
        self._modules = {name: (mtp if name == "mtp" else modules[name]) for name in order}

    def _set_input_module(self, embedding: InputArmEmbedding) -> None:
        """Make this chunk, built by GPTModel without an input layer, the first pipeline stage with
        ``embedding`` as its input module.

        In megatron-core 0.16.1's GPTModel constructor, ``pre_process`` decides three things: whether the
        embedding is built, the decoder's ``pre_process`` (take the embedding's output rather than the
        previous stage's tensor), and the tied head's weight allocation (untied arms only get here).
        The tests compare every ``pre_process`` flag and the module order with megatron's own untied model.
        """
        self.pre_process = True
        self.decoder.pre_process = True
        self.embedding = embedding
        # Registered first, where megatron registers its embedding: the parameter order fixes megatron
        # DDP's buffer layout, which distributed-optimizer checkpoints are saved in.
        self._modules = {"embedding": self._modules.pop("embedding"), **self._modules}
        # GPTModel ran this hook before the input module existed: mark it now.
        self.setup_embeddings_and_output_layer()

    @property
    def input_embedding(self) -> str:
        return self.model_config.input_embedding

    # -- megatron hooks that assume ``embedding.word_embeddings``
    def setup_embeddings_and_output_layer(self) -> None:
        """megatron's hook; for the arms of this fork it marks the input arm's parameters as megatron
        marks its word embedding (``is_embedding_or_output_parameter``, which --decoupled-lr selects).

        megatron's tied and untied arms mark their own word embedding (not the learned positions) and the
        output layer. For the other arms the input embedding is the whole input module that stands in for
        the V x D table (``InputArmEmbedding.arm``): with LEV its codebooks, spline heads and projections;
        with albert/flat_mlp/factored_mlp their table and projection. The learned position embedding is
        left out, as megatron leaves its own out."""
        if self.model_config.arm.megatron_embedding:
            return super().setup_embeddings_and_output_layer()
        if self.pre_process and isinstance(getattr(self, "embedding", None), InputArmEmbedding):
            for p in self.embedding.arm.parameters():
                p.is_embedding_or_output_parameter = True
        # Untied head, no shared weight: nothing to allocate, copy or all-reduce across stages.
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True

    def shared_embedding_or_output_weight(self) -> Optional[Tensor]:
        if self.model_config.arm.megatron_embedding:
            return super().shared_embedding_or_output_weight()
        return self.output_layer.weight if self.post_process else None

    # -- LEV / arm helpers
    def lev_modules(self) -> Iterator[torch.nn.Module]:
        """The ``LEVParallelEmbedding`` instances of this chunk (for the table-mode step hooks)."""
        return lev_modules(self)

    @torch.no_grad()
    def materialize_input_embedding(self) -> Tensor:
        return materialize_input_embedding(self)


def _unwrap(model) -> List[torch.nn.Module]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for m in chunks:
        while hasattr(m, "module") and not isinstance(m, LevGPTModel):
            m = m.module
        out.append(m)
    return out


def lev_modules(model) -> Iterator[torch.nn.Module]:
    """Every ``LEVParallelEmbedding`` in ``model`` (a model, a DDP wrapper or a list of chunks)."""
    return (m for chunk in _unwrap(model) for m in chunk.modules() if isinstance(m, LEVParallelEmbedding))


@torch.no_grad()
def materialize_input_embedding(model) -> Tensor:
    """The dense [V, D] input table of the first pipeline stage (collective over TP).

    tied/untied: megatron's word-embedding table gathered over TP; other arms: the arm evaluated
    on all ids (positions excluded). ``model`` may be wrapped (DDP) or a list of chunks; the chunk
    holding the embedding is used, and a stage without it raises ValueError.
    """
    for chunk in _unwrap(model):
        if not getattr(chunk, "pre_process", False) or not hasattr(chunk, "embedding"):
            continue
        emb = chunk.embedding
        if isinstance(emb, InputArmEmbedding):
            return emb.materialize()
        weight = emb.word_embeddings.weight.detach()
        group = emb.word_embeddings.tp_group
        if group.size() == 1:
            return weight.clone()
        parts = [torch.empty_like(weight) for _ in range(group.size())]
        torch.distributed.all_gather(parts, weight.contiguous(), group=group)
        return torch.cat(parts, dim=0)
    raise ValueError("this pipeline stage holds no input embedding (pre_process is False)")


def build_gpt_model(
    *,
    config,
    model_config: LevModelConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    **kwargs,
) -> LevGPTModel:
    """Build one model chunk; extra keyword arguments go to ``LevGPTModel``."""
    return LevGPTModel(
        config=config, model_config=model_config, pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage, **kwargs,
    )
