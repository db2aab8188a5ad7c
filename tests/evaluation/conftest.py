"""Fixtures of the evaluation tests: a tiny trained LEV checkpoint (GPT-2 BPE, 2 layers, hidden 64,
Llama-style so that it can also be exported to HF), a byte-level toy tokenizer, a tiny random HF model.

The checkpoint is built once per session: ../shared/data/corpus/valid.jsonl.zst is preprocessed
with token counts, then pretrain_lev.py runs a few iterations under torchrun (one CPU rank).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def torchrun(nproc, script, args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(script)] + [str(a) for a in args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=timeout, cwd=str(REPO))
    if r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\nSTDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.stderr[-6000:]}")
    return r


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
def gpt2_files(shared_data):
    tok = shared_data / "tokenizers" / "gpt2"
    return {"vocab": str(tok / "vocab.json"), "merges": str(tok / "merges.txt")}


@pytest.fixture(scope="session")
def tiny_ckpt(shared_data, gpt2_files, tmp_path_factory):
    """{'dir': checkpoint root, 'prefix': indexed valid data, 'counts': token counts .npy, ...}."""
    from megatron_lev.data.preprocessing import PreprocessConfig, preprocess

    out = tmp_path_factory.mktemp("eval_ckpt")
    preprocess(PreprocessConfig(
        inputs=[str(shared_data / "corpus" / "valid.jsonl.zst")], output_prefix=str(out / "valid"),
        tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2_files["vocab"], merge_file=gpt2_files["merges"],
        append_eod=True, workers=1, progress=False, output_token_counts=True))
    prefix = str(out / "valid_text_document")
    ckpt = out / "ckpt"
    torchrun(1, REPO / "pretrain_lev.py", [
        "--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 64,
        "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 6, "--lr", "3e-3",
        "--lr-warmup-iters", 1, "--input-embedding", "lev", "--lev-heads", 2, "--lev-seed-dim", 16,
        "--lev-rank", 8, "--lev-knots", 8, "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--data-path", prefix, "--split", "90,10,0",
        "--data-cache-path", out / "cache", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files["vocab"],
        "--merge-file", gpt2_files["merges"], "--log-interval", 100, "--eval-iters", 0, "--quiet-config",
        "--save", ckpt, "--no-save-optim", "--no-save-rng"])
    return {"dir": str(ckpt), "prefix": prefix, "counts": str(out / "valid_text_token_counts.npy"), "root": out}


@pytest.fixture(scope="session")
def hf_tiny_dir(gpt2_files, tmp_path_factory):
    """A randomly initialised 1-layer GPT-2 (HF) with the GPT-2 BPE tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    out = tmp_path_factory.mktemp("hf_tiny")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=128, vocab_size=50257))
    model.save_pretrained(out)
    try:  # transformers >= 5
        tok = GPT2TokenizerFast(vocab=gpt2_files["vocab"], merges=gpt2_files["merges"])
    except TypeError:
        tok = GPT2TokenizerFast(vocab_file=gpt2_files["vocab"], merges_file=gpt2_files["merges"])
    assert tok.encode("Hello world") == [15496, 995]
    tok.save_pretrained(out)
    return str(out)
