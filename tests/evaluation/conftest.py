"""Fixtures of the evaluation tests: a tiny trained LEV checkpoint (the test BPE in GPT-2 format,
2 layers, hidden 64, Llama-style so that it can also be exported to HF), a byte-level toy tokenizer,
a tiny random HF model.

The checkpoint is built once per session: on the sample corpus's valid.jsonl.zst preprocessed with
token counts (the session's ``valid_corpus``), pretrain_lev.py runs a few iterations (one CPU
process).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_lev.testing.cli import run_cli, run_torchrun
from tests.conftest import built_once

REPO = Path(__file__).resolve().parents[2]


def clean_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _checked(r):
    if r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\nSTDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.stderr[-6000:]}")
    return r


def torchrun(nproc, script, args, timeout=300):
    """``torchrun --nproc-per-node nproc script *args``, its ranks forked (``run_torchrun``)."""
    return _checked(run_torchrun(script, args, nproc=nproc, env=clean_env(), timeout=timeout, cwd=str(REPO)))


def run_script(script, args, timeout=300):
    """``script`` as one plain process (a single rank needs no launcher)."""
    return _checked(run_cli(script, args, env=clean_env(), timeout=timeout, cwd=str(REPO)))


class ByteTokenizer:
    """Toy tokenizer: one id per UTF-8 byte, EOD = 0 (vocabulary 256)."""

    eod = 0
    vocab_size = 256

    def tokenize(self, text):
        return list(text.encode("utf-8"))

    def detokenize(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@pytest.fixture()
def byte_tokenizer():
    return ByteTokenizer()


@pytest.fixture(scope="session")
def gpt2_files(tokenizer_files):
    """The test BPE as GPT-2 vocab.json + merges.txt (EOD = last id)."""
    return {"vocab": tokenizer_files.vocab_file, "merges": tokenizer_files.merge_file,
            "vocab_size": tokenizer_files.bpe_vocab_size, "eod": tokenizer_files.bpe_vocab_size - 1}


@pytest.fixture(scope="session")
def tiny_ckpt(sample_corpus, valid_corpus, gpt2_files, tmp_path_factory):
    """{'dir': checkpoint root, 'prefix': indexed valid data, 'counts': token counts .npy, ...}."""
    return built_once(tmp_path_factory, "eval_ckpt", lambda out: _train_tiny(out, sample_corpus, valid_corpus, gpt2_files))


def _train_tiny(out, sample_corpus, valid_corpus, gpt2_files):
    prefix = valid_corpus.prefix
    ckpt = out / "ckpt"
    run_script(REPO / "pretrain_lev.py", [
        "--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 64,
        "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 6, "--lr", "3e-3",
        "--lr-warmup-iters", 1, "--input-embedding", "lev", "--lev-heads", 2, "--lev-seed-dim", 16,
        "--lev-rank", 8, "--lev-knots", 8, "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--data-path", prefix, "--split", "90,10,0",
        "--data-cache-path", out / "cache", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files["vocab"],
        "--merge-file", gpt2_files["merges"], "--log-interval", 100, "--eval-iters", 0, "--quiet-config",
        "--save", ckpt, "--no-save-optim", "--no-save-rng"])
    return {"dir": str(ckpt), "prefix": prefix, "counts": valid_corpus.counts, "root": out,
            "zeroshot": sample_corpus.train, "eod": gpt2_files["eod"]}


def make_hf_tiny(out, vocab, merges, vocab_size):
    """A randomly initialised 1-layer GPT-2 (HF) with a GPT-2 format BPE tokenizer, saved in ``out``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=128, vocab_size=vocab_size,
                                       bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1))
    model.save_pretrained(out)
    try:  # transformers >= 5
        tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    except TypeError:
        tok = GPT2TokenizerFast(vocab_file=vocab, merges_file=merges)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def hf_tiny_dir(gpt2_files, tmp_path_factory):
    """A randomly initialised 1-layer GPT-2 (HF) with the test BPE tokenizer."""
    return make_hf_tiny(tmp_path_factory.mktemp("hf_tiny"), gpt2_files["vocab"], gpt2_files["merges"],
                        gpt2_files["vocab_size"])
