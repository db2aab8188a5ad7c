"""Hugging Face import and dense -> LEV conversion on CPU ranks, with models made here (no downloads).

Two tiny ``LlamaForCausalLM`` models are built with transformers from a ``LlamaConfig`` (vocabulary 500,
so megatron pads it to 512; GQA with 2 key/value heads): a tied one in one safetensors file whose table
is a perturbed LEV function (so that a LEV layer can fit it), and an untied one in safetensors shards.
They are imported at TP=2 (tied) and TP=2 x PP=2 (untied); checks: logits equal transformers' at both
layouts (fp32, 1e-5); HF -> import -> export gives the original tensors and export -> import -> export
the same tensors; to-lev fits the tied table to a small error and its checkpoint trains
(pretrain_lev.py) and evaluates (tools/evaluate.py) at TP=2; bad inputs give one-line errors.
Launches are shared by session fixtures and independent ones run side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lev.testing.cli import run_cli, run_torchrun

# Its tests share multi-process jobs (~71 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "pretrain_lev.py")
CONVERT = str(REPO / "tools" / "convert_checkpoint.py")
EVALUATE = str(REPO / "tools" / "evaluate.py")
V, D = 500, 64
LEV = dict(seed_dim=16, rank=8, num_heads=2, num_knots=8)


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def lev_table(vocab: int = V, hidden: int = D) -> torch.Tensor:
    """A table that a LEV layer can represent: the LEV initialisation of seed 0 with W and c perturbed."""
    from megatron_lev.lev import LEVConfig, LEVEmbedding

    emb = LEVEmbedding(vocab, hidden, LEVConfig(**LEV), init_seed=0, init_method_std=0.05)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        emb.heads.out_weight.mul_(1 + 0.3 * torch.randn(emb.heads.out_weight.shape, generator=g))
        emb.offset.add_(0.02)
        return emb.materialize()


def _hf_model(out: Path, tied: bool, shard: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1 if tied else 2)
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, rms_norm_eps=1e-5,
                      rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.05 if p.dim() > 1 else 1 + 0.2 * torch.randn_like(p))
        if tied:
            model.model.embed_tokens.weight.copy_(lev_table())
    model.save_pretrained(str(out), max_shard_size=shard)
    return model


def _hf_state(path: Path):
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Both HF models, their logits on random ids, and their imports (run side by side)."""
    from megatron_lev.conversion import import_hf

    root = tmp_path_factory.mktemp("import")
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = {}
    for name, tied, shard in (("tied", True, "5GB"), ("untied", False, "40KB")):
        model = _hf_model(root / f"hf_{name}", tied, shard)
        with torch.no_grad():
            ref[name] = model(ids).logits
    assert (root / "hf_untied" / "model.safetensors.index.json").is_file()
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(import_hf, root / "hf_tied", root / "tied", tp=2, pp=1, progress=False),
                ex.submit(import_hf, root / "hf_untied", root / "untied", tp=2, pp=2, progress=False)]
        for f in futs:
            f.result()
    return {"root": root, "ids": ids, "ref": ref}


@pytest.fixture(scope="session")
def derived(models):
    """Logits of both imports at TP=2 x PP=2 and TP=1 (one launch), the untied export, and to-lev of the
    tied import (side by side)."""
    from megatron_lev.conversion import export_hf, to_lev
    from megatron_lev.conversion.dense_to_lev import FitConfig
    from megatron_lev.testing import run_distributed

    from . import _ranks

    root = models["root"]
    paths = [str(root / "tied"), str(root / "untied")]
    counts = np.bincount(np.random.default_rng(0).zipf(1.3, 20000) % V, minlength=V)
    np.save(root / "counts.npy", counts)

    def logits():
        res = run_distributed(_ranks.logits_at_layouts, 4, tp=2, pp=2,
                              args=([(2, 2, paths), (1, 1, paths)], models["ids"].tolist(), True))
        return {k: v for r in res for k, v in r.items()}

    def lev():
        fit = FitConfig(lr=3e-3, batch_size=512, max_steps=150, eval_interval=25, progress=False)
        return to_lev(root / "tied", root / "lev", lev=dict(LEV), token_counts=str(root / "counts.npy"), fit=fit,
                      report_file=str(root / "fit.json"), progress=False)

    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(logits), ex.submit(export_hf, root / "untied", root / "export1", trim_vocab=True,
                                             progress=False), ex.submit(lev)]
        out = [f.result() for f in futs]
    return {"logits": out[0], "fit": out[2]}


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_imported_logits_equal_transformers(models, derived, name):
    ref = models["ref"][name]
    path = str(models["root"] / name)
    for layout in ((1, 1), (2, 2)):
        got = derived["logits"][(*layout, path)]
        assert got.shape == (2, 16, 512)
        torch.testing.assert_close(got[..., :V], ref, atol=1e-5, rtol=0)
        assert torch.all(got[..., V:] == 0)  # padded rows of the head are zero


def test_imported_checkpoint_layout_and_config(models):
    import yaml

    from megatron_lev.conversion import open_checkpoint

    c = open_checkpoint(models["root"] / "untied")
    assert c.layout == {"tp": 2, "pp": 2, "world_size": 4} and c.iteration == 0
    cfg = yaml.safe_load((models["root"] / "untied" / "iter_0000000" / "config.yaml").read_text())
    assert cfg["input_embedding"] == "untied" and cfg["num_query_groups"] == 2 and cfg["kv_channels"] == 16
    assert cfg["padded_vocab_size"] == 512 and cfg["tokenizer_type"] == "NullTokenizer" and cfg["lr"] is None
    assert not (models["root"] / "untied" / ".import-tp1").exists()
    tied = yaml.safe_load((models["root"] / "tied" / "iter_0000000" / "config.yaml").read_text())
    assert tied["input_embedding"] == "tied" and tied["tensor_model_parallel_size"] == 2


def test_round_trip_hf_import_export_is_exact(models, derived, tmp_path):
    from megatron_lev.conversion import export_hf, import_hf

    root = models["root"]
    orig, first = _hf_state(root / "hf_untied"), _hf_state(root / "export1")
    assert set(orig) == set(first)
    for k in orig:
        assert torch.equal(orig[k], first[k]), k
    import_hf(root / "export1", tmp_path / "again", tp=1, pp=1, progress=False)
    export_hf(tmp_path / "again", tmp_path / "export2", trim_vocab=True, progress=False)
    second = _hf_state(tmp_path / "export2")
    assert set(second) == set(first) and all(torch.equal(first[k], second[k]) for k in first)


def test_to_lev_fits_and_reports(models, derived):
    rep = derived["fit"]
    # The objective is frequency-weighted (counts given): small there, and far below the start everywhere.
    assert rep.weighted_relative_error < 0.1 and rep.relative_error < rep.initial_relative_error / 5
    assert rep.lev_params < rep.table_params == 512 * D
    assert [b["bucket"] for b in rep.buckets][0] == "< 1e-7" and len(rep.buckets) == 5
    assert sum(b["vocab_ids"] for b in rep.buckets) == 512
    saved = json.loads((models["root"] / "fit.json").read_text())
    assert saved["relative_error"] == pytest.approx(rep.relative_error)


def test_lev_checkpoint_trains_and_evaluates_at_tp2(models, derived, tmp_path):
    """The lev checkpoint: the arm is lev, the head is the tied source's table; pretrain_lev.py continues
    it at TP=2 and tools/evaluate.py scores it at TP=2 (launched side by side)."""
    import yaml

    root = models["root"]
    cfg_path = root / "lev" / "iter_0000000" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    assert cfg["input_embedding"] == "lev" and cfg["lev_heads"] == 2 and cfg["lev_seed_dim"] == 16
    assert cfg["untie_embeddings_and_output_weights"] is True
    rng = np.random.default_rng(1)
    (tmp_path / "valid.jsonl").write_text("".join(
        json.dumps({"text": " ".join(map(str, rng.integers(0, V - 1, 40)))}) + "\n" for _ in range(4)))
    # Training and evaluation side by side, each a 2-rank job as torchrun runs it (the launcher is not the subject).
    train_args = ["--config", cfg_path, "--load", root / "lev", "--save", tmp_path / "cont", "--mock-data", "--lr",
                  "1e-3", "--train-iters", "2", "--micro-batch-size", "2", "--seq-length", "32", "--eval-iters", "0",
                  "--log-interval", "1", "--metrics-file", tmp_path / "m.jsonl"]
    eval_args = ["--load", root / "lev", "--tensor-model-parallel-size", "2", "--valid-data",
                 f"toy={tmp_path / 'valid.jsonl'}", "--seq-length", "32", "--output-dir", tmp_path / "eval", "--no-progress"]
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_torchrun, script, args, nproc=2, env=_env(), cwd=str(REPO), timeout=900)
                for script, args in ((PRETRAIN, train_args), (EVALUATE, eval_args))]
        train, ev = (j.result() for j in jobs)
    assert train.returncode == 0, train.stderr[-4000:]
    assert ev.returncode == 0, ev.stderr[-4000:]
    assert "successfully loaded checkpoint" in train.stdout and "at iteration 0" in train.stdout
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    losses = [x["lm loss"] for x in rows if x["kind"] == "train"]
    assert len(losses) == 2 and all(np.isfinite(losses))
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    text = json.dumps(res)
    assert "toy" in text and "ppl" in text


# ---------------------------------------------------------------------------------------------- refusals


def _one_line(fn, *a, **kw):
    from megatron_lev.conversion import ConversionError

    with pytest.raises(ConversionError) as e:
        fn(*a, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_import_refusals_are_one_line(models, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_lev.conversion import read_hf_model

    src = models["root"] / "hf_tied"

    def variant(name, edit_cfg=None, edit_tensors=None):
        d = tmp_path / name
        shutil.copytree(src, d)
        if edit_cfg:
            cfg = json.loads((d / "config.json").read_text())
            edit_cfg(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        if edit_tensors:
            t = load_file(str(d / "model.safetensors"))
            edit_tensors(t)
            save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    assert "no config.json" in _one_line(read_hf_model, tmp_path)
    msg = _one_line(read_hf_model, variant("mistral", lambda c: c.update(model_type="mistral",
                                                                         architectures=["MistralForCausalLM"])))
    assert "MistralForCausalLM" in msg and "only LlamaForCausalLM" in msg
    assert "attention_bias" in _one_line(read_hf_model, variant("bias", lambda c: c.update(attention_bias=True)))
    msg = _one_line(read_hf_model, variant("missing", None, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))
    assert "model.layers.1.mlp.up_proj.weight is missing" in msg
    msg = _one_line(read_hf_model, variant("shape", lambda c: c.update(intermediate_size=128)))
    assert "shape mismatch" in msg and "[128, 64]" in msg
    msg = _one_line(read_hf_model, variant("extra", None, lambda t: t.update(
        {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})))
    assert "q_norm" in msg and "no megatron equivalent" in msg
    # A derived rotary buffer is accounted for, not refused.
    m = read_hf_model(variant("inv_freq", None, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})))
    assert m.ignored == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    # The CLI prints one line and exits 2.
    r = run_cli(CONVERT, ["import-hf", "--hf-model", tmp_path / "shape", "--save", tmp_path / "out"], env=_env(),
                timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "shape mismatch" in lines[0]


def test_to_lev_refusals_are_one_line(models, tmp_path):
    from megatron_lev.conversion import fit_lev, to_lev
    from megatron_lev.lev import LEVConfig

    root = models["root"]
    msg = _one_line(to_lev, root / "tied", tmp_path / "x", lev={"base": 7, "num_digits": 3}, progress=False)
    assert "--lev-base 7" in msg and "covers only 343 ids" in msg
    np.save(tmp_path / "long.npy", np.ones(600))
    assert "600 entries" in _one_line(to_lev, root / "tied", tmp_path / "x", token_counts=str(tmp_path / "long.npy"),
                                      progress=False)
    assert "not divisible by the tensor-parallel size 2" in _one_line(to_lev, root / "tied", tmp_path / "x",
                                                                      lev={"num_heads": 3}, progress=False)
    assert "already holds a checkpoint" in _one_line(to_lev, root / "tied", root / "untied", progress=False)
    assert "shape [8]" in _one_line(fit_lev, torch.zeros(8), LEVConfig(**LEV))


def test_fit_weights_follow_counts():
    from megatron_lev.conversion.dense_to_lev import fit_weights

    assert fit_weights(None, 4, 1.0) is None
    w = fit_weights(np.array([3, 0, 1]), 4, 1.0)
    assert w.tolist() == [4.0, 1.0, 2.0, 1.0]  # padded ids count as unseen
    assert fit_weights(np.array([3, 0, 1]), 4, 0.0).tolist() == [1.0] * 4


def test_to_lev_cli_has_a_flag_for_every_lev_setting():
    # The --lev-* flags of to-lev are generated from LEVConfig: a new field gets its flag, and every flag
    # defaults to "keep the checkpoint's value" (None), so the conversion changes only what is given.
    import dataclasses

    from megatron_lev.lev.config import LEVConfig, lev_arg

    sys.path.insert(0, str(REPO / "tools"))
    try:
        import convert_checkpoint
    finally:
        sys.path.remove(str(REPO / "tools"))
    a = convert_checkpoint.build_parser().parse_args(["to-lev", "--load", "src", "--save", "dst",
                                                      "--lev-basis", "sparse", "--lev-heads", "4"])
    names = [f.name for f in dataclasses.fields(LEVConfig)]
    got = {n: getattr(a, lev_arg(n)) for n in names}
    assert got == {n: {"basis": "sparse", "num_heads": 4}.get(n) for n in names}


def test_save_target_refusals_name_save_and_the_fix(tmp_path):
    # One place decides where a conversion may write (reshard, import-hf and to-lev all call it).
    from megatron_lev.checkpoint import TRACKER
    from megatron_lev.conversion.source import ConversionError, save_target

    src = tmp_path / "src"
    src.mkdir()
    assert save_target(str(tmp_path / "new"), str(src)) == str(tmp_path / "new")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / TRACKER).write_text("3")
    for target, words in ((src, "source checkpoint's directory"), (tmp_path / "file", "not a directory"),
                          (tmp_path / "full", "already holds a checkpoint")):
        with pytest.raises(ConversionError, match=words) as e:
            save_target(str(target), str(src))
        assert str(e.value).startswith("--save ") and "\n" not in str(e.value)


def test_unwritable_save_is_refused_before_any_work(tmp_path, capsys):
    from megatron_lev.conversion.source import ConversionError, save_target
    from tools.convert_checkpoint import main as convert_main

    (tmp_path / "file").write_text("x")
    missing = tmp_path / "no-checkpoint"  # would fail at once if it were opened first
    for target, where in (("/proc/self/out", "/proc/self"), (str(tmp_path / "file" / "out"), str(tmp_path / "file"))):
        with pytest.raises(ConversionError, match=f"^--save {target}: cannot write in {where} "):
            save_target(target)
        for command in ("export-hf", "export-lev"):
            assert convert_main([command, "--load", str(missing), "--save", target]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"error: --save {target}: cannot write in {where} ("), err
            assert "choose a writable directory" in err[0]


def test_disk_full_during_an_export_is_one_line(tmp_path):
    import errno

    from megatron_lev.conversion.launch import ConversionRankFailure
    from megatron_lev.conversion.source import ConversionError, disk_full_is_one_line

    out = str(tmp_path)
    rank_trace = "rank 0 failed:\nTraceback (most recent call last):\n  ...\nOSError: [Errno 28] No space left on device"
    for error in (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), ConversionRankFailure(rank_trace)):
        with pytest.raises(ConversionError) as e:
            with disk_full_is_one_line(out, "the Hugging Face export"):
                raise error
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"--save {out}: no space left on device while writing the Hugging "
                                                  "Face export ("), msg
        assert msg.endswith("GiB free there); nothing was left in it; make room and run again"), msg
    with pytest.raises(PermissionError):  # other failures are not disguised
        with disk_full_is_one_line(out, "x"):
            raise PermissionError(errno.EACCES, "denied")
