"""LEV with megatron-core's mixture-of-experts layers on gloo ranks: every input arm, the parameter
report, and the parallel layouts against the TP=1/EP=1 reference (same initial weights, same global
batch, three optimizer steps through the training loop's step functions).

Launches (imports cost more than the runs, so each does every layout it can):
  two ranks   every arm with MoE; the reference (lev, tied); EP=2 (allgather dispatcher) with and
              without the distributed optimizer and overlap; PP=2 with MoE layers on both stages (lev,
              tied), distributed optimizer and overlap on
  four ranks  TP=2 x EP=2, expert-tensor-parallel 1, sequence parallel, distributed optimizer and overlap
"""

from __future__ import annotations

import math

import pytest

from megatron_lev.lev.config import ConfigError
from megatron_lev.testing import run_distributed

from . import _harness as H

# Its tests share multi-process jobs (~46 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow


# fp32 on CPU: the layouts sum the same terms in another order (all-reduce, gathered experts).
LOSS_RTOL, NORM_RTOL = 1e-6, 1e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_parallel"))


@pytest.fixture(scope="module")
def two_rank(root):
    return run_distributed(H.two_rank_run, 2, args=(root,))


@pytest.fixture(scope="module")
def four_rank(two_rank, root):  # loads the reference weights that two_rank saved
    return run_distributed(H.four_rank_run, 4, args=(root,))


def _per_rank(results, layout):
    return [r[layout] for r in results]


def _assert_matches(ref_rows, rows, what):
    ref = ref_rows[0]
    for row in rows:
        assert len(row["losses"]) == H.STEPS
        for step, (got, want) in enumerate(zip(row["losses"], ref["losses"])):
            assert math.isclose(got, want, rel_tol=LOSS_RTOL), (what, step, got, want)
        for step, (got, want) in enumerate(zip(row["grad_norms"], ref["grad_norms"])):
            assert math.isclose(got, want, rel_tol=NORM_RTOL), (what, step, got, want)
        for step, (got, want) in enumerate(zip(row["aux"], ref["aux"])):
            # megatron-core reduces the load-balancing loss over the data-parallel ranks
            assert math.isclose(got["load_balancing_loss"], want["load_balancing_loss"], rel_tol=LOSS_RTOL)
    # ... and tracks the z-loss per data-parallel rank: its mean over the ranks is the global batch's
    for step in range(H.STEPS):
        z = [r["aux"][step]["z_loss"] for r in rows]
        z_ref = [r["aux"][step]["z_loss"] for r in ref_rows]
        assert math.isclose(sum(z) / len(z), sum(z_ref) / len(z_ref), rel_tol=1e-5), (what, step)


# ------------------------------------------------------------------------------- every arm, TP=1


@pytest.mark.parametrize("arm", H.ALL_ARMS)
def test_every_arm_trains_with_moe_layers(two_rank, arm):
    r = two_rank[0]["arms"][arm]
    assert math.isfinite(r["loss"])
    assert r["bad_grad"] == [], f"parameters without a finite non-zero gradient: {r['bad_grad']}"
    assert len(r["idle_experts"]) <= 1, r["idle_experts"]  # the routers spread 128 tokens over the experts


@pytest.mark.parametrize("arm", H.ALL_ARMS)
def test_parameter_report_separates_experts(two_rank, arm):
    r = two_rank[0]["arms"][arm]
    b = r["breakdown"]
    assert b["total"] == r["numel"]
    assert b["experts"] == r["experts_numel"] > 0
    assert b["dense"] + b["experts"] == b["transformer"]  # no MTP here
    assert b["experts_active"] == b["experts"] * H.TOPK // H.EXPERTS
    assert b["active"] == b["total"] - b["experts"] + b["experts_active"]


def test_moe_layer_pattern_is_built(two_rank):
    assert two_rank[0]["ref"]["mlp_types"] == ["MoELayer", "MLP", "MoELayer", "MoELayer"]


# ------------------------------------------------------------------------------- layouts


def test_ep2_matches_reference(two_rank):
    ref = _per_rank(two_rank, "ref")
    for layout in ("ep2", "ep2_plain"):
        rows = _per_rank(two_rank, layout)
        _assert_matches(ref, rows, layout)
        # each rank holds half of the experts of every MoE layer
        for row in rows:
            assert len(row["expert_params"]) == 3 * (H.EXPERTS // 2) * 2, sorted(row["expert_params"])


def test_ep2_resume_is_bit_exact(two_rank):
    """Model, distributed-optimizer state (expert parameters in their expert-parallel shards), scheduler
    and RNG saved at EP=2 and loaded into a fresh EP=2 model: the next step is the uninterrupted one."""
    for r in two_rank:
        for res in r["ep2_resume"]:  # without, and with overlapped grad reduce and param gather
            assert res["iteration"] == 3
            assert res["resumed"] == res["straight"], res


def test_pp2_with_moe_on_both_stages_matches_reference(two_rank):
    for arm_ref, layout in (("ref", "pp2"), ("ref_tied", "pp2_tied")):
        rows = _per_rank(two_rank, layout)
        assert sorted(r["mlp_types"] for r in rows) == [["MoELayer", "MLP"], ["MoELayer", "MoELayer"]]
        _assert_matches(_per_rank(two_rank, arm_ref), rows, layout)


def test_tp2_ep2_matches_reference(two_rank, four_rank):
    rows = _per_rank(four_rank, "tp2ep2")
    assert sorted(r["ep_rank"] for r in rows) == [0, 0, 1, 1]
    _assert_matches(_per_rank(two_rank, "ref"), rows, "tp2 x ep2")


def test_pp2_ep2_matches_reference(two_rank, four_rank):
    rows = _per_rank(four_rank, "pp2ep2")
    assert sorted((r["pp_rank"], r["ep_rank"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(r["mlp_types"] for r in rows) == [["MoELayer", "MLP"]] * 2 + [["MoELayer", "MoELayer"]] * 2
    _assert_matches(_per_rank(two_rank, "ref"), rows, "pp2 x ep2")


# ------------------------------------------------------------------------------- multi-token prediction


def test_mtp_uses_the_one_lev_module(two_rank):
    r = two_rank[0]["mtp"]
    assert r["lev_modules"] == 1
    assert r["embedding_params"] == r["plain_embedding_params"]  # no second copy of the arm
    assert r["mtp_params_with_embedding"] == []
    # megatron's child order (embedding first, MTP before the head): DDP's buffer layout
    assert r["children"] == ["embedding", "rotary_pos_emb", "decoder", "mtp", "output_layer"]


def test_mtp_parameter_report(two_rank):
    r = two_rank[0]["mtp"]
    b = r["breakdown"]
    assert b["total"] == r["numel"] and b["mtp"] == r["mtp_numel"] > 0
    assert b["dense"] + b["experts"] == b["transformer"] + b["mtp"]


def test_both_losses_send_gradients_into_the_lev_module(two_rank):
    r = two_rank[0]["mtp"]
    # MTP loss scale 0: exactly the gradient of the model without MTP; scale > 0: another gradient
    assert r["grad_scale0_vs_plain"] == 0.0
    assert r["grad_scale_vs_scale0"] > 1e-3 * r["grad_scale0_size"], r


def test_mtp_trains_at_ep2_like_the_reference_and_logs_its_loss(two_rank):
    ref, rows = _per_rank(two_rank, "ref_mtp"), _per_rank(two_rank, "ep2_mtp")
    _assert_matches(ref, rows, "ep2 + mtp")
    for got, want in zip(rows[0]["aux"], ref[0]["aux"]):
        assert math.isclose(got["mtp_1 loss"], want["mtp_1 loss"], rel_tol=LOSS_RTOL)
        assert 0 < want["mtp_1 loss"] < 10
    # the MTP loss changes what is trained: its losses differ from the plain reference's
    assert ref[0]["grad_norms"] != _per_rank(two_rank, "ref")[0]["grad_norms"]


def test_mtp_in_table_mode_trains_like_token_mode(two_rank):
    """Both compute modes of one LEV layer with an MTP block, from the same weights: table mode's hooks must
    return the gradients of both losses (a table gradient dropped on one use changes the second step)."""
    ref, rows = _per_rank(two_rank, "ref_mtp"), _per_rank(two_rank, "ref_mtp_table")
    _assert_matches(ref, rows, "table mode + mtp")


def test_mtp_with_an_own_arm_under_pipeline_parallelism_is_refused(two_rank):
    msgs = [r["pp2_mtp_refusal"] for r in two_rank]
    # the first stage builds (no MTP there); the last stage holds the MTP block and no input arm
    assert sorted(msgs, key=str) == sorted([None, msgs[1] or msgs[0]], key=str)
    msg = next(m for m in msgs if m)
    assert msg.startswith("--mtp-num-layers with --input-embedding lev needs the MTP block on the first") and "\n" not in msg


# ------------------------------------------------------------------------------- refusals (no ranks)


def _config(**kw):
    from megatron_lev.models import build_transformer_config

    mc = H.model_config("lev")
    base = dict(num_layers=2, hidden_size=H.HIDDEN, num_attention_heads=H.HEADS, num_moe_experts=4,
                moe_ffn_hidden_size=32)
    base.update(kw)
    config = build_transformer_config(mc, **base)
    mc.validate(config)
    return config


@pytest.mark.parametrize("kw, flag", [
    (dict(moe_grouped_gemm=True), "--moe-grouped-gemm"),
    (dict(moe_permute_fusion=True), "--moe-permute-fusion"),
    (dict(moe_router_topk=5), "--moe-router-topk"),
    (dict(moe_router_load_balancing_type="global_aux_loss"), "--moe-router-load-balancing-type"),
    (dict(moe_layer_freq=[1, 0, 1]), "--moe-layer-freq"),
    (dict(num_moe_experts=3, expert_model_parallel_size=2), "--num-experts 3"),
    (dict(add_bias_linear=True), "--disable-bias-linear"),
])
def test_moe_settings_refused_in_one_line(kw, flag):
    with pytest.raises(ConfigError) as e:
        _config(**kw)
    msg = str(e.value)
    assert flag in msg and "\n" not in msg, msg


def test_alltoall_dispatcher_needs_cuda():
    """megatron-core 0.16.1's alltoall dispatcher makes a torch.cuda.Stream when it is built."""
    import torch

    if torch.cuda.is_available():
        assert _config(moe_token_dispatcher_type="alltoall").moe_token_dispatcher_type == "alltoall"
        return
    with pytest.raises(ConfigError) as e:
        _config(moe_token_dispatcher_type="alltoall")
    assert "--moe-token-dispatcher-type alltoall needs CUDA" in str(e.value) and "\n" not in str(e.value)


def test_expert_layout_that_does_not_tile_the_stage_is_refused():
    from megatron_lev.distributed import DistributedConfigError, check_layout

    check_layout(4, 2, 1, ep=2, etp=1)
    check_layout(4, 2, 1, ep=2)  # etp defaults to tp: 2 x 2 experts-parallel ranks, expert-DP 1
    with pytest.raises(DistributedConfigError, match="--expert-model-parallel-size 2 x --expert-tensor-parallel"):
        check_layout(2, 2, 1, ep=2)
    with pytest.raises(DistributedConfigError, match="divide the 2 ranks of a pipeline stage"):
        check_layout(4, 1, 2, ep=4, etp=1)
