"""The example MoE Pile config: its parameter-breakdown table is what ``parameter_breakdown`` computes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "pile" / "configs" / "moe" / "400m-active-8x-top2.yaml"
PADDED_O200K = 200_064


def _rows():
    rows = {}
    for line in CONFIG.read_text().splitlines():
        m = re.match(r"#\s+(tied|untied|albert|flat_mlp|factored_mlp|lev)\s+(.*)$", line)
        if m:
            rows[m.group(1)] = [int(x.replace(",", "")) for x in re.findall(r"[\d,]{5,}", m.group(2))]
    return rows


@pytest.mark.parametrize("arm", ["tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev"])
def test_breakdown_table_matches_the_model_counts(arm):
    from megatron_lev.lev.config import LEVConfig
    from megatron_lev.models import LevModelConfig, build_transformer_config
    from megatron_lev.models.params import parameter_breakdown

    c = yaml.safe_load(CONFIG.read_text())
    lev = c["lev"]
    mc = LevModelConfig(
        vocab_size=PADDED_O200K, max_sequence_length=c["max_position_embeddings"], input_embedding=arm,
        lev=LEVConfig(num_digits=lev["digits"], seed_dim=lev["seed_dim"], num_knots=lev["knots"], rank=lev["rank"],
                      num_heads=lev["heads"]),
        albert_dim=9 if arm == "albert" else None, position_embedding_type=c["position_embedding_type"],
        normalization=c["normalization"], activation="swiglu" if c["swiglu"] else "gelu",
        add_bias_linear=not c["disable_bias_linear"])
    config = build_transformer_config(
        mc, num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"], num_moe_experts=c["num_experts"],
        moe_ffn_hidden_size=c["moe_ffn_hidden_size"], moe_router_topk=c["moe_router_topk"])
    b = parameter_breakdown(mc, config)
    want = [b["input_side"], b["dense"], b["experts"], b["experts_active"]]
    want += ([] if arm == "tied" else [b["output_head"]]) + [b["total"], b["active"]]
    assert _rows()[arm] == want
    assert 390e6 < b["dense"] + b["experts_active"] < 410e6  # ~400M active transformer parameters


def test_megatron_lm_moe_arguments_reach_the_transformer_config():
    from megatron_lev.arguments import parse_run_config
    from megatron_lev.models.factory import moe_config_kwargs

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 100 --disable-bias-linear").split()
    dense = moe_config_kwargs(parse_run_config(base, world_size=1))
    assert "num_moe_experts" not in dense and "mtp_num_layers" not in dense and dense["expert_model_parallel_size"] == 1
    rc = parse_run_config(base + "--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-layer-freq [1,0] "
                                 "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --mtp-num-layers 1 "
                                 "--mtp-loss-scaling-factor 0.1".split(), world_size=2)
    kw = moe_config_kwargs(rc)
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2 and kw["moe_layer_freq"] == [1, 0]
    assert kw["moe_aux_loss_coeff"] == 1e-2
    assert kw["expert_model_parallel_size"] == 2 and kw["expert_tensor_parallel_size"] == 1
    assert kw["mtp_num_layers"] == 1 and kw["mtp_loss_scaling_factor"] == 0.1
