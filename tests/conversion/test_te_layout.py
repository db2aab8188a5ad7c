"""Checkpoints move between the Transformer Engine layer spec and the local (CPU) spec.

A tiny Llama-style lev model (2 layers, hidden 32, mock data, 200-token vocabulary) is trained for two
iterations with pretrain_lev.py's ``pretrain`` on the local spec; the same single-rank launch then
(a) compares the keys the local spec saves with the keys of megatron-core's TE spec, derived from its
spec tree with the TE modules replaced by placeholders; (b) rewrites the checkpoint as Transformer Engine writes it (an
``_extra_state`` object with FP8 metadata for every TE module, settings saying transformer_engine and
FP8) and as the local spec wrote it before it used TE's names; (c) loads all three through the
conversion and the evaluation loaders. The TE-layout checkpoint is then resharded to TP=2, exported to
Hugging Face and LEV, and resumed by pretrain_lev.py, side by side. Logits must equal the original's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_lev.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "pretrain_lev.py")
MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--lr", "1e-3", "--mock-data", "--vocab-size", "200", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0", "--quiet-config",
    "--input-embedding", "lev", "--lev-seed-dim", "8", "--lev-rank", "4", "--lev-heads", "2", "--lev-knots", "4",
]


def _pretrain(args):
    """pretrain_lev.py as one plain process (a single rank needs no launcher)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = run_cli(PRETRAIN, MODEL_ARGS + args, env=env, cwd=str(REPO), timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\nSTDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.stderr[-5000:]}")
    return r.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_lev.conversion import export_hf, export_lev, reshard_checkpoint
    from megatron_lev.testing import run_distributed

    from . import _te_layout_ranks

    root = tmp_path_factory.mktemp("te_layout")
    src, te, old = (str(root / n) for n in ("src", "te", "old"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (2, 12), generator=g)
    sequences = [torch.randint(0, 200, (17,), generator=g).tolist(), list(range(3, 12))]
    res = run_distributed(_te_layout_ranks.train_and_layouts, 1,
                          args=(MODEL_ARGS + ["--train-iters", "2"], src, te, old, ids, sequences))[0]
    with ThreadPoolExecutor(4) as ex:
        resumed = ex.submit(_pretrain, ["--train-iters", "3", "--load", te, "--transformer-impl", "auto"])
        jobs = [ex.submit(reshard_checkpoint, te, root / "te_tp2", tp=2, pp=1, progress=False),
                ex.submit(export_hf, te, root / "hf", tokenizer=False, progress=False),
                ex.submit(export_lev, te, root / "lev", progress=False)]
        for j in jobs:
            j.result()
        res["resume_log"] = resumed.result()
    res.update(root=root, ids=ids)
    return res


def test_local_spec_saves_under_transformer_engine_key_names(run):
    for variant, k in run["keys"].items():
        local_decoder = {x for x in k["local"] if x.startswith("decoder.")}
        assert local_decoder == k["te_params"], variant
        # Not vacuous: the fused norm names, the final norm and (variant) the q/k norms are there.
        assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in k["te_params"]
        assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in k["te_params"]
        assert "decoder.final_layernorm.weight" in k["te_params"]
        # Every extra state the local spec writes is one TE writes too.
        assert k["local_objects"] <= k["te_extra"], variant
    qk = run["keys"]["layernorm_bias_qknorm"]["te_params"]
    assert {"decoder.layers.self_attention.q_layernorm.weight", "decoder.layers.self_attention.k_layernorm.bias",
            "decoder.layers.self_attention.linear_qkv.layer_norm_bias", "decoder.final_layernorm.bias",
            "decoder.layers.mlp.linear_fc1.bias"} <= qk
    # The checkpoint pretrain_lev.py wrote holds exactly those names.
    saved = {x for x in run["saved"]["src"] if x.startswith("decoder.") and not x.endswith("_extra_state")}
    assert saved == run["keys"]["llama"]["te_params"]


def test_te_layout_checkpoint_loads_and_evaluates_like_the_original(run):
    assert run["written"]["te_extra_objects"] == 11  # 5 TE modules x 2 layers + the final norm
    te_only = {k for k in run["saved"]["te"] if k.endswith("_extra_state")} - run["saved"]["src"]
    assert te_only == {"decoder.layers.self_attention.core_attention._extra_state",
                       "decoder.final_layernorm._extra_state"}
    ref = run["conversion"]["src"]
    for loader in ("conversion", "evaluation"):
        assert torch.equal(run[loader]["te"], ref), loader
    assert torch.equal(run["evaluation"]["src"], ref)
    assert run["scores"]["te"] == run["scores"]["src"]
    for notes in (run["notes"]["te"], run["notes"]["te_eval"]):
        assert any("2 Transformer Engine extra-state keys (FP8 metadata)" in n and "ignored" in n for n in notes)
    assert not any("extra-state" in n for n in run["notes"]["src"])


def test_checkpoint_written_before_the_te_names_loads(run):
    assert "decoder.layers.input_layernorm.weight" in run["saved"]["old"]
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" not in run["saved"]["old"]
    for loader in ("conversion", "evaluation"):
        assert torch.equal(run[loader]["old"], run["conversion"]["src"]), loader
    assert run["scores"]["old"] == run["scores"]["src"]
    assert any(n.endswith("2 norm keys read under the key names of checkpoints written before the Transformer "
                          "Engine names") for n in run["notes"]["old"])


def test_extra_state_absent_from_checkpoint_is_tolerated(run):
    from ._te_layout_ranks import FRESH_STATE

    e = run["extra_requesting"]
    assert e["modules"] == 2 and torch.equal(e["logits"], run["conversion"]["src"])
    assert e["states"] == [list(FRESH_STATE)] * 2  # each module kept its own state
    assert any("1 Transformer Engine extra-state keys are not in the checkpoint" in n for n in e["notes"])


def _model_tensors(checkpoint_dir: str, tmp: Path):
    """The model's global tensors in a dist checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_dir, str(tmp))
    return {k: v for k, v in torch.load(str(tmp), weights_only=False).items()
            if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}


def test_te_layout_checkpoint_reshards_and_exports(run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_lev.conversion import load_lev_embedding
    from megatron_lev.conversion.source import open_checkpoint

    root = run["root"]
    # Resharded to TP=2: the same tensors under the same names; the run's settings are kept.
    src = _model_tensors(open_checkpoint(str(root / "src")).path, root / "src.pt")
    tp2_ckpt = open_checkpoint(str(root / "te_tp2"))
    tp2 = _model_tensors(tp2_ckpt.path, root / "tp2.pt")
    assert set(tp2) == set(src) and "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in src
    for k in src:
        assert torch.equal(tp2[k], src[k]), k
    assert tp2_ckpt.args["transformer_impl"] == "transformer_engine" and tp2_ckpt.args["fp8_format"] == "hybrid"
    # Hugging Face export: logits equal the original model's.
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(run["ids"]).logits
    torch.testing.assert_close(hf, run["conversion"]["src"][..., : hf.shape[-1]], atol=1e-5, rtol=0)
    # LEV export: the pure-torch layer gives the original input table.
    table = run["table"]
    torch.testing.assert_close(load_lev_embedding(str(root / "lev")).materialize(), table, atol=1e-6, rtol=0)
    torch.testing.assert_close(load_file(str(root / "hf" / "model.safetensors"))["model.embed_tokens.weight"],
                               table, atol=1e-6, rtol=0)


def test_pretrain_resumes_from_te_layout_checkpoint(run):
    log = run["resume_log"]
    assert "successfully loaded checkpoint from" in log and "at iteration 2" in log
    assert "2 Transformer Engine extra-state keys (FP8 metadata)" in log
    assert "iteration        3/       3" in log


@pytest.mark.gpu
@pytest.mark.te
def test_te_spec_checkpoint_and_local_spec_checkpoint_swap_on_gpu(tmp_path):
    from megatron_lev.models.config import te_available
    from megatron_lev.testing import run_distributed

    from . import _te_layout_ranks

    if not te_available():
        pytest.fail("GPU test needs Transformer Engine (pip install megatron-lev[gpu])")
    diffs = run_distributed(_te_layout_ranks.gpu_round_trip, 1, args=(str(tmp_path),))[0]
    assert diffs["te_to_local"] < 1e-4 and diffs["local_to_te"] < 1e-4, diffs
