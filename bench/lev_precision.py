#!/usr/bin/env python
"""Rounding error of LEV's output stage under the precisions a GPU run could choose, against fp64.

    python bench/lev_precision.py                    # paper defaults, V = 50,304, D = 2048, TP = 2
    python bench/lev_precision.py --hidden 1024 --tp 4 --ids 8192

The layer (paper defaults, initialised as in training: W rescaled from vocabulary statistics, c = -mean)
is evaluated in fp64 for a fixed-seed sample of ids. Each variant rounds one stage and is compared with
the fp64 G; the unit is the error of rounding G itself to bf16 once (what every bf16 run pays):
- fp32: the projection sum_l W_l M_l + c in fp32 (what the layer does);
- tf32 projection: M and W rounded to TF32's 10-bit mantissa, products accumulated exactly (a TF32 GEMM);
- bf16 projection: M and W rounded to bf16 (a bf16 GEMM with fp32 accumulation); and the same where W
  is a bf16 parameter already (bf16 training): only M's rounding is new;
- bf16 TP partials: each tensor-parallel rank's partial sum over its heads rounded to bf16 before the
  reduction (a bf16 all-reduce), then c added;
- coordinates in TF32: the head projection A_l z computed from TF32-rounded A and z.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_lev.lev import LEVConfig, LEVEmbedding  # noqa: E402
from megatron_lev.lev.functional import separable_product  # noqa: E402


def tf32(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to TF32 (10 explicit mantissa bits, round to nearest even)."""
    bits = t.float().contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    bits = (bits + 0xFFF + lsb) & ~0x1FFF
    return bits.view(torch.float32).to(t.dtype)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def rms(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).mean().sqrt())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ids", type=int, default=4096)
    p.add_argument("--init-sample", type=int, default=8192, help="ids of the init statistics")
    a = p.parse_args(argv)
    cfg = LEVConfig(init_sample_size=a.init_sample, basis="dense")
    emb = LEVEmbedding(a.vocab, a.hidden, cfg).double()
    ids = torch.randperm(a.vocab, generator=torch.Generator().manual_seed(3))[: a.ids]
    heads = emb.heads
    with torch.no_grad():
        z = emb.seed(ids)
        x = heads.coordinates(z)
        m = separable_product(x, heads.delta, cfg.num_knots)  # [N, h, r] fp64
        w, c = heads.out_weight, emb.offset

        def project(mm, ww):
            return torch.einsum("nhr,hdr->nd", mm, ww)

        ref = project(m, w) + c
        unit = rms(bf16(ref.float()).double() - ref)
        variants = {"fp32 (the layer)": project(m.float(), w.float()).double() + c.float().double()}
        variants["tf32 projection"] = project(tf32(m.float()).double(), tf32(w.float()).double()) + c
        variants["bf16 projection"] = project(bf16(m.float()).double(), bf16(w.float()).double()) + c
        # A bf16 model's W is a bf16 parameter already, which the layer multiplies exactly: only M's
        # rounding is new there (compared with the exact product of that W).
        w16 = bf16(w.float()).double()
        bf16_m_only = project(bf16(m.float()).double(), w16) - project(m, w16) + ref
        per = cfg.num_heads // a.tp
        parts = [project(m[:, i * per:(i + 1) * per], w[i * per:(i + 1) * per]) for i in range(a.tp)]
        variants["bf16 projection, W already bf16"] = bf16_m_only
        variants[f"bf16 TP partials (TP={a.tp})"] = sum(bf16(q.float()).double() for q in parts) + c
        # Coordinates from TF32-rounded inputs, the rest exact.
        dt = torch.float64
        y = torch.einsum("nd,hed->nhe", tf32(z.float()).to(dt), tf32(heads.proj_weight.float()).to(dt))
        y = torch.nn.functional.layer_norm(y + heads.proj_bias, (y.shape[-1],), eps=1e-5)
        x_tf = torch.sigmoid(y * heads.norm_weight + heads.norm_bias)
        variants["coordinates in tf32"] = project(separable_product(x_tf, heads.delta, cfg.num_knots), w) + c
    print(f"LEV paper defaults (h={cfg.num_heads}, d_s={cfg.seed_dim}, r={cfg.rank}, kappa={cfg.num_knots}), "
          f"V={a.vocab}, D={a.hidden}, {a.ids} ids, at initialisation")
    print(f"rms(G) = {rms(ref):.3e}; rms(pre-offset sum) = {rms(ref - c):.3e}; "
          f"unit = rms error of bf16(G) = {unit:.3e}")
    print("| variant | rms error | in units of bf16(G) rounding |")
    print("|---|---|---|")
    for name, g in variants.items():
        e = rms(g - ref)
        print(f"| {name} | {e:.3e} | {e / unit:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
