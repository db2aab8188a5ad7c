#!/usr/bin/env python
"""The fused LEV product's Triton kernels alone: forward and each backward variant, CUDA-event medians.

    python bench/lev_kernel_timing.py                       # defaults and TP=2's rank (2 partitions)
    python bench/lev_kernel_timing.py --compare             # also each variant's error vs fp64 eager
    python bench/lev_kernel_timing.py --shape tiny,40,2,3,5,6 --device cpu   # interpreter (TRITON_INTERPRET=1)

A thin CLI over ``megatron_lev.kernels.lev_timing`` (``time_kernels``, ``compare_backward``): one line
per shape and variant, and with ``--json`` the rows. The backward's ratio to the forward is the figure
that picks ``lev_triton.DEFAULT_BACKWARD``: the faster variant whose errors stay within the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_lev.kernels.lev_timing import KernelShape, compare_backward, time_kernels  # noqa: E402


def _shape(text: str) -> KernelShape:
    parts = text.split(",")
    try:
        label, *dims = parts
        n, h, ds, kappa, r = (int(v) for v in dims)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants LABEL,N,H,D_S,KAPPA,R (got {text!r})")
    return KernelShape(label, n, h, ds, kappa, r)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=_shape, action="append", help="LABEL,N,H,D_S,KAPPA,R (repeatable); "
                   "default: lev_timing.default_shapes()")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu (the interpreter)")
    p.add_argument("--delta-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--compare", action="store_true", help="also each variant's max relative error vs fp64 eager")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    try:
        rows = time_kernels(a.shape, reps=a.reps, warmup=a.warmup, device=a.device,
                            delta_dtype=getattr(torch, a.delta_dtype))
        errors = compare_backward(a.shape, device=a.device) if a.compare else []
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"bench/lev_kernel_timing.py: {e}")
    for x in rows:
        print(f"{x['shape']:8s} N={x['n']} h={x['h']} d_s={x['d_s']} kappa={x['kappa']} r={x['r']} "
              f"{x['variant']:10s} P={x['partitions']}: forward {x['fwd_ms']:.3f} ms, backward {x['bwd_ms']:.3f} ms "
              f"({x['bwd_fwd_ratio']:.2f}x), median of {x['reps']} ({x['timer']}, {x['device']})")
    for x in errors:
        print(f"{x['shape']:8s} {x['variant']:10s} P={x['partitions']}: max rel err M {x['max_rel_err_m']:.1e}, "
              f"dL/dx {x['max_rel_err_grad_x']:.1e}, dL/dDelta {x['max_rel_err_grad_delta']:.1e} "
              f"({'ok' if x['ok'] else 'OVER'} {x['tolerance']:.0e})")
    out = {"timings": rows, "errors": errors}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
