"""The Hugging Face scorer: equal to the model's own forward; lm-evaluation-harness's HF model loads
the same directory and gives the same log-likelihoods; the CLI on a HF directory, with a malformed
task file giving one clear error."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megatron_lev.tokenizer import build_tokenizer


def test_hf_scorer_matches_forward(hf_tiny_dir, gpt2_files):
    from transformers import AutoModelForCausalLM

    from megatron_lev.evaluation.hf_scorer import HFScorer

    scorer = HFScorer(hf_tiny_dir, batch_size=3, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(hf_tiny_dir).eval()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, gpt2_files["vocab_size"], n).tolist() for n in (5, 30, 2, 17)]
    got = scorer.score(seqs)
    for s, g in zip(seqs, got):
        with torch.no_grad():
            logits = model(torch.tensor([s[:-1]])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[torch.arange(len(s) - 1), torch.tensor(s[1:])]
        np.testing.assert_allclose(g.logprobs, lp.numpy(), rtol=1e-4, atol=1e-5)
        assert list(g.greedy) == (logits.argmax(-1) == torch.tensor(s[1:])).tolist()
    tok = scorer.tokenizer()
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files["vocab"], merge_file=gpt2_files["merges"])
    text = "Shall I compare thee to a summer's day?"
    assert tok.tokenize(text) == ours.tokenize(text) and tok.eod == ours.eod == gpt2_files["eod"]
    assert tok.detokenize(tok.tokenize(text)) == text


def test_hf_scorer_tokenizer_is_real_gpt2(real_tok_args, tmp_path):
    from megatron_lev.evaluation.hf_scorer import HFScorer

    from .conftest import make_hf_tiny

    g = real_tok_args["gpt2"]
    tok = HFScorer(make_hf_tiny(tmp_path, g["vocab_file"], g["merge_file"], 50257), device="cpu").tokenizer()
    assert tok.tokenize("Hello world") == [15496, 995] and tok.eod == 50256


def test_lm_eval_hf_model_loads_the_directory_and_agrees(hf_tiny_dir):
    # lm_eval[hf] and accelerate are dev dependencies: a missing one is a failure, not a skip.
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatron_lev.evaluation.hf_scorer import HFScorer
    from megatron_lev.evaluation.tasks import loglikelihood

    lm = HFLM(pretrained=hf_tiny_dir, device="cpu", batch_size=2)
    reqs = [("Question: What is the capital of France?\nAnswer:", " Paris"),
            ("The cat sat on the ", "mat."), ("", "Hello world")]
    theirs = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i)
                               for i, r in enumerate(reqs)], disable_tqdm=True)
    scorer = HFScorer(hf_tiny_dir, device="cpu")
    ours = loglikelihood(scorer, scorer.tokenizer(), reqs)
    for (a, ga), (b, gb) in zip(theirs, ours):
        assert a == pytest.approx(b, abs=1e-4)
        assert bool(ga) == gb


def test_cli_on_hf_directory_and_malformed_task_file(hf_tiny_dir, tmp_path, sample_corpus, task_files, capsys):
    from megatron_lev.evaluation.cli import main

    out = tmp_path / "out"
    rc = main(["--hf-model", hf_tiny_dir, "--valid-data", sample_corpus.valid,
               "--max-documents", "2", "--max-tokens", "300", "--seq-length", "64", "--stride", "32",
               "--tasks", "lambada,piqa", "--downstream-dir", task_files.dir, "--limit", "3",
               "--output-dir", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    v = res["perplexity"]["valid"]
    assert v["ppl"] == pytest.approx(math.exp(v["nll"])) and v["stride"] == 32 and v["seq_length"] == 64
    assert res["tasks"]["piqa"]["examples"] == 3 and res["meta"]["hf_model"].endswith(hf_tiny_dir.split("/")[-1])
    assert (out / "results.md").is_file() and (out / "tasks.png").is_file()

    _, bad, msg = task_files.malformed["piqa_missing_field"]
    capsys.readouterr()
    rc = main(["--hf-model", hf_tiny_dir, "--task-file", f"piqa={bad}", "--output-dir", str(tmp_path / "o2"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == f"error: {bad}:2: {msg}"
    rc = main(["--hf-model", hf_tiny_dir, "--tasks", "nope", "--output-dir", str(tmp_path / "o3")])
    assert rc == 2 and "unknown task 'nope'" in capsys.readouterr().err
