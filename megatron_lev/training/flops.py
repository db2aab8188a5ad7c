"""Model FLOPs per iteration, for the TFLOP/s and MFU figures of the log line.

Convention (Megatron-LM's): a multiply-add is 2 FLOPs; the backward pass costs twice the forward,
so a trained token costs 3x its forward FLOPs; activation recomputation is not counted (model
FLOPs, not hardware FLOPs); attention scores are counted over the full s x s matrix as Megatron-LM
does (no causal halving), so figures compare with Megatron-LM logs.

Forward FLOPs per token, with D hidden, L layers, s sequence length, a heads of width d_h (a*d_h may
differ from D with --kv-channels), g query groups, F the MLP width, V the padded vocabulary:

    attention projections   2 * L * D * d_h * (a + 2 g) + 2 * L * a * d_h * D
    attention scores        2 * L * 2 * s * a * d_h           (Q K^T and attention x V)
    MLP                     2 * L * D * F * (3 if SwiGLU else 2)
    output head             2 * D * V
    input side, per token   tied/untied: 0 (a row gather)
                            albert: 2 e D;  flat_mlp: 2 (e m + m D);  factored_mlp: 2 (d_s m + m D)
    LEV, per evaluated id   2 * h * (d_s^2 + d_s*r*c + d_s*r + r*D)
                            (seed projection, spline basis x Delta with c = 3 non-zero knots, the
                            separable product, the head output; spec "Cost"). Model FLOPs: c = 3 for
                            every basis; the eager dense basis also multiplies kappa - 3 zeros per
                            dimension, which is work of that implementation, not of the model. Ids evaluated per iteration: every token in
                            ``token`` mode, at most every token in ``unique`` mode (counted as every
                            token: an upper bound), V once per iteration in ``table`` mode.

    FLOPs per iteration = 3 * (tokens * per-token forward + LEV ids * LEV per-id forward)

Norms, softmax, rotary and the loss are left out (a few FLOPs per element, under 1% at these sizes).
"""

from __future__ import annotations

from typing import Dict, Optional

# Dense bf16 peak TFLOP/s of common accelerators (for MFU when --peak-tflops-per-device is not given).
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def lev_forward_flops_per_id(args) -> float:
    h, ds, r, D = args.lev_heads, args.lev_seed_dim, args.lev_rank, args.hidden_size
    active_knots = 3  # a quadratic B-spline has 3 non-zero basis functions at any point
    return 2.0 * h * (ds * ds + ds * r * active_knots + ds * r + r * D)


def _input_side_per_token(args) -> float:
    arm, D = args.input_embedding, args.hidden_size
    widths: Dict[str, int] = getattr(args, "resolved_widths", None) or {}
    if arm == "albert":
        return 2.0 * widths.get("albert_dim", args.albert_dim or 0) * D
    if arm == "flat_mlp":
        e = widths.get("flat_mlp_dim", args.flat_mlp_dim or 0)
        m = widths.get("mlp_hidden", args.mlp_hidden or 0)
        return 2.0 * (e * m + m * D)
    if arm == "factored_mlp":
        m = widths.get("factored_mlp_hidden", args.mlp_hidden or 0)
        return 2.0 * (args.lev_seed_dim * m + m * D)
    return 0.0


def transformer_forward_flops_per_token(args) -> float:
    D, L, s = args.hidden_size, args.num_layers, args.seq_length
    a = args.num_attention_heads
    dh = args.kv_channels or D // a
    g = args.num_query_groups or a
    F = args.ffn_hidden_size
    V = args.padded_vocab_size
    proj = 2.0 * L * D * dh * (a + 2 * g) + 2.0 * L * a * dh * D
    scores = 2.0 * L * 2 * s * a * dh
    mlp = 2.0 * L * D * F * (3 if args.swiglu else 2)
    head = 2.0 * D * V
    return proj + scores + mlp + head


def flops_per_iteration(args) -> float:
    """Model FLOPs of one optimizer step (all ranks together)."""
    tokens = args.global_batch_size * args.seq_length
    per_token = transformer_forward_flops_per_token(args) + _input_side_per_token(args)
    total = 3.0 * tokens * per_token
    if args.input_embedding == "lev":
        ids = args.padded_vocab_size if args.lev_compute_mode == "table" else tokens
        total += 3.0 * ids * lev_forward_flops_per_id(args)
    return total


def peak_tflops_per_device(args) -> Optional[float]:
    if args.peak_tflops_per_device:
        return float(args.peak_tflops_per_device)
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            for key, val in _PEAK_TFLOPS.items():
                if key in name:
                    return val
    except Exception:  # pragma: no cover
        pass
    return None
