"""Rotary position embedding in few launches where Transformer Engine's fused RoPE is absent.

megatron-core applies RoPE with TE's ``fused_apply_rotary_pos_emb`` when ``apply_rope_fusion`` is on, and
otherwise with its unfused ``_apply_rotary_pos_emb_bshd``, which on every call (query and key of every layer)
takes the cosine and sine of the frequencies again and rotates half of ``t`` by a chunk, a negation and a
concatenation: about 20 operators forward and 12 backward per layer. :func:`apply_rotary_pos_emb` computes
the same values in 4 operators each way,

    out = t * cos + roll(t, d/2) * sin'          sin' = [-sin(first half), sin(second half)]
    dt  = g * cos + roll(g * sin', -d/2)

(``roll(t, d/2) * sin'`` is ``rotate_half(t) * sin`` element for element, a negation being exact), with the
cosine and signed sine taken once per frequency tensor (megatron's rotary module hands every layer the same
one). On the CPU (eager) forward and backward are bit for bit megatron's unfused ones. On CUDA with Triton
they are compiled (one kernel each way), which computes in fp32 and rounds once to the input's dtype (a
multiply-add may be contracted), where megatron's unfused path rounds every operator's result: equal within 1
ulp of the dtype, not bit for bit (``tests/models/test_rope.py``'s ``gpu`` test bounds it against fp64). Installed as megatron's
``fused_apply_rotary_pos_emb`` (TE's signature) by :func:`install` where TE's is missing, so that
megatron's own switch, ``apply_rope_fusion`` (``--no-rope-fusion``), chooses it.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor


def _rotate(t: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    return t * cos + torch.roll(t, t.shape[-1] // 2, dims=-1) * sin_signed


def _rotate_back(g: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    return g * cos + torch.roll(g * sin_signed, -(g.shape[-1] // 2), dims=-1)


@functools.lru_cache(maxsize=None)
def _compiled():
    # dynamic=None: one kernel for the first shape, then one with dynamic sizes at the first other shape
    # (evaluation, another sequence length), where dynamic=False recompiles every new shape up to dynamo's
    # recompile limit and then runs eager.
    return torch.compile(_rotate, dynamic=None), torch.compile(_rotate_back, dynamic=None)


class _Tables:
    """The cosine and signed sine of the last frequency tensor, in the compute dtype (one entry: megatron's
    rotary module returns the same cached tensor to every layer and step)."""

    def __init__(self) -> None:
        self.key: Optional[Tuple] = None
        self.value: Optional[Tuple[Tensor, Tensor]] = None

    def get(self, freqs: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        key = (freqs, freqs._version, dtype)
        if self.key is None or self.key[0] is not freqs or self.key[1:] != key[1:]:
            # As megatron's unfused path: cos/sin in the frequencies' dtype (x mscale 1), then the input's.
            cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
            half = sin.shape[-1] // 2
            self.key, self.value = key, (cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))
        return self.value


_TABLES = _Tables()


class _RotaryPosEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, cos: Tensor, sin_signed: Tensor, compiled: bool) -> Tensor:
        ctx.save_for_backward(cos, sin_signed)
        ctx.compiled = compiled
        return (_compiled()[0] if compiled else _rotate)(t, cos, sin_signed)

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin_signed = ctx.saved_tensors
        return (_compiled()[1] if ctx.compiled else _rotate_back)(g, cos, sin_signed), None, None, None


def compiles(t: Tensor) -> bool:
    """Whether the rotation of ``t`` is compiled: a CUDA tensor where torch.compile has Triton."""
    if t.device.type != "cuda":
        return False
    from torch.utils._triton import has_triton

    return has_triton()


def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, interleaved: bool = False, **_unused) -> Tensor:
    """RoPE of ``t`` [s, b, h, d] by ``freqs`` [s, 1, 1, d] (TE's ``fused_apply_rotary_pos_emb`` signature, the
    ``sbhd`` layout megatron passes). Interleaved rotation, a partial rotary dimension and half-width
    frequencies are handed to megatron's unfused function."""
    rot_dim = freqs.shape[-1]
    if interleaved or rot_dim != t.shape[-1] or rot_dim % 2:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    with torch.profiler.record_function("megatron_lev.rope"):  # its kernels by name in a profile
        cos, sin_signed = _TABLES.get(freqs, t.dtype)
        return _RotaryPosEmb.apply(t, cos, sin_signed, compiles(t))


def install() -> bool:
    """Make :func:`apply_rotary_pos_emb` megatron-core's ``fused_apply_rotary_pos_emb`` where Transformer
    Engine's is missing (so ``apply_rope_fusion`` can be on); True when megatron's RoPE fusion is now ours."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = apply_rotary_pos_emb
    return rope_utils.fused_apply_rotary_pos_emb is apply_rotary_pos_emb
