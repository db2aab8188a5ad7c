"""Parameter matching of the baseline arms to LEV, and the analytic parameter breakdown.

Each arm's input-side count and its matching rule are its entry in the input-arm registry
(``models.arms``: the formulas in each arm's module docstring):

    tied, untied   V*D
    albert         V*e + e*D + D                       (table, projection weight and bias)
    flat_mlp       V*e + (e*m + m) + (m*D + D)         (table, MLP e -> m -> D with biases)
    factored_mlp   k*b*d_s + (d_s*m + m) + (m*D + D)   (LEV codebooks, MLP d_s -> m -> D)
    lev            P_LEV = k b d_s + h (d_s^2 + 3 d_s + d_s kappa r + r D) + D

The matched arms (``InputArm.matched``) are fitted to the budget P = P_LEV for the same V, D and LEV
knobs, within ``MATCH_TOLERANCE``; an arm that cannot be matched raises ``ConfigError`` asking for its
width explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional

from megatron_lev.lev.config import LEVConfig, lev_param_count

from .arms import MATCH_TOLERANCE, get_arm, matched_arms
from .arms.albert import albert_params
from .arms.factored_mlp import factored_mlp_params
from .arms.flat_mlp import flat_mlp_params, match_flat_mlp_hidden
from .moe import is_moe, moe_layer_pattern

if TYPE_CHECKING:  # models/config.py imports this module (the matching), not the other way round
    from .config import LevModelConfig

__all__ = ["MATCH_TOLERANCE", "albert_params", "factored_mlp_params", "flat_mlp_params", "format_parameter_breakdown",
           "input_side_params", "match_flat_mlp_hidden", "matched_widths", "mtp_params", "parameter_breakdown",
           "transformer_layer_params", "transformer_params"]


def matched_widths(
    vocab_size: int,
    hidden_size: int,
    lev_config: Optional[LEVConfig] = None,
    *,
    arms: Optional[Iterable[str]] = None,
    tolerance: float = MATCH_TOLERANCE,
) -> Dict[str, Any]:
    """Widths of the matched arms (``arms``: their names, default every one) whose input-side counts match
    LEV's (``InputArm.match``).

    Returns ``lev_params`` and, per requested arm, its widths, its parameter count and the
    relative error: ``albert_dim``, ``albert_params``, ``albert_rel_error``; ``flat_mlp_dim``,
    ``flat_mlp_hidden``, ``flat_mlp_params``, ``flat_mlp_rel_error``; ``factored_mlp_hidden``,
    ``factored_mlp_params``, ``factored_mlp_rel_error``. Raises ``ConfigError`` when an arm cannot
    be matched within ``tolerance``.
    """
    lev = lev_config if lev_config is not None else LEVConfig()
    V, D = int(vocab_size), int(hidden_size)
    P = lev_param_count(V, D, lev)
    out: Dict[str, Any] = {"lev_params": P}
    wanted = None if arms is None else set(arms)
    for arm in matched_arms():
        if wanted is None or arm.name in wanted:
            out.update(arm.match(V, D, lev, P, tolerance))
    return out


def input_side_params(model_config: LevModelConfig, hidden_size: int) -> int:
    """Parameters of the input arm (position embeddings excluded)."""
    return get_arm(model_config.input_embedding).input_params(model_config, hidden_size)


def _mlp_params(hidden_size: int, ffn: int, gated: bool, bias: bool) -> int:
    fc1_out = ffn * (2 if gated else 1)
    return hidden_size * fc1_out + (fc1_out if bias else 0) + ffn * hidden_size + (hidden_size if bias else 0)


def transformer_layer_params(config: Any) -> Dict[str, int]:
    """Parameters of one decoder layer at TP=1: ``attention`` (QKV, projection, q/k norms), ``norms``
    (input and pre-MLP), ``dense_mlp`` (a dense layer's MLP), and for MoE configs ``router`` (E x D, a
    bias with biases), ``expert`` (one routed expert), ``shared_experts`` (with ``moe_shared_expert_gate``
    its 1 x D gate)."""
    D = config.hidden_size
    norm = D * (2 if config.normalization == "LayerNorm" else 1)
    kv_ch = config.kv_channels
    q = config.num_attention_heads * kv_ch
    kv = (config.num_query_groups or config.num_attention_heads) * kv_ch
    bias = bool(config.add_bias_linear)
    qkv_bias = bias or bool(getattr(config, "add_qkv_bias", False))
    qkv = D * (q + 2 * kv) + (q + 2 * kv if qkv_bias else 0)
    proj = q * D + (D if bias else 0)
    qk_norm = 0
    if getattr(config, "qk_layernorm", False):
        qk_norm = 2 * kv_ch * (2 if config.normalization == "LayerNorm" else 1)
    gated = bool(config.gated_linear_unit)
    out = {"attention": qkv + proj + qk_norm, "norms": 2 * norm,
           "dense_mlp": _mlp_params(D, config.ffn_hidden_size, gated, bias)}
    experts = getattr(config, "num_moe_experts", None)
    if experts:
        out["router"] = experts * D + (experts if bias else 0)
        out["expert"] = _mlp_params(D, config.moe_ffn_hidden_size, gated, bias)
        shared = getattr(config, "moe_shared_expert_intermediate_size", None)
        out["shared_experts"] = (_mlp_params(D, shared, gated, bias) if shared else 0) + (
            D if shared and getattr(config, "moe_shared_expert_gate", False) else 0)
    return out


def _decoder_counts(config: Any, pattern) -> Dict[str, int]:
    """dense (attention, norms, dense MLPs, routers, shared experts) and routed-expert parameters of the
    layers in ``pattern`` (1 = MoE layer, 0 = dense)."""
    layer = transformer_layer_params(config)
    dense = experts = 0
    for is_moe_layer in pattern:
        dense += layer["attention"] + layer["norms"]
        if is_moe_layer:
            dense += layer["router"] + layer["shared_experts"]
            experts += config.num_moe_experts * layer["expert"]
        else:
            dense += layer["dense_mlp"]
    return {"dense": dense, "experts": experts}


def _moe_pattern(config: Any):
    return moe_layer_pattern(config.num_layers, config.moe_layer_freq) if is_moe(config) else [0] * config.num_layers


def transformer_params(config: Any) -> int:
    """Decoder parameters (all layers and the final norm) of a GPT built from ``config`` at TP=1, routed
    experts included."""
    counts = _decoder_counts(config, _moe_pattern(config))
    return counts["dense"] + counts["experts"] + config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)


def mtp_params(config: Any) -> Dict[str, int]:
    """Parameters of megatron-core's multi-token-prediction block (``mtp_num_layers`` layers, each: the
    embedding and hidden-state norms, the 2D -> D projection, one transformer layer like the decoder's
    last, a final norm; the embedding and output head are the model's own): ``dense`` and ``experts``."""
    n = getattr(config, "mtp_num_layers", None) or 0
    if not n:
        return {"dense": 0, "experts": 0}
    D = config.hidden_size
    norm = D * (2 if config.normalization == "LayerNorm" else 1)
    layer = _decoder_counts(config, _moe_pattern(config)[-1:])
    return {"dense": n * (3 * norm + 2 * D * D + layer["dense"]), "experts": n * layer["experts"]}


def parameter_breakdown(model_config: LevModelConfig, config: Any) -> Dict[str, Any]:
    """Analytic parameter counts of the whole model (as built at TP=1, PP=1).

    Keys: ``arm``, ``input_side`` (the arm; for tied the shared V x D table),
    ``position_embeddings`` (learned absolute only, else 0), ``transformer`` (layers + final
    norm, routed experts included), ``output_head`` (V x D; 0 for tied, whose head is the input
    table), ``mtp`` (the multi-token-prediction block, 0 without), ``total``, ``lev_reference`` (P_LEV
    for the same V, D, knobs), ``dense_table`` (V x D), and ``widths`` (the arm's resolved widths).

    Mixture of experts: ``experts`` (the routed experts of the decoder and the MTP block), ``dense``
    (every other parameter of the decoder and the MTP block: attention, norms, dense MLPs, routers,
    shared experts), ``experts_active`` (the experts one token passes through: top-k of E per MoE
    layer) and ``active`` (the parameters one token uses: ``total`` with ``experts_active`` in place
    of ``experts``; the input side counts in full, although a table arm reads one row of it).
    """
    D = config.hidden_size
    V = model_config.vocab_size
    arm = model_config.input_embedding
    inp = input_side_params(model_config, D)
    pos = model_config.max_sequence_length * D if model_config.position_embedding_type == "learned_absolute" else 0
    decoder = _decoder_counts(config, _moe_pattern(config))
    final_norm = D * (2 if config.normalization == "LayerNorm" else 1)
    trans = decoder["dense"] + decoder["experts"] + final_norm
    mtp = mtp_params(config)
    head = 0 if get_arm(arm).ties_output_head else V * D
    total = inp + pos + trans + mtp["dense"] + mtp["experts"] + head
    experts = decoder["experts"] + mtp["experts"]
    num_experts = getattr(config, "num_moe_experts", None)
    active_experts = experts * config.moe_router_topk // num_experts if num_experts else 0
    return {
        "arm": arm,
        "input_side": inp,
        "position_embeddings": pos,
        "transformer": trans,
        "output_head": head,
        "mtp": mtp["dense"] + mtp["experts"],
        "total": total,
        "dense": decoder["dense"] + final_norm + mtp["dense"],
        "experts": experts,
        "experts_active": active_experts,
        "active": total - experts + active_experts,
        "lev_reference": lev_param_count(V, D, model_config.lev),
        "dense_table": V * D,
        "widths": model_config.resolved_widths(D),
    }


def format_parameter_breakdown(breakdown: Dict[str, Any]) -> str:
    """Multi-line, human-readable table of ``parameter_breakdown`` for start-up logs."""

    def fmt(n: int) -> str:
        return f"{n:>15,}"

    total = max(1, breakdown["total"])
    lines = [f"parameters (input arm: {breakdown['arm']})"]
    rows = [
        ("input side", breakdown["input_side"]),
        ("position embeddings", breakdown["position_embeddings"]),
        ("transformer", breakdown["transformer"]),
        ("output head", breakdown["output_head"]),
    ]
    if breakdown.get("mtp"):
        rows.append(("multi-token pred.", breakdown["mtp"]))
    if breakdown.get("experts"):
        rows += [("  of which experts", breakdown["experts"]), ("  dense (no experts)", breakdown["dense"])]
    for name, n in rows:
        extra = ""
        if name == "output head" and get_arm(breakdown["arm"]).ties_output_head:
            extra = "  (shared with the input table)"
        lines.append(f"  {name:<20}{fmt(n)}  {100.0 * n / total:5.1f}%{extra}")
    lines.append(f"  {'total':<20}{fmt(breakdown['total'])}")
    if breakdown.get("experts"):
        lines.append(f"  {'active per token':<20}{fmt(breakdown['active'])}  "
                     f"{100.0 * breakdown['active'] / total:5.1f}%  (experts {breakdown['experts_active']:,} "
                     f"of {breakdown['experts']:,})")
    ref = breakdown["lev_reference"]
    lines.append(
        f"  input side vs LEV: {breakdown['input_side'] / ref:.4f}x of {ref:,}; "
        f"dense V x D table: {breakdown['dense_table']:,}"
    )
    if breakdown.get("widths"):
        lines.append("  widths: " + ", ".join(f"{k}={v}" for k, v in breakdown["widths"].items()))
    return "\n".join(lines)
