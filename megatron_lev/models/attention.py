"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Drop-in for megatron-core's ``DotProductAttention`` in the local layer spec: same constructor
and forward interface (query/key/value ``[s, b, heads, dim]`` per TP partition, returns
``[s, b, heads * dim]``), but the kernel is torch's SDPA, which runs on CPU (and picks a fused
kernel on GPU), needs no global memory buffer and no fused-softmax CUDA extension.

Masking: ``attention_mask`` follows megatron's convention (boolean, True = masked out,
broadcastable to ``[b, heads, sq, sk]``); when it is None and the mask type is causal, SDPA's
``is_causal`` is used. Grouped-query attention repeats keys/values per partition like megatron.
Attention dropout uses megatron's RNG tracker outside sequence parallelism, as megatron does.

``config.attention_backend`` picks SDPA's kernels (``torch.nn.attention.sdpa_kernel``): flash -> flash,
fused -> memory-efficient and cuDNN, unfused and local -> the math kernel, auto -> torch's choice.
``config.attention_softmax_in_fp32`` means what it means in megatron: the softmax is computed in fp32, the
products stay in the activations' dtype. SDPA's kernels do that already (flash, cuDNN and memory-efficient
keep the softmax in fp32; the math kernel upcasts 16-bit inputs unless
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` was set, which is refused with the flag), so
q, k and v are never cast: an fp32 copy would only keep flash and cuDNN from running.
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from megatron_lev.lev.config import ConfigError


class SDPAttention(MegatronModule):
    """Causal (or masked) scaled dot-product attention on one TP partition of the heads."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("--context-parallel-size > 1 needs the Transformer Engine attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("SDPAttention supports only the vanilla softmax (--softmax-type vanilla)")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPAttention does not implement sliding-window attention (--window-size)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        world = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world)
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.kernels = _sdpa_kernels(getattr(config, "attention_backend", AttnBackend.auto))

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise ValueError("packed sequences need the Transformer Engine attention")
        if attention_bias is not None:
            raise ValueError("attention bias is not supported by SDPAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask = None
        is_causal = False
        if attention_mask is None:
            is_causal = mask_type == AttnMaskType.causal
        elif attention_mask.is_floating_point():
            # Additive, built once per micro-batch (get_batch): passed as it is, no per-layer copy.
            mask = attention_mask if attention_mask.dtype == q.dtype else attention_mask.to(q.dtype)
        else:
            mask = ~attention_mask.bool()  # megatron's True = masked out; SDPA's True = attend
        dropout_p = self.dropout_p if self.training else 0.0
        if (self.config.attention_softmax_in_fp32 and q.dtype in (torch.float16, torch.bfloat16)
                and torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()):
            raise ConfigError("--attention-softmax-in-fp32 with torch.backends.cuda.allow_fp16_bf16_reduction_"
                             "math_sdp(True): SDPA's math kernel would run the softmax in 16 bits; drop one")
        with contextlib.ExitStack() as stack:
            if self.kernels is not None:
                stack.enter_context(sdpa_kernel(self.kernels))
            if dropout_p > 0.0 and not self.config.sequence_parallel:
                stack.enter_context(tensor_parallel.get_cuda_rng_tracker().fork())
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale
            )
        # [b, n, s, d] -> [s, b, n*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def _sdpa_kernels(backend) -> Optional[List[SDPBackend]]:
    """SDPA's kernels for megatron's ``AttnBackend`` (None: torch chooses)."""
    name = getattr(backend, "name", str(backend))
    return {"flash": [SDPBackend.FLASH_ATTENTION],
            "fused": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
            "unfused": [SDPBackend.MATH], "local": [SDPBackend.MATH]}.get(name)
