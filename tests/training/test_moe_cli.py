"""A LEV mixture-of-experts model from the command line, with the flags of Megatron-LM's Mixtral script,
on 4 gloo ranks in one job (run as torchrun runs it): TP=2 x EP=2 and PP=2 (MoE layers on both stages) equal the
TP=1/EP=1 run of the same model and global batch in losses and gradient norms; a run stopped at
iteration 2 and resumed at EP=2 is bit-exact; MTP logs its loss and its checkpoint evaluates (main head);
the load-balancing loss is in the metrics file and on the log line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megatron_lev.testing import train_records
from megatron_lev.testing.cli import run_cli
from tests.training._multi_run import launch_plan

# Its tests share multi-process jobs (~76 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow


# NVIDIA/Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh at commit
# 0a40979ee868697bd66157ab800d213ffff030d8, scaled down (the changed values are the sizes).
# Dropped: --tokenizer-type Llama2Tokenizer / --tokenizer-model
# (a tokenizer file; --mock-data --vocab-size 255 instead: with its end-of-document id 256 rows,
# padded alike at TP=1 and TP=2), --expert-model-parallel-size 2,
# --tensor-model-parallel-size 1, --pipeline-model-parallel-size 1 and --sequence-parallel (set per layout
# below: sequence parallelism needs TP > 1, Megatron-LM turns it off at TP=1), --eval-iters 10 (0: no
# evaluation needed here). Changed: --moe-token-dispatcher-type alltoall -> allgather (megatron-core's
# alltoall dispatcher makes a CUDA stream; gloo runs allgather), --num-experts 2 -> 4, --train-iters 7 -> 4.
# The script has no Transformer Engine flags (its --moe-grouped-gemm is commented out).
MIXTRAL = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings", "32",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "2",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
    "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "allgather", "--overlap-param-gather",
    "--overlap-grad-reduce",
    "--mock-data", "--vocab-size", "255", "--split", "99990,8,2",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "4",
    "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--use-distributed-optimizer", "--eval-iters", "0", "--no-load-optim", "--no-load-rng",
]
LEV = ["--input-embedding", "lev", "--lev-seed-dim", "16", "--lev-rank", "8", "--lev-heads", "2", "--lev-knots", "8",
       "--lev-chunk-size", "64", "--log-interval", "1", "--quiet-config"]
LAYOUTS = {
    "reference": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                  "--expert-model-parallel-size", "1"],
    "tp2-ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                "--expert-tensor-parallel-size", "1"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-cli")
    # Each layout initialises its shards from its own RNG streams: all start from the weights of one
    # TP=1/EP=1 iteration (the script's --no-load-optim --no-load-rng; dist_checkpointing reshards).
    init, ck = str(tmp / "init"), str(tmp / "resume")
    plan = [{"name": "init", "argv": MIXTRAL + LEV + LAYOUTS["reference"] + ["--save", init, "--exit-interval", "1"]}]
    plan += [{"name": name, "argv": MIXTRAL + LEV + layout + ["--load", init, "--metrics-file",
                                                               str(tmp / f"{name}.jsonl")]}
             for name, layout in LAYOUTS.items()]
    # Megatron-LM's --no-load-optim / --no-load-rng would make the resume inexact: drop them.
    resume = [a for a in MIXTRAL if a not in ("--no-load-optim", "--no-load-rng")]
    plan.append({"name": "full", "argv": resume + LEV + LAYOUTS["tp2-ep2"] + [
        "--metrics-file", str(tmp / "full.jsonl")]})
    plan.append({"name": "first", "argv": resume + LEV + LAYOUTS["tp2-ep2"] + [
        "--save", ck, "--exit-interval", "2", "--metrics-file", str(tmp / "first.jsonl")]})
    plan.append({"name": "resumed", "argv": resume + LEV + LAYOUTS["tp2-ep2"] + [
        "--load", ck, "--save", ck, "--metrics-file", str(tmp / "resumed.jsonl")]})
    # The dp_reshardable optimizer state of EP=2 at EP=1: refused in one line.
    plan.append({"name": "ep1-load", "argv": resume + LEV + ["--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--load", ck, "--train-iters", "4"]})
    plan.append({"name": "mtp", "argv": MIXTRAL + LEV + LAYOUTS["tp2-ep2"] + [
        "--mtp-num-layers", "1", "--train-iters", "2", "--metrics-file", str(tmp / "mtp.jsonl"),
        "--save", str(tmp / "mtp-ck")]})
    # Evaluation of the MTP checkpoint in the same job (TP=2 x DP=2, experts unsplit as evaluation builds them).
    plan.append({"name": "mtp-eval", "call": "tests.training.test_moe_cli:score_checkpoint", "tp": 2, "pp": 1,
                 "args": [str(tmp / "mtp-ck")]})
    res = launch_plan(4, plan, tmp, timeout=1800)
    assert all(r.code == 0 for n, r in res.items() if n != "ep1-load"), {
        n: (r.code, r.stdout[-2000:]) for n, r in res.items()}
    return tmp, res


def score_checkpoint(path: str):
    """(log lines, per-token log-probabilities of two sequences) of the checkpoint ``path``, on this rank."""
    from megatron_lev.evaluation.megatron_scorer import MegatronScorer

    lines = []
    scorer, _, _ = MegatronScorer.from_checkpoint(path, tp=2, pp=1, micro_batch_size=1, log=lines.append)
    scores = scorer.score([list(range(3, 20)), list(range(40, 70, 2))])
    return lines, [np.asarray(s.logprobs).tolist() for s in scores]


@pytest.mark.parametrize("layout", ["tp2-ep2", "pp2"])
def test_moe_layouts_equal_the_reference(runs, layout):
    tmp, _ = runs
    ref, got = train_records(tmp / "reference.jsonl"), train_records(tmp / f"{layout}.jsonl")
    assert sorted(ref) == sorted(got) == [2, 3, 4]
    for i in ref:
        assert got[i]["lm loss"] == pytest.approx(ref[i]["lm loss"], rel=1e-6), (layout, i)
        assert got[i]["grad norm"] == pytest.approx(ref[i]["grad norm"], rel=1e-5), (layout, i)
        assert got[i]["grad norm"] > 0 and not got[i]["skipped"]
        assert got[i]["load_balancing_loss"] == pytest.approx(ref[i]["load_balancing_loss"], rel=1e-5), (layout, i)
        assert got[i]["load_balancing_loss"] > 0


def test_moe_resume_at_ep2_is_bit_exact(runs):
    tmp, _ = runs
    full, first, resumed = (train_records(tmp / f"{n}.jsonl") for n in ("full", "first", "resumed"))
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    for i in (1, 2):
        assert first[i]["lm loss hex"] == full[i]["lm loss hex"]
    for i in (3, 4):
        assert resumed[i]["lm loss hex"] == full[i]["lm loss hex"], i
        assert resumed[i]["grad norm"] == full[i]["grad norm"], i


def test_aux_and_mtp_losses_are_logged(runs):
    tmp, res = runs
    line = [ln for ln in res["tp2-ep2"].stdout.splitlines() if " iteration " in ln and "lm loss:" in ln]
    assert len(line) == 3 and all("load_balancing_loss:" in ln for ln in line)
    mtp = train_records(tmp / "mtp.jsonl")
    assert sorted(mtp) == [1, 2] and all(mtp[i]["mtp_1 loss"] > 0 for i in mtp)
    # Cross-entropy of the token after next on random tokens: near ln(vocab) like the LM loss.
    assert all(abs(mtp[i]["mtp_1 loss"] - mtp[i]["lm loss"]) < 1.0 for i in mtp)
    assert any("mtp_1 loss:" in ln for ln in res["mtp"].stdout.splitlines())
    # Its checkpoint evaluates: the main head is scored, and the log says the MTP block is not.
    assert res["mtp-eval"].code == 0, res["mtp-eval"].job_stderr[-3000:]
    lines, logprobs = res["mtp-eval"].results[0]
    assert any("--mtp-num-layers 1; the main head is scored" in ln for ln in lines), lines
    assert [len(lp) for lp in logprobs] == [16, 14]
    assert all(np.isfinite(lp).all() and (np.asarray(lp) < 0).all() for lp in logprobs)


def test_optimizer_state_of_another_ep_is_refused(runs):
    _, res = runs
    r = res["ep1-load"]
    assert r.code != 0
    lines = [ln for ln in r.job_stderr.splitlines() if "(dp_reshardable) cannot be loaded" in ln]
    assert lines and "EP=2" in lines[0] and "EP=1" in lines[0] and "--no-load-optim" in lines[0]


def test_hf_export_of_the_moe_checkpoint_is_mixtral_with_its_logits(runs):
    """The script's TP=2 x EP=2 lev checkpoint (refused before) exports as MixtralForCausalLM: the experts
    regathered, the LEV table materialised; transformers' logits equal the checkpoint's at TP=1 (1e-5). Its
    MTP sibling has a block no HF class holds: refused in one line naming it, before any launch."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_lev.conversion import ConversionError, export_hf

    tmp, _ = runs
    ids = torch.remainder(torch.arange(40).reshape(2, 20) * 31 + 7, 255)
    res = export_hf(tmp / "resume", tmp / "hf", reference_ids=ids.tolist(), progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "hf"), dtype=torch.float32).eval()
    assert type(model).__name__ == res["hf_class"] == "MixtralForCausalLM"
    assert (model.config.num_local_experts, model.config.num_experts_per_tok, model.config.num_key_value_heads) == (4, 2, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, torch.from_numpy(res["logits"]), atol=1e-5, rtol=0)
    with pytest.raises(ConversionError, match=r"^cannot export to Hugging Face: --mtp-num-layers 1 \(the multi-token"):
        export_hf(tmp / "mtp-ck", tmp / "hf-mtp", progress=False)


def _evaluate(repo, env, load, data, out):
    r = run_cli(repo / "tools" / "evaluate.py", ["--load", load, "--valid-data", data, "--output-dir", out,
                                                 "--no-progress"], env=env, cwd=str(repo))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((out / "results.json").read_text())["perplexity"]["valid"]


def test_evaluation_runs_on_the_ep2_checkpoint_unchanged_and_on_its_reshard(runs):
    """tools/evaluate.py on one process (EP=1) reads the TP=2 x EP=2 checkpoint; the data is made with the
    checkpoint's own tokenizer (NullTokenizer, the mock data's). The checkpoint resharded to TP=1 (experts
    regathered: EP=1) evaluates to the same figures."""
    import yaml

    tmp, _ = runs
    repo = Path(__file__).resolve().parents[2]
    rng = np.random.default_rng(0)
    docs = tmp / "eval.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(map(str, rng.integers(0, 250, 80)))}) + "\n"
                            for _ in range(12)))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = run_cli(repo / "tools" / "preprocess_data.py", ["--input", docs, "--output-prefix", tmp / "eval",
                                                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                                                        "--append-eod"], env=env, cwd=str(repo))
    assert r.returncode == 0, r.stderr[-2000:]
    valid = _evaluate(repo, env, tmp / "resume", tmp / "eval_text_document", tmp / "eval-out")
    assert valid["tokens"] > 900 and valid["documents"] == 12
    # A 4-iteration model on random ids: its perplexity is near the vocabulary size (256).
    assert 100 < valid["ppl"] < 600, valid

    r = run_cli(repo / "tools" / "convert_checkpoint.py", ["reshard", "--load", tmp / "resume", "--save", tmp / "tp1",
                                                           "--target-tp", "1", "--target-pp", "1"], env=env, cwd=str(repo))
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = yaml.safe_load((tmp / "tp1" / "iter_0000004" / "config.yaml").read_text())
    assert (cfg["tensor_model_parallel_size"], cfg["expert_model_parallel_size"]) == (1, 1)
    assert cfg.get("expert_tensor_parallel_size") is None and cfg["num_experts"] == 4
    again = _evaluate(repo, env, tmp / "tp1", tmp / "eval_text_document", tmp / "eval-out-tp1")
    assert again["tokens"] == valid["tokens"]
    assert again["nll"] == pytest.approx(valid["nll"], rel=1e-6, abs=1e-6)
