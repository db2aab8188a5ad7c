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
    input side              the arm's own count (``models.arms``: ``InputArm.forward_flops_per_token`` and
                            ``forward_flops_per_iteration``):
                            tied/untied: 0 (a row gather)
                            albert: 2 e D;  flat_mlp: 2 (e m + m D);  factored_mlp: 2 (d_s m + m D)
    LEV, per evaluated id   2 * h * (d_s^2 + d_s*r*c + d_s*r + r*D)
                            (seed projection, spline basis x Delta with c = 3 non-zero knots, the
                            separable product, the head output; spec "Cost"). Model FLOPs: c = 3 for
                            every basis; the eager dense basis also multiplies kappa - 3 zeros per
                            dimension, which is work of that implementation, not of the model. Ids evaluated per iteration: every token in
                            ``token`` mode, at most every token in ``unique`` mode (counted as every
                            token: an upper bound), V per data-parallel rank per iteration in
                            ``table`` mode (every rank builds its own table; its TP ranks split the
                            heads, so one model replica evaluates each of the V ids once).

    FLOPs per iteration = 3 * (tokens * per-token forward + LEV ids * LEV per-id forward)
                          (LEV's ids: the lev arm's ``forward_flops_per_iteration``)

Norms, softmax, rotary and the loss are left out (a few FLOPs per element, under 1% at these sizes).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_lev.models.arms import get_arm
from megatron_lev.models.arms.lev import lev_forward_flops_per_id  # noqa: F401  (the LEV count's name here)

# Dense (no sparsity) bf16 tensor-core peak TFLOP/s, NVIDIA's datasheet figures (half the "with sparsity"
# ones), for MFU when --peak-tflops-per-device is not given. Matched against torch.cuda.get_device_name()
# in this order, so that the more specific names come first: "NVIDIA H100 PCIe", "NVIDIA H100 NVL", and
# the SXM part as "NVIDIA H100 80GB HBM3"; "NVIDIA H200" (SXM), "NVIDIA H200 NVL"; "NVIDIA GH200 480GB".
_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0),
    ("H100", 989.0), ("GB200", 2500.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("A10", 125.0),
    ("V100", 125.0),
)


def transformer_forward_flops_per_token(config: Any, vocab_size: int, seq_length: int) -> float:
    """Decoder and output head, per token, for a megatron-core TransformerConfig."""
    D, L, s = config.hidden_size, config.num_layers, seq_length
    a = config.num_attention_heads
    dh = config.kv_channels or D // a
    g = config.num_query_groups or a
    F = config.ffn_hidden_size
    proj = 2.0 * L * D * dh * (a + 2 * g) + 2.0 * L * a * dh * D
    scores = 2.0 * L * 2 * s * a * dh
    mlp = 2.0 * L * D * F * (3 if config.gated_linear_unit else 2)
    head = 2.0 * D * vocab_size
    return proj + scores + mlp + head


def flops_per_iteration(config: Any, model_config, *, global_batch_size: int, seq_length: int,
                        data_parallel_size: Optional[int] = None) -> float:
    """Model FLOPs of one optimizer step (all ranks together) for a TransformerConfig and a LevModelConfig.

    ``data_parallel_size``: how many data-parallel ranks build a table in ``table`` mode; None = megatron's
    data-parallel size where its parallel state is initialised, else 1 (one process)."""
    D, V = config.hidden_size, model_config.vocab_size
    tokens = global_batch_size * seq_length
    arm = get_arm(model_config.input_embedding)
    per_token = transformer_forward_flops_per_token(config, V, seq_length) + arm.forward_flops_per_token(model_config, D)
    total = 3.0 * tokens * per_token
    dp = (lambda: data_parallel_size) if data_parallel_size is not None else _data_parallel_size
    return total + 3.0 * arm.forward_flops_per_iteration(model_config, D, tokens=tokens, data_parallel_size=dp)


def _data_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def peak_tflops_per_device(given: Optional[float] = None, device_name: Optional[str] = None) -> Optional[float]:
    """``given`` (--peak-tflops-per-device), else the datasheet peak of this CUDA device (``device_name``:
    its ``torch.cuda.get_device_name()``, asked when not given), else None."""
    if given:
        return float(given)
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, val in _PEAK_TFLOPS:
        if key in device_name:
            return val
    return None


def peak_statement(given: Optional[float] = None, device_name: Optional[str] = None) -> str:
    """The start-up line that says what the log line's MFU is a fraction of: ``given``
    (--peak-tflops-per-device, e.g. a measured bf16 matrix ceiling) or this device's datasheet peak."""
    peak = peak_tflops_per_device(given, device_name)
    if given:
        return f"MFU is of {peak:g} TFLOP/s per device (--peak-tflops-per-device)"
    if peak is None:
        return "MFU: n/a (no peak known for this device; give --peak-tflops-per-device)"
    if device_name is None:
        import torch

        device_name = torch.cuda.get_device_name()
    return (f"MFU is of {peak:g} TFLOP/s per device ({device_name}'s dense bf16 datasheet peak; "
            "--peak-tflops-per-device sets a measured ceiling instead)")

