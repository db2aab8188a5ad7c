"""The GPU check's science run: tied and LEV for one pass over a corpus at ~125M parameters in bf16.

Run by ``bench/gpu_check.py`` (check ``science``) when its estimate fits the time left; alone:

    python bench/gpu_science.py --out OUT --work WORK [--shared-data DIR] [--corpus FILE] [--budget-s 560]

Steps, each a subprocess bounded by the time left: ``tools/preprocess_data.py`` of the corpus (with
``--output-token-counts``, the frequency buckets' source) and of the valid set, GPT-2 BPE, on all
CPUs; ``pretrain_lev.py`` of each arm for one pass over the preprocessed tokens (the same flags but
``--input-embedding``, so the data order, tokens, schedule and transformer are identical; the
micro-reproduction's Llama-style transformer, ``bench/reproduce.py``'s ``TRANSFORMER``); then
``tools/evaluate.py``: validation PPL with frequency buckets, zero-shot PPL on ``zeroshot_wiki``,
LAMBADA and the multiple-choice tasks (first ``TASK_LIMIT`` examples). ``OUT/science.md`` is the
report, rewritten after every step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

ARMS = ("tied", "lev")
# ~125M parameters with the GPT-2 vocabulary (padded to 50,304): 12 x 768, 12 heads, sequence 1024.
MODEL = dict(layers=12, hidden=768, heads=12, seq=1024, micro_batch=32, global_batch=64, vocab=50304)
LR, MIN_LR, WARMUP_FRAC = "6e-4", "6e-5", 0.02
TASK_LIMIT = 500  # examples per downstream task
MAX_EVAL_TOKENS = 262144  # per perplexity set
# Planning figures that no earlier check measures (the estimate says so).
TOKENS_PER_COMPRESSED_BYTE = 1.06  # GPT-2 tokens per byte of the shared corpus's zstd file (21.6 M / 20.5 MB)
PREPROCESS_S, CHECKPOINT_S, EVAL_S, STARTUP_S = 60.0, 15.0, 60.0, 30.0
MARGIN = 1.15


def _flops_per_token(shape: Dict[str, int]) -> float:
    """Training FLOPs per token of a tied model of ``shape`` (the library's forward count, x3)."""
    from megatron_lev.training.flops import transformer_forward_flops_per_token

    cfg = SimpleNamespace(hidden_size=shape["hidden"], num_layers=shape["layers"], num_attention_heads=shape["heads"],
                          kv_channels=None, num_query_groups=None, ffn_hidden_size=4 * shape["hidden"],
                          gated_linear_unit=True)
    return 3.0 * transformer_forward_flops_per_token(cfg, MODEL["vocab"], shape["seq"])


def corpus_tokens(corpus: str) -> int:
    return int(os.path.getsize(corpus) * TOKENS_PER_COMPRESSED_BYTE)


def estimate_seconds(tied: Dict[str, Any], lev: Dict[str, Any], throughput: Dict[str, Any],
                     tflops: Optional[float], corpus: str) -> Tuple[float, str]:
    """(seconds, how it was estimated) of the whole science run, from the achieved TFLOP/s this run
    measured: the 400M throughput check's tied arm when it ran (the closest shape), else the tied
    training check's, else ``tflops`` (--science-tflops). Raises gpu_check.Skip when none exists."""
    from gpu_check import Skip

    if not os.path.exists(corpus):
        raise Skip(f"no corpus at {corpus} (carry it and pass --shared-data or --corpus)")
    tokens = corpus_tokens(corpus)
    lev_over_tied = (lev["median_ms"] / tied["median_ms"]) if lev.get("median_ms") and tied.get("median_ms") else None
    achieved, source = None, None
    tput = _tied_400m(throughput)
    if tput:
        from throughput import CONFIGS

        achieved = tput["tokens_per_s"] * _flops_per_token(CONFIGS["gpu-400m"]) / 1e12
        source = f"the throughput check's tied 400M step ({achieved:.0f} TFLOP/s)"
        ratio = tput.get("lev_over_tied")
        lev_over_tied = ratio or lev_over_tied
    elif tied.get("median_tflops"):
        achieved = tied["median_tflops"]
        source = f"the train_tied check's {achieved:.0f} TFLOP/s (a smaller model: a conservative estimate)"
    elif tflops:
        achieved, source = tflops, f"--science-tflops {tflops:g}"
    if not achieved:
        raise Skip("no measured throughput to plan with: run train_tied or throughput first, or give --science-tflops")
    lev_over_tied = lev_over_tied or 1.5
    train_tied = tokens * _flops_per_token(MODEL) / (achieved * 1e12)
    startup = tied.get("startup_s") or STARTUP_S
    per_arm = [train_tied, train_tied * lev_over_tied]
    total = MARGIN * (PREPROCESS_S + sum(t + startup + CHECKPOINT_S + EVAL_S for t in per_arm))
    return total, (f"~{tokens / 1e6:.1f} M tokens per arm at {source}, LEV/TIED {lev_over_tied:.2f}; assumed "
                   f"{PREPROCESS_S:.0f} s preprocessing, {EVAL_S:.0f} s evaluation per arm, x{MARGIN} margin")


def _tied_400m(throughput: Dict[str, Any]) -> Optional[Dict[str, float]]:
    """tokens/s of the tied arm and LEV/TIED of the throughput check's figures, if it ran."""
    for title, ratio in (throughput.get("ratios") or {}).items():
        tied = (throughput.get("arms") or {}).get(f"{title}: tied") or {}
        if tied.get("ms_per_iter") and throughput.get("tokens_per_step"):
            return {"tokens_per_s": throughput["tokens_per_step"] / (tied["ms_per_iter"] / 1e3),
                    "lev_over_tied": ratio.get("lev_over_tied")}
    return None


# ------------------------------------------------------------------------------------------ the run


def _tokenizer(shared: Path) -> List[str]:
    tok = shared / "tokenizers" / "gpt2"
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
            "--merge-file", str(tok / "merges.txt")]


def train_argv(arm: str, iters: int, data: Dict[str, Path], shared: Path, run_dir: Path) -> List[str]:
    from reproduce import TRANSFORMER

    m = MODEL
    return ["pretrain_lev.py", "--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
            "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
            "--max-position-embeddings", str(m["seq"]), "--micro-batch-size", str(m["micro_batch"]),
            "--global-batch-size", str(m["global_batch"]), *TRANSFORMER, "--bf16",
            "--train-iters", str(iters), "--lr", LR, "--min-lr", MIN_LR,
            "--lr-warmup-iters", str(max(1, round(WARMUP_FRAC * iters))), "--seed", "1234",
            "--train-data-path", str(data["train"]), "--valid-data-path", str(data["valid"]),
            "--data-cache-path", str(run_dir.parent / "cache"), *_tokenizer(shared),
            "--log-interval", "10", "--eval-iters", "0", "--save-interval", str(iters), "--no-save-optim",
            "--quiet-config", "--input-embedding", arm, "--save", str(run_dir / "ckpt"),
            "--metrics-file", str(run_dir / "metrics.jsonl")]


def eval_argv(arm: str, data: Dict[str, Path], shared: Path, run_dir: Path) -> List[str]:
    return ["tools/evaluate.py", "--load", str(run_dir / "ckpt"), "--valid-data", f"valid={data['valid']}",
            "--token-counts", str(data["counts"]), "--zeroshot-data",
            f"zeroshot={shared / 'corpus' / 'zeroshot_wiki.jsonl.zst'}", "--max-tokens", str(MAX_EVAL_TOKENS),
            "--tasks", "all", "--downstream-dir", str(shared / "downstream"), "--limit", str(TASK_LIMIT),
            "--micro-batch-size", "16", "--output-dir", str(run_dir / "eval"), "--label", arm, "--no-progress"]


def _dataset_tokens(prefix: Path) -> int:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))  # held while summing: its lengths are a view of its mmap
    return int(dataset.sequence_lengths.sum())


def run(corpus: str, shared_data: str, work: Path, out: Path, deadline: float, env: Dict[str, str],
        partial: Callable[[Dict[str, Any]], None] = lambda f: None) -> Dict[str, Any]:
    """Every step within ``deadline`` (time.monotonic); figures per step; OUT/science.md after each."""
    from gpu_check import CheckFailed, run_logged

    shared, work, out = Path(shared_data), Path(work), Path(out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    d = work / "data"
    data = {"train": d / "gpt2_train_text_document", "valid": d / "gpt2_valid_text_document",
            "counts": d / "gpt2_train_text_token_counts.npy"}
    figures: Dict[str, Any] = {"corpus": corpus, "model": MODEL, "steps": {}}

    def step(name: str, argv: List[str]) -> None:
        left = deadline - time.monotonic()
        t0 = time.monotonic()
        rc, output = run_logged([sys.executable, *argv], left, work / f"{name}.log", env)
        figures["steps"][name] = {"exit": rc, "seconds": round(time.monotonic() - t0, 1)}
        partial(figures)
        write_report(out / "science.md", figures, work)
        if rc != 0:
            why = f"timeout: killed after {left:.0f} s" if rc == 124 else f"exit {rc}"
            raise CheckFailed(f"science step {name}: {why}: {output[-600:]}", figures)

    workers = str(max(1, (os.cpu_count() or 1)))
    for split, src, extra in (("train", corpus, ["--output-token-counts"]),
                              ("valid", str(shared / "corpus" / "valid.jsonl.zst"), [])):
        step(f"preprocess_{split}", ["tools/preprocess_data.py", "--input", src, "--output-prefix",
                                     str(d / f"gpt2_{split}"), *_tokenizer(shared), "--append-eod", "--workers",
                                     workers, "--overwrite", "--no-progress-bar", *extra])
    tokens = _dataset_tokens(data["train"])
    iters = tokens // (MODEL["global_batch"] * MODEL["seq"])
    figures.update(train_tokens=tokens, iterations=iters, tokens_trained=iters * MODEL["global_batch"] * MODEL["seq"])
    for arm in ARMS:
        step(f"train_{arm}", train_argv(arm, iters, data, shared, work / arm))
    for arm in ARMS:
        step(f"eval_{arm}", eval_argv(arm, data, shared, work / arm))
    figures["summary"] = summarize(work)
    write_report(out / "science.md", figures, work)
    return figures


def summarize(work: Path) -> Dict[str, Any]:
    from reproduce import read_metrics, read_train_log, summary_metrics

    out = {}
    for arm in ARMS:
        res = work / arm / "eval" / "results.json"
        row = {"metrics": read_metrics(work / arm / "metrics.jsonl"),
               "eval": json.loads(res.read_text()) if res.exists() else None}
        out[arm] = dict(summary_metrics(row), **read_train_log(work / f"train_{arm}.log"))
    return out


def write_report(path: Path, figures: Dict[str, Any], work: Path) -> None:
    from gpu_check import _write_text

    m = MODEL
    L = ["# Science run on one GPU: tied vs LEV, one pass, ~125M parameters, bf16", "",
         "Generated by `bench/gpu_science.py` (the `science` check of `bench/gpu_check.py`); no number is edited.", "",
         f"- corpus: `{figures['corpus']}`; GPT-2 BPE; "
         + (f"{figures['train_tokens']:,} tokens, {figures['iterations']} iterations of {m['global_batch']} x {m['seq']} "
            f"= {figures['tokens_trained']:,} tokens trained per arm (one pass)" if "train_tokens" in figures else
            "not preprocessed yet"),
         f"- transformer: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, sequence {m['seq']}, "
         f"micro-batch {m['micro_batch']}, Llama-style (RoPE, RMSNorm, SwiGLU, no biases); lr {LR} cosine to {MIN_LR}; "
         "both arms share every flag but `--input-embedding`",
         f"- evaluation: validation PPL (at most {MAX_EVAL_TOKENS:,} tokens) with buckets by training frequency, "
         f"zero-shot PPL on `zeroshot_wiki`, LAMBADA and multiple choice (first {TASK_LIMIT} examples each)", "",
         "| step | exit | seconds |", "|---|---|---|"]
    L += [f"| {k} | {v['exit']} | {v['seconds']} |" for k, v in figures["steps"].items()]
    summary = figures.get("summary")
    if summary:
        from reproduce import COLUMNS, _f

        L += ["", "| arm | " + " | ".join(c[1] for c in COLUMNS) + " | ms/iter | tokens/s |",
              "|---|" + "---|" * (len(COLUMNS) + 2)]
        for arm, s in summary.items():
            L.append(f"| {arm} | " + " | ".join(_f(s.get(k), 3) for k, _, _ in COLUMNS)
                     + f" | {_f(s.get('ms_per_iter'), 0)} | {_f(s.get('tokens_per_s'), 0)} |")
        results = [str(work / arm / "eval" / "results.json") for arm in ARMS]
        if all(os.path.exists(r) for r in results):
            from megatron_lev.evaluation.report import compare_results, comparison_markdown

            body = comparison_markdown(compare_results(results, list(ARMS)))
            L += ["", "## Perplexity by training frequency of the target token, and tasks (LEV against tied)", "",
                  body.split("\n", 1)[1] if body.startswith("# ") else body]  # its own title dropped
    _write_text(path, "\n".join(L) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of science.md")
    p.add_argument("--work", required=True, help="preprocessed data, checkpoints, logs")
    p.add_argument("--shared-data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--corpus", default=None, help="default SHARED_DATA/corpus/train.jsonl.zst")
    p.add_argument("--budget-s", type=float, default=560.0)
    a = p.parse_args(argv)
    corpus = a.corpus or str(Path(a.shared_data) / "corpus" / "train.jsonl.zst")
    if not os.path.exists(corpus):
        p.error(f"--corpus {corpus}: no such file")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    run(corpus, a.shared_data, Path(a.work), Path(a.out), time.monotonic() + a.budget_s, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
