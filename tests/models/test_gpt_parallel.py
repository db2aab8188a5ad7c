"""LevGPTModel with every input arm on gloo ranks: TP=1 checks, and TP / SP / PP / VPP layouts that
load the TP=1 weights and must give the same loss and (gathered) gradients.

Launches (each costs 15-20 s of imports on 2 cores, so each runs every arm and layout it can):
  two ranks  TP=1 references (Llama-style RMSNorm/SwiGLU/RoPE and GPT-2-style LayerNorm/GeLU/
             learned positions; saves weights and gradients), TP=2, TP=2 + sequence parallel,
             PP=2 (1F1B), PP=2 x 2 virtual stages (interleaved); the groups are rebuilt in between
  four ranks TP=2 x PP=2 + sequence parallel
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lev.testing import run_distributed

from . import _harness as H

# Its tests share multi-process jobs (~57 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

ARMS = H.ALL_ARMS
RUN_ARMS = ARMS


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpt_parallel"))


def _merge(per_rank, layouts):
    """Rank 0 holds gathered gradients; the last pipeline stage holds the loss."""
    merged = {}
    for layout in layouts:
        merged[layout] = {}
        for arm in per_rank[0][layout]:
            rows = [r[layout][arm] for r in per_rank]
            m = dict(rows[0])
            m["losses"] = sorted(x["loss"] for x in rows if x["loss"] is not None)
            m["rows"] = rows
            merged[layout][arm] = m
    return merged


@pytest.fixture(scope="module")
def two_rank(root):
    per_rank = run_distributed(H.two_rank_run, 2, args=(RUN_ARMS, root))
    return _merge(per_rank, ("tp2", "tp2sp", "tp2sp_gpt2", "pp2", "pp2vpp2")), per_rank[0]["ref"], per_rank[0]["ref_gpt2"]


@pytest.fixture(scope="module")
def ref(two_rank):
    return two_rank[1]


@pytest.fixture(scope="module")
def ref_gpt2(two_rank):
    return two_rank[2]


@pytest.fixture(scope="module")
def tp2(two_rank):
    return two_rank[0]


@pytest.fixture(scope="module")
def pp2(two_rank):
    return two_rank[0]


@pytest.fixture(scope="module")
def tp2pp2(two_rank, root):
    return _merge(run_distributed(H.tp2pp2_run, 4, tp=2, pp=2, args=(RUN_ARMS, root)), ("tp2pp2sp",))


def _assert_same(ref_arm, got, what):
    assert got["losses"], f"{what}: no rank reported a loss"
    for loss in got["losses"]:
        assert math.isclose(loss, ref_arm["loss"], rel_tol=1e-5, abs_tol=1e-6), (what, loss, ref_arm["loss"])
    g_ref, g = ref_arm["grads"], got["grads"]
    assert set(g) == set(g_ref), (what, sorted(set(g) ^ set(g_ref)))
    for key in sorted(g_ref):
        torch.testing.assert_close(g[key], g_ref[key], rtol=2e-4, atol=2e-6, msg=lambda m: f"{what} {key}: {m}")


# ------------------------------------------------------------------------------- TP = 1


@pytest.mark.parametrize("arm", ARMS)
def test_tp1_forward_backward(ref, arm):
    r = ref[arm]
    assert math.isfinite(r["plain_loss"]) and math.isfinite(r["loss"])
    assert r["no_grad"] == [], f"parameters without a gradient: {r['no_grad']}"
    assert r["zero_or_nonfinite_grad"] == [], r["zero_or_nonfinite_grad"]
    assert r["unchecked"] == [], f"parameters missing from sharded_state_dict: {r['unchecked']}"
    assert tuple(r["table"].shape) == (H.VOCAB, H.HIDDEN)
    assert r["table_err"] < 1e-5, r["table_err"]  # materialize_input_embedding == the arm's rows
    assert r["lev_modules"] == (1 if arm == "lev" else 0)


@pytest.mark.parametrize("arm", ARMS)
def test_only_dense_arms_have_vxd_input_parameters(ref, arm):
    vxd = ref[arm]["vxd_params"]
    if arm == "tied":
        assert vxd == ["embedding.word_embeddings.weight"]  # one matrix, also the head
        assert ref[arm]["tied_same_object"]
    elif arm == "untied":
        assert sorted(vxd) == ["embedding.word_embeddings.weight", "output_layer.weight"]
    else:
        assert vxd == ["output_layer.weight"], vxd


@pytest.mark.parametrize("arm", ARMS)
def test_no_vxd_tensor_is_created_while_building_the_input_side(ref, arm):
    """Not even transiently: counted over every op of the construction of a first stage without head."""
    count = ref[arm]["input_side_allocations"]
    if arm in ("tied", "untied"):
        assert count >= 1  # megatron's V x D word-embedding table: the count sees it
    else:
        assert count == 0, count


@pytest.mark.parametrize("arm", ARMS)
def test_input_module_set_like_megatrons_first_stage(ref, ref_gpt2, pp2, arm):
    """An arm's chunks have megatron's own children order and pre_process flags (decoder included),
    as megatron builds them for the untied model, in every layout that has a first stage."""
    for results in (ref, ref_gpt2):
        assert results[arm]["construction"] == results["untied"]["construction"]
    for layout in ("pp2", "pp2vpp2"):
        got = [row["construction"] for row in pp2[layout][arm]["rows"]]
        assert got == [row["construction"] for row in pp2[layout]["untied"]["rows"]], layout
    assert ref[arm]["construction"][0]["pre_process"]["decoder"] is True


@pytest.mark.parametrize("arm", ARMS)
def test_parameter_breakdown_matches_model(ref, arm):
    assert ref[arm]["breakdown"]["total"] == ref[arm]["numel"]


# ------------------------------------------------------------------------------- TP = 2


@pytest.mark.parametrize("arm", ARMS)
def test_tp2_matches_tp1(ref, tp2, arm):
    got = tp2["tp2"][arm]
    _assert_same(ref[arm], got, "tp2")
    for row in got["rows"]:  # materialised table: same on both ranks and as at TP=1
        torch.testing.assert_close(row["table"], ref[arm]["table"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arm", ARMS)
def test_tp2_sequence_parallel_matches_tp1(ref, tp2, arm):
    _assert_same(ref[arm], tp2["tp2sp"][arm], "tp2+sp")


@pytest.mark.parametrize("arm", ARMS)
def test_gpt2_style_tp2_sequence_parallel_matches_tp1(ref_gpt2, tp2, arm):
    """LayerNorm + GeLU + learned absolute positions; under SP the embedding output is scattered
    after the positions are added, so replicated input-side parameters see the full sequence."""
    r = ref_gpt2[arm]
    assert r["no_grad"] == [] and r["zero_or_nonfinite_grad"] == []
    assert r["breakdown"]["total"] == r["numel"]
    _assert_same(r, tp2["tp2sp_gpt2"][arm], "gpt2-style tp2+sp")


# ------------------------------------------------------------------------------- PP


@pytest.mark.parametrize("arm", ARMS)
def test_pp2_matches_pp1(ref, pp2, arm):
    got = pp2["pp2"][arm]
    _assert_same(ref[arm], got, "pp2")
    last = [r for r in got["rows"] if "last_stage_embedding_params" in r]
    assert len(last) == 1
    if arm == "tied":
        # megatron keeps a synchronised copy of the shared matrix on the last stage
        assert last[0]["last_stage_shared_weight"]
    else:
        # no dead embedding copy on the last stage, nothing for the embedding group to reduce
        assert last[0]["last_stage_embedding_params"] == []
        assert not last[0]["last_stage_shared_weight"]


@pytest.mark.parametrize("arm", ARMS)
def test_pp2_virtual_stages_match_pp1(ref, pp2, arm):
    _assert_same(ref[arm], pp2["pp2vpp2"][arm], "pp2 x vpp2")


@pytest.mark.parametrize("arm", ARMS)
def test_tp2_pp2_sequence_parallel_matches_pp1(ref, tp2pp2, arm):
    _assert_same(ref[arm], tp2pp2["tp2pp2sp"][arm], "tp2 x pp2 + sp")
