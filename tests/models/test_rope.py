"""models.rope: megatron's RoPE fusion without Transformer Engine, bit for bit megatron's unfused RoPE on the
CPU in 4 operators each way instead of about 10 forward and 6 backward per call; compiled on CUDA, within 1
ulp."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lev.models import rope


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.launching = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._schema.name not in ("aten::detach", "aten::empty_like", "aten::ones_like") \
                and not func._schema.name.startswith("profiler::"):  # the named range of a profile
            self.launching.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _freqs(s, d):
    """[s, 1, 1, d] as megatron's RotaryEmbedding makes them (each half the same angles)."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_megatrons_unfused_rope_bit_for_bit_forward_and_backward(dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(0)
    s, b, h, d = 12, 3, 4, 16
    freqs = _freqs(s, d)
    # a non-contiguous view, as the query and key are slices of the QKV projection
    qkv = (torch.randn(s, b, h, 3 * d, generator=g) * 4).to(dtype)
    up = torch.randn(s, b, h, d, generator=g).to(dtype)
    outs, grads, ops = [], [], []
    for fn in (_apply_rotary_pos_emb_bshd, rope.apply_rotary_pos_emb):
        x = qkv.clone().requires_grad_(True)
        t = x[..., d:2 * d]
        fn(t, freqs)  # the tables of this freqs, once
        with _Ops() as counted:
            out = fn(t, freqs)
            out.backward(up)
        outs.append(out)
        grads.append(x.grad)
        ops.append(counted.launching)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    # 4 operators each way, and the slice of the test's QKV tensor going back (both sides)
    assert len(ops[1]) == 4 + 4 + 1 and len(ops[0]) >= 18, ops


def test_rope_hands_what_it_does_not_fuse_to_megatron():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t = torch.randn(5, 2, 2, 8)
    freqs = _freqs(5, 8)
    assert torch.equal(rope.apply_rotary_pos_emb(t, freqs, interleaved=True),
                       _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True))
    half = freqs[..., :4]  # --rotary-percent 0.5: the rest of each head passes through
    assert torch.equal(rope.apply_rotary_pos_emb(t, half), _apply_rotary_pos_emb_bshd(t, half))


def test_rope_tables_follow_the_frequencies_and_dtype():
    freqs = _freqs(6, 8)
    cos, sin = rope._TABLES.get(freqs, torch.float32)
    assert rope._TABLES.get(freqs, torch.float32)[0] is cos
    assert rope._TABLES.get(freqs, torch.bfloat16)[0].dtype == torch.bfloat16
    other = freqs * 2
    assert torch.equal(rope._TABLES.get(other, torch.float32)[0], torch.cos(other))
    freqs.mul_(3)  # changed in place: taken again
    assert torch.equal(rope._TABLES.get(freqs, torch.float32)[1][..., 4:], torch.sin(freqs)[..., 4:])


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each value of ``x`` (8 significant bits)."""
    _, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), (e - 8).to(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("s", [12, 40])  # a second shape: the compiled kernels' dynamic sizes
def test_compiled_rope_on_cuda_is_within_one_bf16_ulp_of_fp64(s):
    """On CUDA the rotation is compiled: computed in fp32 and rounded once to bf16 (a multiply-add may be
    contracted), so not bit for bit megatron's unfused operators, but within 1 ulp of the exact result of the
    same bf16 inputs and tables."""
    g = torch.Generator().manual_seed(1)
    b, h, d = 2, 4, 64
    t = (torch.randn(s, b, h, d, generator=g) * 4).to(torch.bfloat16).cuda().requires_grad_(True)
    up = torch.randn(s, b, h, d, generator=g).to(torch.bfloat16).cuda()
    freqs = _freqs(s, d).cuda()
    assert rope.compiles(t)
    out = rope.apply_rotary_pos_emb(t, freqs)
    out.backward(up)
    cos, sin_signed = (x.double() for x in rope._TABLES.get(freqs, torch.bfloat16))
    t64, up64 = t.detach().double(), up.double()
    want_out = t64 * cos + torch.roll(t64, d // 2, dims=-1) * sin_signed
    want_grad = up64 * cos + torch.roll(up64 * sin_signed, -(d // 2), dims=-1)
    for got, want in ((out, want_out), (t.grad, want_grad)):
        assert got.dtype == torch.bfloat16
        err = (got.double() - want).abs()
        assert bool((err <= _bf16_ulp(want)).all()), (err / _bf16_ulp(want)).max()
