"""Checkpoint conversion end to end on CPU ranks.

Tiny Llama-style models (2 layers, hidden 64, GQA with 2 query groups, the test BPE in GPT-2 format
with 4,000 tokens padded to 4,096, mock data) of the tied (TP=2 x PP=2), untied (TP=2 x DP=2) and lev
(TP=2 x DP=2) arms are trained for two iterations with pretrain_lev.py, resharded to TP=1 (and the
tied one back to TP=2 x PP=2), exported to Hugging Face and reloaded with transformers. Checks: the
TP=1 model's logits equal the source's (1e-5, fp32); the round trip is exact; HF logits on real text
equal megatron's (1e-4), ``generate()`` runs; the LEV parameters reload into the pure-torch
LEVEmbedding; pretrain_lev.py resumes from a converted checkpoint; bad inputs give one-line errors.
Each launch costs several seconds of imports, so training, resharding and the source logits share
one 4-rank job (a session fixture) and the exports run side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_lev.testing.cli import run_cli
from tests.conftest import BPE_VOCAB
from tests.training._multi_run import launch_plan

# Its tests share multi-process jobs (~106 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "pretrain_lev.py")
CONVERT = str(REPO / "tools" / "convert_checkpoint.py")
ARMS = ("tied", "untied", "lev")
LAYOUT = {"tied": (2, 2), "untied": (2, 1), "lev": (2, 1)}  # (TP, PP) of the training run
WORLD = 4  # ranks of the training job (the TP=2 arms train at DP=2)
VOCAB = BPE_VOCAB  # the tokenizer's
PADDED = 4096  # the model's (divisible by 128 x TP)


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _model_args(tok_dir: Path):
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(tok_dir / "vocab.json"), "--merge-file", str(tok_dir / "merges.txt"),
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "100",
        "--eval-iters", "0", "--quiet-config", "--lev-seed-dim", "16", "--lev-rank", "8", "--lev-heads", "2",
        "--lev-knots", "8", "--lev-init-sample-size", "4096",
    ]


@pytest.fixture(scope="session")
def text_ids(sample_corpus, tok_args):
    """Two 24-token windows of real text (the sample corpus's valid.jsonl.zst) in the test BPE."""
    from megatron_lev.tokenizer import build_tokenizer

    tok = build_tokenizer(**tok_args["gpt2"])
    rows = []
    for doc in sample_corpus.docs("valid"):
        ids = tok.tokenize(doc)
        if len(ids) >= 24:
            rows.append(ids[:24])
        if len(rows) == 2:
            break
    return torch.tensor(rows)


@pytest.fixture(scope="session")
def runs(tokenizer_files, text_ids, tmp_path_factory):
    """One 4-rank job (one launch's imports): the source checkpoints (2 iterations) of every arm, one
    after the other (the TP=2 arms at TP=2 x DP=2); their TP=1 conversions and the tied one's way back
    to TP=2 x PP=2 (rank 0); then the logits of the sources at their layouts and of the round trip."""
    root = tmp_path_factory.mktemp("conversion")
    tok = Path(tokenizer_files.bpe_dir)
    plan = []
    for arm in ARMS:
        tp, pp = LAYOUT[arm]
        plan.append({"name": arm, "argv": _model_args(tok) + [
            "--input-embedding", arm, "--train-iters", "2", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--save", str(root / f"{arm}_src")]})
    plan.append({"name": "convert", "rank0": "tests.conversion._ranks:convert_sources", "args": [str(root), ARMS]})
    layouts = [(2, 2, [str(root / "tied_src"), str(root / "tied_back")]),
               (2, 1, [str(root / "untied_src"), str(root / "lev_src")])]
    plan.append({"name": "source logits", "call": "tests.conversion._ranks:logits_at_layouts", "tp": 2, "pp": 2,
                 "args": [layouts, text_ids.tolist()]})
    t0 = time.time()
    res = launch_plan(WORLD, plan, root / "job")
    for arm in ARMS:
        r = res[arm]
        assert r.code == 0, f"{arm}: exit {r.code}\nSTDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.job_stderr[-5000:]}"
    print(f"[conversion tests] training, resharding, source logits: {time.time() - t0:.0f} s", file=sys.stderr)
    source = {k: v for rank in res["source logits"].results for k, v in rank.items()}
    return {"root": root, "tok": tok, "source": source}


@pytest.fixture(scope="session")
def evaluated(runs, text_ids):
    """Logits of the sources at their layouts (and the round trip), and HF exports of the TP=1 models
    (the exporter also returns the TP=1 megatron model's logits on the same ids)."""
    from megatron_lev.conversion import export_hf

    root = runs["root"]
    ids = text_ids.tolist()

    def export(arm):
        kw = {"trim_vocab": True, "max_shard_size": "1MB"} if arm == "untied" else {}
        return export_hf(root / f"{arm}_tp1", root / f"{arm}_hf", reference_ids=ids, progress=False, **kw)

    t0 = time.time()
    with ThreadPoolExecutor(len(ARMS)) as ex:
        results = list(ex.map(export, ARMS))
    print(f"[conversion tests] HF exports: {time.time() - t0:.0f} s", file=sys.stderr)
    return {"source": runs["source"], "hf": dict(zip(ARMS, results))}


# ---------------------------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("arm", ARMS)
def test_tp1_conversion_matches_source_logits(runs, evaluated, arm):
    root = runs["root"]
    src = evaluated["source"][str(root / f"{arm}_src")]
    tp1 = torch.from_numpy(evaluated["hf"][arm]["logits"])
    assert src.shape == (2, 24, PADDED) and tp1.shape == src.shape
    torch.testing.assert_close(tp1, src, atol=1e-5, rtol=0)
    # The converted checkpoint is a training checkpoint at the new layout.
    ck = root / f"{arm}_tp1"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    import yaml

    cfg = yaml.safe_load((ck / "iter_0000002" / "config.yaml").read_text())
    assert cfg["tensor_model_parallel_size"] == 1 and cfg["pipeline_model_parallel_size"] == 1
    assert cfg["padded_vocab_size"] == PADDED and cfg["make_vocab_size_divisible_by"] == 128 * LAYOUT[arm][0]
    from megatron_lev.tokenizer import padded_vocab_size

    assert padded_vocab_size(VOCAB, cfg["make_vocab_size_divisible_by"], 1) == PADDED


def test_round_trip_back_to_tp2_pp2_is_exact(runs, evaluated):
    root = runs["root"]
    back = evaluated["source"][str(root / "tied_back")]
    assert torch.equal(back, evaluated["source"][str(root / "tied_src")])
    from megatron_lev.conversion import open_checkpoint

    c = open_checkpoint(root / "tied_back")
    assert c.layout == {"tp": 2, "pp": 2, "world_size": 4} and c.iteration == 2
    assert c.common["consumed_train_samples"] == 8


def test_training_resumes_from_converted_checkpoint(runs, tmp_path):
    """pretrain_lev.py --load on the TP=1 lev checkpoint (its config.yaml as --config) continues at
    iteration 3 without optimizer state."""
    root = runs["root"]
    cfg = root / "lev_tp1" / "iter_0000002" / "config.yaml"
    r = run_cli(PRETRAIN, ["--config", cfg, "--load", root / "lev_tp1", "--save", tmp_path / "resumed", "--train-iters",
                           "3", "--override-opt-param-scheduler", "--metrics-file", tmp_path / "m.jsonl"],
                env=_env(), timeout=600, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "successfully loaded checkpoint from" in r.stdout and "at iteration 2" in r.stdout
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    its = [x["iteration"] for x in rows if x["kind"] == "train"]
    assert its == [3]
    assert (tmp_path / "resumed" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


# ---------------------------------------------------------------------------------------------- HF export


@pytest.mark.parametrize("arm", ARMS)
def test_hf_export_matches_megatron_and_generates(runs, evaluated, text_ids, tok_args, arm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs["root"] / f"{arm}_hf"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is (arm == "tied")
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    if arm == "untied":  # trimmed to the tokenizer, sharded with an index
        assert cfg["vocab_size"] == VOCAB
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" in index["weight_map"]
    else:
        assert cfg["vocab_size"] == PADDED and (out / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        hf = model(text_ids).logits
    ref = torch.from_numpy(evaluated["hf"][arm]["logits"])[..., : cfg["vocab_size"]]
    torch.testing.assert_close(hf, ref, atol=1e-4, rtol=0)
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = tok("The quick brown fox", return_tensors="pt")
    from megatron_lev.tokenizer import build_tokenizer

    ids = build_tokenizer(**tok_args["gpt2"]).tokenize("The quick brown fox")
    assert prompt.input_ids.tolist() == [ids] and len(ids) > 1
    gen = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape == (1, len(ids) + 4)


def test_lev_parameters_reload_into_pure_layer(runs, evaluated):  # evaluated writes the HF export
    from safetensors.torch import load_file

    from megatron_lev.conversion import load_lev_embedding
    from megatron_lev.lev import LEVEmbedding

    out = runs["root"] / "lev_hf"
    emb = load_lev_embedding(str(out / "lev"))
    assert isinstance(emb, LEVEmbedding) and emb.config.num_heads == 2 and emb.vocab_size == PADDED
    table = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    torch.testing.assert_close(emb.materialize(), table, atol=1e-5, rtol=0)
    assert (out / "lev" / "lev_embedding.safetensors").stat().st_size < 100_000


def test_qkv_and_fc1_split_follow_megatron_grouping():
    from megatron_lev.conversion import split_fc1, split_qkv

    n, g, hd, d = 6, 2, 3, 5
    q = torch.randn(n * hd, d)
    k = torch.randn(g * hd, d)
    v = torch.randn(g * hd, d)
    per = n // g
    fused = torch.cat([torch.cat([q.view(g, per * hd, d)[i], k.view(g, hd, d)[i], v.view(g, hd, d)[i]])
                       for i in range(g)])
    q2, k2, v2 = split_qkv(fused, n, g, hd)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    gate, up = split_fc1(torch.cat([torch.ones(4, d), torch.zeros(4, d)]))
    assert torch.equal(gate, torch.ones(4, d)) and torch.equal(up, torch.zeros(4, d))


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("setting, expected", [
    ({"normalization": "LayerNorm"}, "Llama: --normalization LayerNorm"),
    ({"swiglu": False}, "--swiglu not set"),
    ({"disable_bias_linear": False}, "--disable-bias-linear not set"),
    ({"position_embedding_type": "learned_absolute"}, "--position-embedding-type learned_absolute"),
    ({"rotary_percent": 0.5}, "--rotary-percent 0.5"),
    ({"num_experts": 4, "moe_layer_freq": [1, 0]}, "Mixtral: --moe-layer-freq [1, 0] (every Mixtral layer"),
    ({"num_experts": 4, "normalization": "LayerNorm"}, "Mixtral: --normalization LayerNorm"),
    # LayerNorm + GeLU is GPT-2, which has learned positions and a key/value head per query head.
    ({"normalization": "LayerNorm", "swiglu": False}, "GPT-2 (LayerNorm, GeLU): --position-embedding-type rope"),
    ({"normalization": "LayerNorm", "swiglu": False, "position_embedding_type": "learned_absolute",
      "group_query_attention": True, "num_query_groups": 2}, "GPT-2 (LayerNorm, GeLU): --num-query-groups 2"),
])
def test_hf_export_refuses_non_llama_settings(setting, expected):
    from megatron_lev.arguments import parse_args, resolved_config
    from megatron_lev.config import RunConfig
    from megatron_lev.conversion import ConversionError, check_hf_compatible

    # A Llama-style lev model's config.yaml, then one setting changed in the file.
    ok = resolved_config(parse_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 4 "
        "--lr 1e-3 --mock-data --vocab-size 100 --normalization RMSNorm --swiglu --disable-bias-linear "
        "--position-embedding-type rope --input-embedding lev".split(), world_size=1))
    assert check_hf_compatible(RunConfig.from_saved_args(ok).model) == "LlamaForCausalLM"
    with pytest.raises(ConversionError) as e:
        check_hf_compatible(RunConfig.from_saved_args({**ok, **setting}).model)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("setting, expected", [
    ({"normalization": "LayerNorm", "swiglu": False, "position_embedding_type": "learned_absolute",
      "disable_bias_linear": False}, "GPT2LMHeadModel"),
    ({"num_experts": 4, "moe_layer_freq": 1}, "MixtralForCausalLM"),
    ({"layernorm_zero_centered_gamma": True}, "LlamaForCausalLM"),
])
def test_hf_export_picks_the_class_that_computes_the_model(setting, expected):
    """Megatron-LM's GPT-3 settings export as GPT-2, MoE as Mixtral, a zero-centred norm as any of them
    (all three were refused before)."""
    from megatron_lev.arguments import parse_args, resolved_config
    from megatron_lev.config import RunConfig
    from megatron_lev.conversion import check_hf_compatible

    ok = resolved_config(parse_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 4 "
        "--lr 1e-3 --mock-data --vocab-size 100 --normalization RMSNorm --swiglu --disable-bias-linear "
        "--position-embedding-type rope --input-embedding lev".split(), world_size=1))
    assert check_hf_compatible(RunConfig.from_saved_args({**ok, **setting}).model) == expected


# The model-shape flags of Megatron-LM's example scripts (their sizes are scaled down below).
_EXAMPLE_MODEL_FLAGS = {"--normalization", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "--rotary-base",
                        "--rotary-percent", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
                        "--group-query-attention", "--num-query-groups", "--no-position-embedding", "--num-experts",
                        "--moe-router-topk"}


@pytest.mark.parametrize("script, expected", [("examples/gpt3/train_gpt3_175b_distributed.sh", "GPT2LMHeadModel"),
                                              ("examples/llama/train_llama3_8b_h100_fp8.sh", "LlamaForCausalLM"),
                                              ("examples/mixtral/train_mixtral_8x7b_distributed.sh", "MixtralForCausalLM")])
def test_megatron_lm_example_models_have_an_hf_class(script, expected):
    """The models of Megatron-LM's GPT-3, Llama 3 (with --apply-layernorm-1p) and Mixtral scripts export (all
    three were refused before)."""
    from megatron_lev.arguments import parse_args, resolved_config
    from megatron_lev.config import RunConfig
    from megatron_lev.conversion import check_hf_compatible

    argv = json.loads((REPO / "tests" / "training" / "data" / "megatron_lm_examples.json").read_text())["scripts"][script]
    flags = [w for item in argv for w in item.split() if item.split()[0] in _EXAMPLE_MODEL_FLAGS]  # "--flag value"
    assert "--normalization" in flags or "gpt3" in script
    a = resolved_config(parse_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --micro-batch-size 2 --train-iters 4 "
        "--lr 1e-3 --mock-data --vocab-size 100".split() + flags, world_size=1))
    assert check_hf_compatible(RunConfig.from_saved_args(a).model) == expected


def test_bad_inputs_give_one_line_errors(runs, tmp_path):
    from megatron_lev.conversion import ConversionError, export_hf, export_lev, reshard_checkpoint

    root = runs["root"]

    def err(fn, *a, **kw):
        with pytest.raises(ConversionError) as e:
            fn(*a, progress=False, **kw)
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    assert "no such checkpoint directory" in err(reshard_checkpoint, tmp_path / "nope", tmp_path / "o", tp=1)
    # No tracker file: the iter_ directories are listed in the message.
    bare = tmp_path / "bare"
    shutil.copytree(root / "lev_tp1" / "iter_0000002", bare / "iter_0000002")
    msg = err(export_hf, bare, tmp_path / "hf")
    assert "latest_checkpointed_iteration.txt" in msg and "iter_0000002" in msg and "--iteration" in msg
    # A config.yaml that does not describe the checkpoint beside it.
    cfg = bare / "iter_0000002" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("num_layers: 2", "num_layers: 4"))
    assert "num_layers" in err(export_hf, bare / "iter_0000002", tmp_path / "hf")
    assert "num_layers" in err(export_hf, bare, tmp_path / "hf", iteration=2)
    # Impossible target layouts; occupied output; wrong arm for the LEV export.
    assert "--target-tp 3" in err(reshard_checkpoint, root / "lev_tp1", tmp_path / "o3", tp=3)
    assert "already holds a checkpoint" in err(reshard_checkpoint, root / "lev_src", root / "lev_tp1", tp=1)
    assert "not lev" in err(export_lev, root / "tied_tp1", tmp_path / "lev")
    # The CLI prints the same single line and exits 2.
    r = run_cli(CONVERT, ["export-hf", "--load", tmp_path / "nope", "--save", tmp_path / "hf"], env=_env(),
                timeout=300)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no such checkpoint directory" in lines[0]
