#!/usr/bin/env python
"""Micro-scale reproduction of the paper: six input arms, one transformer, one data order, one schedule.

    python bench/reproduce.py                 # CPU configuration (about 90 min on 2 quiet cores)
    python bench/reproduce.py --quick         # a few minutes: plumbing check, numbers not meaningful
    python bench/reproduce.py --config large --nproc 8     # a GPU configuration (bf16, torchrun, DP)
    python bench/reproduce.py --report-only   # rebuild the report from the runs already on disk

Steps (every one idempotent, so an interrupted run continues where it stopped):

1. data: ``tools/preprocess_data.py`` on ``../shared/data/corpus/train.jsonl.zst`` (with
   ``--output-token-counts``, the training-frequency buckets' source) and ``valid.jsonl.zst``,
   GPT-2 BPE (skipped when the ``.bin/.idx`` exist);
2. training: ``pretrain_lev.py`` for each run (arm x seed): tied, untied, albert, flat_mlp,
   factored_mlp, lev with the first seed, and tied and lev again with every further seed. Every
   flag is shared except ``--input-embedding`` (and ``--seed`` between seeds), so data order,
   tokens, schedule and transformer are identical across arms of a seed; the baselines' widths are
   parameter-matched to LEV by the model code (not chosen here). Checkpoints every
   ``--save-interval``; a run resumes from its last checkpoint, and a run whose final checkpoint
   and ``train.done`` exist is skipped;
3. evaluation: ``tools/evaluate.py`` on the final checkpoint: validation PPL with the
   frequency-stratified buckets, zero-shot PPL on ``zeroshot_wiki``, LAMBADA and the
   multiple-choice tasks (``--limit`` examples each); skipped when ``eval/results.json`` exists
   for the final iteration;
4. the report (``docs/results/micro_reproduction.md``, ``--quick``: ``micro_reproduction_quick.md``)
   with its PNGs beside it, generated from the files of steps 2-3 only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from _check_harness import TIMEOUT_RC, run_logged  # noqa: E402  (bench/ is this script's directory)

SHARED = REPO.parent / "shared" / "data"
ARMS = ("tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev")
LADDER = ("albert", "flat_mlp", "factored_mlp", "lev")
MC_TASKS = ("hellaswag", "piqa", "winogrande", "arc_easy", "arc_challenge")

# Shapes and budgets. Everything an arm sees is here; nothing is set per arm.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "cpu": dict(
        model=["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256"],
        batch=["--micro-batch-size", "8", "--global-batch-size", "8"],
        train_iters=200, lr="1e-3", min_lr="1e-4", warmup_frac=0.05, save_interval=50, log_interval=10,
        eval_interval=50, eval_iters=10, eval_max_tokens=32768, eval_limit=50, train_docs=None, precision=[],
        description="4 layers, hidden 256, 4 heads, sequence 256, batch 8 x 256 = 2,048 tokens/step, fp32, 1 process",
    ),
    "quick": dict(
        model=["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128"],
        batch=["--micro-batch-size", "4", "--global-batch-size", "4"],
        train_iters=20, lr="1e-3", min_lr="1e-4", warmup_frac=0.1, save_interval=10, log_interval=5,
        eval_interval=10, eval_iters=2, eval_max_tokens=2048, eval_limit=8, train_docs=300, precision=[],
        extra=["--lev-init-sample-size", "4096"],
        description="2 layers, hidden 128, 4 heads, sequence 128, batch 4 x 128 = 512 tokens/step, fp32 "
                    "(plumbing check; trained on the first 300 training documents)",
    ),
    "large": dict(
        model=["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024"],
        batch=["--micro-batch-size", "8", "--global-batch-size", "64"],
        train_iters=5000, lr="6e-4", min_lr="6e-5", warmup_frac=0.02, save_interval=500, log_interval=20,
        eval_interval=500, eval_iters=20, eval_max_tokens=None, eval_limit=None, train_docs=None, precision=["--bf16"],
        description="12 layers, hidden 768, 12 heads, sequence 1024, batch 64 x 1024 = 65,536 tokens/step, bf16 (GPU)",
    ),
}
# The science stage of bench/gpu_check.py: tied, untied and lev on one H200 in about 200 s of a 400 s
# window, three runs at once. Sized so the run answers something: most of one pass over the corpus
# (21.6 M tokens; 86% at 250 TFLOP/s achieved, all of it at 400), with the input table about half of the
# tied model (the paper's embedding-dominated regime; the report computes it); 12 x 768 (GPT-2 small) would see 40% of the
# corpus in the same time, so its rare tokens (the buckets where the paper puts LEV's gain) would be
# seen 2.5x less.
# ``train_iters`` is a default only: the stage sets it from the throughput it measured (--train-iters).
CONFIGS["gpu-science"] = dict(
    model=["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024"],
    batch=["--micro-batch-size", "32", "--global-batch-size", "64"],
    train_iters=320, lr="1e-3", min_lr="1e-4", warmup_frac=0.02, save_interval=10**6, log_interval=10,
    eval_interval=10**6, eval_iters=0, eval_max_tokens=None, eval_limit=None, eval_tasks="", train_docs=None,
    precision=["--bf16"],
    description="8 layers, hidden 512, 8 heads, sequence 1024, batch 64 x 1024 = 65,536 tokens/step, bf16 (one GPU, "
                "the arms of a seed at once)",
    why="with the GPT-2 vocabulary the 50,304 x 512 input table is about half of the tied model (the counts "
        "are in the parameter table below), the embedding-dominated regime of the paper's 200M model; "
        "at the throughput measured in the same window the three arms train most of one pass over the corpus "
        "(21.6 M tokens) in about 200 s, so rare tokens are seen about as often as the corpus has them, where "
        "a GPT-2-small model (12 x 768) would see 40% of it in that time. Validation and zero-shot perplexity "
        "with the frequency buckets; no downstream tasks (near chance at this scale, and their time goes to "
        "training).",
)
# The same run at a model a CPU trains in a second (bench/gpu_check.py --sizes tiny): its plumbing only.
CONFIGS["gpu-science-tiny"] = dict(
    CONFIGS["gpu-science"],
    model=["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32"],
    batch=["--micro-batch-size", "2", "--global-batch-size", "4"], train_iters=3, eval_max_tokens=512,
    train_docs=40, precision=[], extra=["--lev-heads", "2", "--lev-seed-dim", "8", "--lev-knots", "5", "--lev-rank", "4",
                                        "--lev-init-sample-size", "4096",
                                        # no albert width is within 2% of so small a LEV: the narrowest
                                        "--albert-dim", "1"],
    description="1 layer, hidden 32, 2 heads, sequence 32, batch 4 x 32 = 128 tokens/step, fp32, the first 40 "
                "training documents (the GPU science run's plumbing on a CPU; numbers not meaningful)",
    why="",
)
# The seed study on 2 shared CPU cores (docs/results/science_cpu.md): four arms x five seeds in about 45 minutes.
CONFIGS["cpu-study"] = dict(
    model=["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"],
    batch=["--micro-batch-size", "8", "--global-batch-size", "8"],
    train_iters=30, lr="2e-3", min_lr="2e-4", warmup_frac=0.07, save_interval=10**6, log_interval=5,
    eval_interval=10**6, eval_iters=0, eval_max_tokens=None, eval_sample_tokens=8000,
    eval_limit=None, eval_tasks="", train_docs=None, precision=[],
    description="2 layers, hidden 64, 4 heads, sequence 64, batch 8 x 64 = 512 tokens/step, fp32, 1 process",
    why="twenty runs (tied, untied, albert, lev x five seeds) and their evaluations on two CPU cores shared with "
        "other work (load averages of 20-48 when it was sized: 10-16 s per 1,024-token iteration at nice 10), "
        "each run forked from a process that holds the imports (`--forked`), so each trains 30 iterations of "
        "512 tokens: an early-training comparison whose point is the intervals, not the paper's regime. "
        "Evaluation on documents spread evenly over each set, about 8,000 tokens of each (a full set costs "
        "5-10 minutes per run here); no downstream tasks.",
)
TRANSFORMER = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
               "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--weight-decay", "0.1", "--clip-grad", "1.0",
               "--lr-decay-style", "cosine", "--adam-beta2", "0.95"]


def _load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="cpu", choices=["cpu", "cpu-study", "large", "gpu-science", "gpu-science-tiny"])
    p.add_argument("--quick", action="store_true", help="the tiny 'quick' configuration (a few minutes)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma list (default: all six)")
    p.add_argument("--seeds", default="1234,1235", help="comma list; every arm runs with every seed unless "
                   "--multi-seed-arms narrows the further seeds")
    p.add_argument("--multi-seed-arms", default=None, help="arms run with the seeds after the first (default: all "
                   "of --arms; '' runs the first seed only)")
    p.add_argument("--train-iters", type=int, default=None, help="override the configuration's budget")
    p.add_argument("--eval-limit", type=int, default=None, help="examples per downstream task")
    p.add_argument("--eval-max-tokens", type=int, default=None, help="tokens per perplexity set")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun; data parallel)")
    p.add_argument("--threads", type=int, default=None, help="OMP/torch threads per process (default CPUs / "
                   "(nproc x parallel))")
    p.add_argument("--parallel", type=int, default=1, help="runs trained (then evaluated) at once, in the order of "
                   "the runs (a seed's arms together)")
    p.add_argument("--work-dir", default=None, help="default runs/reproduce_<config>")
    p.add_argument("--shared-data", default=str(SHARED))
    p.add_argument("--output", default=None, help="report path (default docs/results/micro_reproduction[_quick].md)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from existing runs")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--forked", action="store_true", help="one-process runs (--nproc 1 on a CPU) start forked from a "
                   "process that imported torch and megatron-core once (megatron_lev.testing.run_cli), not as new "
                   "interpreters: on a loaded CPU their imports cost more than a small run")
    a = p.parse_args(argv)
    a.config_name = "quick" if a.quick else a.config
    cfg = CONFIGS[a.config_name]
    a.train_iters = a.train_iters or cfg["train_iters"]
    a.eval_limit = a.eval_limit if a.eval_limit is not None else cfg["eval_limit"]
    a.eval_max_tokens = a.eval_max_tokens if a.eval_max_tokens is not None else cfg["eval_max_tokens"]
    a.arm_list = [x for x in a.arms.split(",") if x]
    for x in a.arm_list:
        if x not in ARMS:
            p.error(f"--arms: unknown arm {x!r} (choose from {', '.join(ARMS)})")
    try:
        a.seed_list = [int(s) for s in a.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: expected comma-separated integers")
    if not a.seed_list:
        p.error("--seeds: give at least one seed")
    a.multi = a.arm_list if a.multi_seed_arms is None else [x for x in a.multi_seed_arms.split(",") if x]
    a.work_dir = Path(a.work_dir or REPO / "runs" / f"reproduce_{a.config_name}")
    a.output = Path(a.output or REPO / "docs" / "results" /
                    ("micro_reproduction_quick.md" if a.quick else
                     "micro_reproduction.md" if a.config == "cpu" else f"micro_reproduction_{a.config}.md"))
    a.shared_data = Path(a.shared_data)
    a.deadline = None  # time.monotonic() at which every command is killed (bench/gpu_science.py sets it)
    if a.forked and a.nproc != 1:
        p.error("--forked runs one process per run: drop --nproc")
    if a.parallel < 1:
        p.error(f"--parallel {a.parallel}: give at least 1")
    return a


def runs_of(a) -> List[Dict[str, Any]]:
    """(arm, seed, name) of every run, first seed first."""
    out = []
    for i, seed in enumerate(a.seed_list):
        for arm in a.arm_list:
            if i == 0 or arm in a.multi:
                out.append({"arm": arm, "seed": seed, "name": f"{arm}_s{seed}"})
    return out


def tokenizer_args(a) -> List[str]:
    tok = a.shared_data / "tokenizers" / "gpt2"
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
            "--merge-file", str(tok / "merges.txt")]


def data_paths(a) -> Dict[str, Path]:
    d = a.work_dir / "data"
    return {"train": d / "gpt2_train_text_document", "valid": d / "gpt2_valid_text_document",
            "counts": d / "gpt2_train_text_token_counts.npy"}


def train_command(a, run: Dict[str, Any]) -> List[str]:
    cfg = CONFIGS[a.config_name]
    paths = data_paths(a)
    d = a.work_dir / run["name"]
    warm = max(1, int(round(cfg["warmup_frac"] * a.train_iters)))
    args = (cfg["model"] + TRANSFORMER + cfg["batch"] + cfg["precision"] + cfg.get("extra", []) + [
        "--train-iters", str(a.train_iters), "--lr", cfg["lr"], "--min-lr", cfg["min_lr"],
        "--lr-warmup-iters", str(warm), "--seed", str(run["seed"]),
        "--train-data-path", str(paths["train"]), "--valid-data-path", str(paths["valid"]),
        # The run's own index cache: runs trained side by side (train_and_evaluate's parallel) would otherwise
        # build and read the same megatron-core index files at once (a reader can map a half-written one).
        "--data-cache-path", str(d / "cache"), *tokenizer_args(a),
        "--log-interval", str(cfg["log_interval"]), "--eval-interval", str(cfg["eval_interval"]),
        "--eval-iters", str(cfg["eval_iters"]), "--save-interval", str(cfg["save_interval"]),
        "--exit-signal-handler", "--quiet-config", "--input-embedding", run["arm"],
        "--save", str(d / "ckpt"), "--load", str(d / "ckpt"), "--metrics-file", str(d / "metrics.jsonl")])
    if a.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
                str(REPO / "pretrain_lev.py"), *args]
    return [sys.executable, str(REPO / "pretrain_lev.py"), *args]


def eval_command(a, run: Dict[str, Any]) -> List[str]:
    paths = data_paths(a)
    d = a.work_dir / run["name"]
    cmd = [sys.executable, str(REPO / "tools" / "evaluate.py"), "--load", str(d / "ckpt"),
           "--valid-data", f"valid={paths['valid']}", "--token-counts", str(paths["counts"]),
           "--zeroshot-data", f"zeroshot={a.shared_data / 'corpus' / 'zeroshot_wiki.jsonl.zst'}",
           "--output-dir", str(d / "eval"), "--label", run["name"], "--no-progress"]
    cfg = CONFIGS[a.config_name]
    if cfg.get("eval_sample_tokens"):  # documents spread over each set (not its first ones)
        cmd += ["--sample-tokens", str(cfg["eval_sample_tokens"])]
    tasks = cfg.get("eval_tasks", "all")
    if tasks:
        cmd += ["--tasks", tasks, "--downstream-dir", str(a.shared_data / "downstream")]
    if a.eval_limit is not None:
        cmd += ["--limit", str(a.eval_limit)]
    if a.eval_max_tokens is not None:
        cmd += ["--max-tokens", str(a.eval_max_tokens)]
    return cmd


def _env(a) -> Dict[str, str]:
    threads = a.threads or max(1, (os.cpu_count() or 1) // (a.nproc * a.parallel))
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")


def _run(cmd: List[str], log: Path, env: Dict[str, str], dry: bool, deadline: Optional[float] = None,
         forked: bool = False) -> int:
    """Run ``cmd`` with its output appended to ``log``; killed with its process group at ``deadline``
    (time.monotonic; None: no limit), then it returns TIMEOUT_RC. ``forked``: a ``python script ...`` command
    runs forked from a process that holds the imports (``megatron_lev.testing.run_cli``)."""
    print("  $ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry:
        return 0
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} load {_load()}\n")
    if forked and cmd[0] == sys.executable and cmd[1].endswith(".py"):
        import subprocess

        sys.path.insert(0, str(REPO))
        from megatron_lev.testing import run_cli

        try:
            done = run_cli(cmd[1], cmd[2:], env=env, cwd=str(REPO),
                           timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
            rc, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = TIMEOUT_RC, f"{e.output or ''}{e.stderr or ''}\nkilled at the deadline\n"
        with open(log, "a", encoding="utf-8") as f:
            f.write(text)
        return rc
    return run_logged(cmd, None if deadline is None else deadline - time.monotonic(), log, env, append=True)[0]


def prepare_data(a) -> None:
    paths = data_paths(a)
    d = a.work_dir / "data"
    d.mkdir(parents=True, exist_ok=True)
    train_in = a.shared_data / "corpus" / "train.jsonl.zst"
    cfg = CONFIGS[a.config_name]
    if cfg["train_docs"]:  # quick: the first N documents (the file is shuffled) as plain jsonl
        sub = d / f"train_first{cfg['train_docs']}.jsonl"
        if not sub.exists() and not a.dry_run:
            sys.path.insert(0, str(REPO))
            from megatron_lev.jsonl import iter_lines

            lines: List[bytes] = []
            for _, line in iter_lines(str(train_in)):
                if line.strip():
                    lines.append(line)
                if len(lines) >= cfg["train_docs"]:
                    break
            tmp = sub.with_suffix(".tmp")
            tmp.write_bytes(b"".join(ln + b"\n" for ln in lines))
            tmp.replace(sub)
        train_in = sub
    jobs = [("train", train_in, ["--output-token-counts"]),
            ("valid", a.shared_data / "corpus" / "valid.jsonl.zst", [])]
    for split, src, extra in jobs:
        prefix = paths[split]
        done = prefix.with_suffix(".idx").exists() and prefix.with_suffix(".bin").exists()
        if split == "train":
            done = done and paths["counts"].exists()
        if done:
            print(f"data {split}: present ({prefix})")
            continue
        out_prefix = str(d / f"gpt2_{split}")
        cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
               "--output-prefix", out_prefix, *tokenizer_args(a), "--append-eod", "--workers",
               str(min(2, os.cpu_count() or 1)), "--overwrite", "--no-progress-bar", *extra]
        rc = _run(cmd, d / f"preprocess_{split}.log", _env(a), a.dry_run, a.deadline)
        if rc != 0:
            sys.exit(f"preprocessing {split} failed (exit {rc}); see {d / f'preprocess_{split}.log'}")


def _latest_iteration(ckpt: Path) -> int:
    try:
        return int((ckpt / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return -1


def train_run(a, run) -> None:
    d = a.work_dir / run["name"]
    done = d / "train.done"
    if done.exists() and _latest_iteration(d / "ckpt") >= a.train_iters:
        print(f"train {run['name']}: finished earlier")
        return
    print(f"train {run['name']} (from iteration {max(0, _latest_iteration(d / 'ckpt'))} to {a.train_iters}; "
          f"load {_load()})", flush=True)
    t0 = time.time()
    rc = _run(train_command(a, run), d / "train.log", _env(a), a.dry_run, a.deadline, a.forked)
    if a.dry_run:
        return
    if rc != 0 or _latest_iteration(d / "ckpt") < a.train_iters:
        sys.exit(f"training {run['name']} stopped (exit {rc}) before iteration {a.train_iters}; see {d / 'train.log'}"
                 " (rerun the same command to resume from the last checkpoint)")
    done.write_text(json.dumps({"iteration": a.train_iters, "seconds": round(time.time() - t0, 1),
                                "load_end": _load()}) + "\n")


def eval_run(a, run) -> None:
    d = a.work_dir / run["name"]
    res = d / "eval" / "results.json"
    if res.exists():
        try:
            if json.loads(res.read_text())["meta"].get("iteration") == a.train_iters:
                print(f"eval {run['name']}: finished earlier")
                return
        except (ValueError, KeyError):
            pass
    print(f"eval {run['name']} (load {_load()})", flush=True)
    rc = _run(eval_command(a, run), d / "eval.log", _env(a), a.dry_run, a.deadline, a.forked)
    if not a.dry_run and (rc != 0 or not res.exists()):
        sys.exit(f"evaluation of {run['name']} failed (exit {rc}); see {d / 'eval.log'}")


# ------------------------------------------------------------------------------------------------
# reading the runs


def read_metrics(path: Path) -> Dict[str, Dict[int, float]]:
    """{'train': {iteration: loss}, 'valid': {iteration: loss}}; later lines win (a resumed run
    repeats the iterations after its last checkpoint)."""
    out: Dict[str, Any] = {"train": {}, "valid": {}}
    records: Dict[int, Dict[str, Any]] = {}  # the training records (grad norms, clipping), by iteration
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") in out and r.get("lm loss") is not None:
            out[r["kind"]][int(r["iteration"])] = float(r["lm loss"])
        if r.get("kind") == "train":
            records[int(r["iteration"])] = r
    out["records"] = [records[i] for i in sorted(records)]
    return out


def read_train_log(path: Path) -> Dict[str, Any]:
    """Median ms/iter and tokens/s of the log intervals of the last attempt in the log."""
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8", errors="replace")
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", text)]
    tps = [float(x) for x in re.findall(r"tokens per second: ([\d.]+)", text)]
    out: Dict[str, Any] = {}
    if ms:
        out["ms_per_iter"] = statistics.median(ms)
    if tps:
        out["tokens_per_s"] = statistics.median(tps)
    return out


def collect(a) -> List[Dict[str, Any]]:
    rows = []
    for run in runs_of(a):
        d = a.work_dir / run["name"]
        r: Dict[str, Any] = dict(run)
        r["metrics"] = read_metrics(d / "metrics.jsonl")
        r["log"] = read_train_log(d / "train.log")
        res = d / "eval" / "results.json"
        r["eval"] = json.loads(res.read_text()) if res.exists() else None
        r["eval_path"] = str(res)
        rows.append(r)
    return rows


def summary_metrics(r: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """The table's figures of one run (None where missing)."""
    ev = r.get("eval") or {}
    ppl = ev.get("perplexity") or {}
    tasks = ev.get("tasks") or {}
    out: Dict[str, Optional[float]] = {
        "valid_ppl": (ppl.get("valid") or {}).get("ppl"),
        "zeroshot_ppl": (ppl.get("zeroshot") or {}).get("ppl"),
        "lambada_acc": (tasks.get("lambada") or {}).get("acc"),
        "lambada_ppl": (tasks.get("lambada") or {}).get("ppl"),
    }
    accs = [(tasks.get(t) or {}).get("acc_norm") or (tasks.get(t) or {}).get("acc") for t in MC_TASKS if t in tasks]
    accs = [x for x in accs if x is not None]
    out["mc_avg_acc"] = sum(accs) / len(accs) if accs else None
    tr = r["metrics"]["train"]
    last = sorted(tr)[-max(1, len(tr) // 10):] if tr else []
    out["final_train_loss"] = sum(tr[i] for i in last) / len(last) if last else None
    va = r["metrics"]["valid"]
    out["final_valid_loss"] = va[max(va)] if va else None
    return out


COLUMNS = [("valid_ppl", "valid PPL", True), ("zeroshot_ppl", "zero-shot wiki PPL", True),
           ("lambada_ppl", "LAMBADA PPL", True), ("lambada_acc", "LAMBADA acc", False),
           ("mc_avg_acc", "MC avg acc", False), ("final_train_loss", "train loss (last 10%)", True)]


def by_arm(rows: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["arm"], []).append(r)
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ------------------------------------------------------------------------------------------------
# report


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(rows, path: Path, smooth: int = 10) -> Optional[str]:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    any_data = False
    for r in rows:
        tr = r["metrics"]["train"]
        if not tr:
            continue
        any_data = True
        its = sorted(tr)
        ys = [tr[i] for i in its]
        k = max(1, min(smooth, len(ys) // 5 or 1))
        sm = [sum(ys[max(0, j - k + 1): j + 1]) / len(ys[max(0, j - k + 1): j + 1]) for j in range(len(ys))]
        style = "-" if r["seed"] == rows[0]["seed"] else ":"
        ax1.plot(its, sm, style, label=r["name"], linewidth=1.2)
        va = r["metrics"]["valid"]
        if va:
            vi = sorted(va)
            ax2.plot(vi, [va[i] for i in vi], style + "o", label=r["name"], markersize=3)
    if not any_data:
        plt.close(fig)
        return None
    ax1.set_title(f"training loss (moving average of {smooth} iterations)")
    ax2.set_title("validation loss (pretrain_lev.py's periodic evaluation)")
    for ax in (ax1, ax2):
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss (nats)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _f(v, d=3):
    return "–" if v is None else (f"{v:,.{d}f}" if isinstance(v, float) else f"{v:,}")


def _pct(v):
    return "–" if v is None else f"{100 * v:+.2f}%"


def param_breakdowns(a, rows) -> Dict[str, Dict[str, Any]]:
    """parameter_breakdown of each arm, from the arguments pretrain_lev.py resolved (its config.yaml)."""
    out = {}
    sys.path.insert(0, str(REPO))
    for r in rows:
        if r["arm"] in out:
            continue
        cfgs = sorted((a.work_dir / r["name"] / "ckpt").glob("iter_*/config.yaml"))
        if not cfgs:
            continue
        try:
            import yaml  # here, not at the top: bench/gpu_check.py reads CONFIGS before its wheels are installed

            from megatron_lev.config import RunConfig
            from megatron_lev.models import parameter_breakdown
            from megatron_lev.models.factory import build_configs

            saved = yaml.safe_load(cfgs[-1].read_text())
            if saved.get("padded_vocab_size") is None:
                continue
            config, model_config = build_configs(RunConfig.from_saved_args(saved))
            out[r["arm"]] = parameter_breakdown(model_config, config)
        except Exception as e:  # reported in the table instead of failing the report
            out[r["arm"]] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return out


def _ppl_relchange(rows_arm, rows_tied, key):
    m, t = _mean([summary_metrics(r)[key] for r in rows_arm]), _mean([summary_metrics(r)[key] for r in rows_tied])
    return None if (m is None or t is None) else m / t - 1


# ------------------------------------------------------------------------------------------------
# seed-paired science (bench/science_stats.py)

CONTRASTS = (("lev", "albert"), ("lev", "tied"), ("lev", "untied"), ("untied", "tied"))
SETS = (("valid", "validation"), ("zeroshot", "zero-shot wiki"))
CURVE_WINDOWS = 5


def _per_token(r: Dict[str, Any], name: str) -> Optional[Dict[str, Any]]:
    """The evaluation's per-token and per-document sums of one set (``<set>_per_token.npz``), or None."""
    import numpy as np

    path = Path(r["eval_path"]).parent / f"{name}_per_token.npz"
    if not r.get("eval") or not path.exists():
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _by_seed(rows, arm: str) -> Dict[int, Dict[str, Any]]:
    return {r["seed"]: r for r in rows if r["arm"] == arm}


def exposure_scale(a, counts) -> float:
    """The fraction of the counted training set one run trained on (its tokens over the counts' total)."""
    total = float(counts.sum())
    return (a.train_iters * _tokens_per_step(CONFIGS[a.config_name])) / total if total else 0.0


def _set_nll(r, name) -> Optional[float]:
    pt = _per_token(r, name)
    if pt is None or "nll_by_doc" not in pt:
        return None
    return float(pt["nll_by_doc"].sum() / pt["tokens_by_doc"].sum())


def paired_differences(rows, name: str) -> List[Dict[str, Any]]:
    """Per contrast of the arms present: the per-seed differences of mean NLL on set ``name``, their t
    interval, the document bootstrap and the sentence that states them."""
    import numpy as np
    import science_stats as st

    out = []
    for x, y in CONTRASTS:
        bx, by = _by_seed(rows, x), _by_seed(rows, y)
        seeds = sorted(s for s in set(bx) & set(by) if _set_nll(bx[s], name) is not None and _set_nll(by[s], name) is not None)
        if not seeds:
            continue
        diffs = [_set_nll(bx[s], name) - _set_nll(by[s], name) for s in seeds]
        px, py = [_per_token(bx[s], name) for s in seeds], [_per_token(by[s], name) for s in seeds]
        docs = st.document_bootstrap(np.stack([p["nll_by_doc"] for p in px]), np.stack([p["nll_by_doc"] for p in py]),
                                     px[0]["tokens_by_doc"])
        seeds_iv = st.t_interval(diffs)
        out.append({"a": x, "b": y, "seeds": seeds, "diffs": diffs, "t": seeds_iv, "documents": docs,
                    "documents_n": int(px[0]["tokens_by_doc"].size),
                    "statement": st.verdict(x, y, dict(SETS)[name], seeds_iv, docs)})
    return out


def exposure_differences(a, rows, name: str, counts) -> Dict[str, Any]:
    """Mean NLL per exposure bucket of each arm (mean over seeds) and each contrast's paired differences."""
    import science_stats as st
    from megatron_lev.evaluation import stratify_by_exposure

    scale = exposure_scale(a, counts)
    table: Dict[str, Dict[int, List[Dict[str, Any]]]] = {}
    for r in rows:
        pt = _per_token(r, name)
        if pt is not None:
            table.setdefault(r["arm"], {})[r["seed"]] = stratify_by_exposure(pt["nll_by_id"], pt["count_by_id"], counts, scale)
    if not table:
        return {}
    labels = [b["bucket"] for b in next(iter(next(iter(table.values())).values()))]
    tokens = [b["tokens"] for b in next(iter(next(iter(table.values())).values()))]
    means = {arm: [_mean([bs[i]["nll"] for bs in per.values()]) for i in range(len(labels))] for arm, per in table.items()}
    contrasts = {}
    for x, y in CONTRASTS:
        if x in table and y in table:
            seeds = sorted(set(table[x]) & set(table[y]))
            contrasts[f"{x}-{y}"] = [st.t_interval([table[x][s][i]["nll"] - table[y][s][i]["nll"] for s in seeds])
                                     if seeds and tokens[i] else None for i in range(len(labels))]
    return {"scale": scale, "labels": labels, "tokens": tokens, "means": means, "contrasts": contrasts}


def grad_norm_summary(rows) -> Dict[str, Dict[str, Optional[float]]]:
    """Per arm, means over seeds: each group's gradient norm over the logged iterations (all, and the first
    fifth of training), the global norm, and the fraction of iterations whose gradients were clipped."""
    out = {}
    for arm, rs in by_arm(rows).items():
        per_seed: Dict[str, List[float]] = {}
        for r in rs:
            recs = r["metrics"].get("records") or []
            if not recs:
                continue
            last = max(x["iteration"] for x in recs)
            logged = [x for x in recs if x.get("grad norm input") is not None]
            early = [x for x in logged if x["iteration"] <= max(1, last // 5)] or logged[:1]
            for g in ("input", "body", "head"):
                per_seed.setdefault(g, []).append(_mean([x[f"grad norm {g}"] for x in logged]))
                per_seed.setdefault(f"{g} early", []).append(_mean([x[f"grad norm {g}"] for x in early]))
            per_seed.setdefault("global", []).append(_mean([x.get("grad norm") for x in recs]))
            flags = [x["clipped"] for x in recs if x.get("clipped") is not None]
            if flags:
                per_seed.setdefault("clip rate", []).append(sum(flags) / len(flags))
        out[arm] = {k: _mean(v) for k, v in per_seed.items()}
    return out


def curve_gaps(rows, windows: int = CURVE_WINDOWS) -> List[Dict[str, Any]]:
    """The within-run learning-curve gap: per contrast, the paired difference of the mean training loss in
    each of ``windows`` equal windows of the iterations, t interval over seeds."""
    import science_stats as st

    def window_means(r) -> Optional[List[float]]:
        tr = r["metrics"]["train"]
        if not tr:
            return None
        its = sorted(tr)
        n = len(its)
        k = min(windows, n)  # a run shorter than the windows: one iteration a window
        cuts = [its[i * n // k:(i + 1) * n // k] for i in range(k)]
        return [sum(tr[i] for i in c) / len(c) for c in cuts]

    out = []
    for x, y in CONTRASTS:
        bx, by = _by_seed(rows, x), _by_seed(rows, y)
        pairs = [(window_means(bx[s]), window_means(by[s])) for s in sorted(set(bx) & set(by))]
        pairs = [(p, q) for p, q in pairs if p and q and len(p) == len(q)]
        if pairs:
            k = min(len(p) for p, _ in pairs)
            out.append({"a": x, "b": y, "windows": [st.t_interval([p[w] - q[w] for p, q in pairs]) for w in range(k)]})
    return out


def parameter_statement(pb: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """The tied model's size from its parameter breakdown: computed, never written by hand."""
    b = pb.get("tied")
    if not b or "error" in b:
        return None
    table = b["input_side"]
    return (f"The tied model has {b['total'] / 1e6:.1f} M parameters: a transformer body of {b['transformer'] / 1e6:.1f} M "
            f"and a {table / 1e6:.1f} M input table (also its head), {100 * table / b['total']:.0f}% of the model.")


def science_lines(a, rows, pb) -> List[str]:
    """The seed-paired sections of the report: differences with intervals and the sentences they support,
    exposure buckets, gradient norms and clipping, the learning-curve gap."""
    import science_stats as st
    from megatron_lev.evaluation import load_token_counts

    L: List[str] = []
    statement = parameter_statement(pb)
    if statement:
        L += [statement, ""]
    L += ["## Seed-paired differences", "",
          "Mean NLL per token (nats) of arm A minus arm B, taken within each seed (same body initialisation, data "
          "order and schedule), then over seeds: mean with its 95% t interval over seeds, and a 95% document "
          "bootstrap interval (the evaluated documents resampled, paired across arms); in % the same as a "
          "perplexity change. Negative = A better. A sentence says one arm is better only where both intervals "
          "exclude 0 on the same side.", ""]
    statements = []
    for name, label in SETS:
        diffs = paired_differences(rows, name)
        if not diffs:
            continue
        L += [f"### {label}", "", "| A - B | seeds | per seed (nats) | mean [95% t, seeds] | PPL change | "
              "document bootstrap [95%] |", "|---|---|---|---|---|---|"]
        for d in diffs:
            t, b = d["t"], d["documents"]
            ci = "one seed: no interval" if t.lo is None else f"{t.mean:+.4f} [{t.lo:+.4f}, {t.hi:+.4f}]"
            pc = (f"{st.pct(t.mean):+.2f}%" if t.lo is None else
                  f"{st.pct(t.mean):+.2f}% [{st.pct(t.lo):+.2f}%, {st.pct(t.hi):+.2f}%]")
            bs = "–" if b.lo is None else f"{b.mean:+.4f} [{b.lo:+.4f}, {b.hi:+.4f}] ({d['documents_n']} documents)"
            L.append(f"| {d['a']} - {d['b']} | {len(d['seeds'])} | {', '.join(f'{x:+.4f}' for x in d['diffs'])} | "
                     f"{ci} | {pc} | {bs} |")
            statements.append(d["statement"])
        L.append("")
    if statements:
        L += ["### What the intervals support", ""] + statements + [""]
    counts_path = data_paths(a)["counts"]
    if counts_path.exists():
        counts = load_token_counts(str(counts_path))
        for name, label in SETS:
            e = exposure_differences(a, rows, name, counts)
            if not e:
                continue
            arms = [x for x in ARMS if x in e["means"]]
            L += [f"### {label}: mean NLL by exposure", "",
                  f"Buckets by how often a run saw the target token in training: its count in the training set times "
                  f"{e['scale']:.4g} (the part of the set one run trained on), rounded. Per arm the mean NLL (nats, mean "
                  "over seeds); per contrast the paired difference with its 95% t interval over seeds.", "",
                  "| exposure | tokens | " + " | ".join(arms) + " | " + " | ".join(e["contrasts"]) + " |",
                  "|---|---|" + "---|" * (len(arms) + len(e["contrasts"]))]
            for i, lab in enumerate(e["labels"]):
                cells = [_f(e["means"][x][i], 3) for x in arms]
                for iv in (c[i] for c in e["contrasts"].values()):
                    cells.append("–" if iv is None else (f"{iv.mean:+.3f}" if iv.lo is None else
                                                         f"{iv.mean:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]"))
                L.append(f"| {lab} | {e['tokens'][i]:,} | " + " | ".join(cells) + " |")
            L.append("")
    g = grad_norm_summary(rows)
    if any(g.values()):
        L += ["## Gradient norms and clipping", "",
              "Per arm, means over seeds of each run's mean over its logged iterations: the gradient norm of the input "
              "side, the transformer body and the head before clipping (in the first fifth of training and over all of "
              "it), the global norm, and the fraction of iterations the global clip (1.0) scaled. The tied table's one "
              "gradient is the input side's (its head gradient included).", "",
              "| arm | input (first fifth) | body (first fifth) | head (first fifth) | input | body | head | global | "
              "clip rate |", "|---|---|---|---|---|---|---|---|---|"]
        for arm in [x for x in ARMS if g.get(x)]:
            v = g[arm]
            L.append(f"| {arm} | " + " | ".join(_f(v.get(k), 3) for k in (
                "input early", "body early", "head early", "input", "body", "head", "global"))
                + f" | {_f(v.get('clip rate'), 2)} |")
        L.append("")
    gaps = curve_gaps(rows)
    if gaps:
        L += ["## Learning-curve gap", "", f"Training loss of A minus B in {CURVE_WINDOWS} equal windows of the "
              "iterations (paired within each seed, then mean and 95% t interval over seeds; nats).", "",
              "| A - B | " + " | ".join(f"window {w + 1}" for w in range(len(gaps[0]["windows"]))) + " |",
              "|---|" + "---|" * len(gaps[0]["windows"])]
        for gp in gaps:
            L.append(f"| {gp['a']} - {gp['b']} | " + " | ".join(
                f"{iv.mean:+.3f}" if iv.lo is None else f"{iv.mean:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]"
                for iv in gp["windows"]) + " |")
        L.append("")
    return L


def build_report(a, rows, out: Path, command: str, meta: Dict[str, Any]) -> str:
    sys.path.insert(0, str(REPO))
    cfg = CONFIGS[a.config_name]
    fig_dir = out.parent / out.stem
    fig_dir.mkdir(parents=True, exist_ok=True)
    arms = by_arm(rows)
    first = a.seed_list[0]
    L: List[str] = []
    title = "Micro-scale reproduction" + (" — QUICK RUN (plumbing check, numbers not meaningful)" if a.quick else "")
    L += [f"# {title}", "", "Generated by `bench/reproduce.py` from the training logs and evaluation result files "
          "under `" + os.path.relpath(a.work_dir, REPO) + "`; no number here is edited by hand.", ""]
    L += ["## Set-up", "",
          f"- command to regenerate: `{command}` (idempotent: finished runs and evaluations are skipped; "
          "`--report-only` rebuilds this page from the files)",
          f"- transformer: {cfg['description']}; Llama-style (RoPE, RMSNorm, SwiGLU, no biases), dropout 0",
          f"- data: `../shared/data/corpus/train.jsonl.zst`, GPT-2 BPE (50,257 ids, padded to 50,304); "
          f"{a.train_iters} iterations = {a.train_iters * _tokens_per_step(cfg):,} training tokens per run; "
          f"AdamW (beta2 0.95, weight decay 0.1, clip 1.0), lr {cfg['lr']} cosine to {cfg['min_lr']}, "
          f"{max(1, int(round(cfg['warmup_frac'] * a.train_iters)))} warm-up iterations",
          f"- runs: every arm with seed {first}" + (f"; {', '.join(a.multi)} also with seed(s) "
                                                   f"{', '.join(map(str, a.seed_list[1:]))}" if len(a.seed_list) > 1 else "")
          + ". Within a seed every flag except `--input-embedding` is the same, so the data order, tokens, "
          "schedule and transformer are identical; `--seed` sets both the initialisation and the data order.",
          f"- evaluation (`tools/evaluate.py`): validation PPL on `valid.jsonl.zst` and zero-shot PPL on "
          f"`zeroshot_wiki.jsonl.zst`, {_eval_extent(a, cfg)}, with buckets by the target token's relative frequency "
          "in the preprocessed training set and by its exposure count; per-document NLL for the document bootstrap"
          + (f"; LAMBADA and {', '.join(MC_TASKS)} with `--limit {a.eval_limit}` examples each (MC accuracy: "
             "acc_norm where defined)" if cfg.get("eval_tasks", "all") else ""),
          f"- machine: {meta.get('machine')}; load average at start {meta.get('load_start')}, at end "
          f"{meta.get('load_end')} (timings in this page are from a machine shared with other jobs when the "
          "load exceeds the CPU count)", ""]
    if cfg.get("why"):
        L += [f"Why this size: {cfg['why']}", ""]
    elif a.config_name in ("cpu", "quick"):
        L += [("The CPU configuration's size" if a.quick else "Why this size") + ": with the GPT-2 vocabulary the 50,304 x 256 input table (12.9 M parameters) is "
              "about 80% of the tied model (the 4-layer transformer is 3.1 M), the regime of the paper's 200M "
              "model with a 200k vocabulary where the embedding dominates; a SentencePiece vocabulary trained on "
              "this corpus (8-16k) would train 2-3x more tokens per minute (the output softmax dominates the "
              "step at this width) but would make the embedding a minor share and empty the rare-token buckets "
              "(1e-7 .. 1e-5 of 21.6 M tokens is 2-200 occurrences), which is where the paper locates LEV's "
              "gain.", ""]
    # parameters
    pb = param_breakdowns(a, rows)
    L += ["## Parameters of each arm", "", "| arm | input side | transformer | output head | total | input vs LEV | widths |",
          "|---|---|---|---|---|---|---|"]
    for arm in [x for x in ARMS if x in arms]:
        b = pb.get(arm)
        if not b:
            L.append(f"| {arm} | – | – | – | – | – | (no checkpoint yet) |")
        elif "error" in b:
            L.append(f"| {arm} | – | – | – | – | – | {b['error']} |")
        else:
            w = ", ".join(f"{k}={v}" for k, v in (b.get("widths") or {}).items())
            L.append(f"| {arm} | {b['input_side']:,} | {b['transformer']:,} | {b['output_head']:,}"
                     f"{' (shared)' if arm == 'tied' else ''} | {b['total']:,} | "
                     f"{b['input_side'] / b['lev_reference']:.3f}x | {w or '–'} |")
    L.append("")
    # metrics
    tied = arms.get("tied", [])
    L += ["## Final metrics", "", "Per run, then the change of the arm's mean against the mean of `tied` "
          "(relative for PPL/loss, percentage points for accuracy; negative PPL change = better).", "",
          "| run | " + " | ".join(c[1] for c in COLUMNS) + " | ms/iter | tokens/s |",
          "|---|" + "---|" * (len(COLUMNS) + 2)]
    for r in rows:
        s = summary_metrics(r)
        L.append(f"| {r['name']} | " + " | ".join(_f(s[k], 3 if not lower or k.endswith('loss') else 2)
                                                  for k, _, lower in COLUMNS)
                 + f" | {_f(r['log'].get('ms_per_iter'), 0)} | {_f(r['log'].get('tokens_per_s'), 0)} |")
    L += ["", "| arm (mean over seeds) | " + " | ".join(f"Δ {c[1]}" for c in COLUMNS) + " |",
          "|---|" + "---|" * len(COLUMNS)]
    for arm in [x for x in ARMS if x in arms]:
        cells = []
        for k, _, lower in COLUMNS:
            m = _mean([summary_metrics(r)[k] for r in arms[arm]])
            t = _mean([summary_metrics(r)[k] for r in tied])
            if m is None or t is None:
                cells.append("–")
            elif lower:
                cells.append(_pct(m / t - 1))
            else:
                cells.append(f"{100 * (m - t):+.2f} pt")
        evaluated = sum(1 for r in arms[arm] if r.get("eval"))  # runs still missing do not count
        L.append(f"| {arm} (n={evaluated}) | " + " | ".join(cells) + " |")
    L.append("")
    # seed spread
    multi = {arm: rs for arm, rs in arms.items() if len(rs) > 1}
    if multi:
        L += ["### Seed spread", "", "| arm | seeds | valid PPL per seed | mean | spread (max − min) | "
              "zero-shot PPL per seed | spread |", "|---|---|---|---|---|---|---|"]
        for arm, rs in multi.items():
            v = [summary_metrics(r)["valid_ppl"] for r in rs]
            z = [summary_metrics(r)["zeroshot_ppl"] for r in rs]
            vv, zz = [x for x in v if x is not None], [x for x in z if x is not None]
            L.append(f"| {arm} | {', '.join(str(r['seed']) for r in rs)} | {', '.join(_f(x, 2) for x in v)} | "
                     f"{_f(_mean(v), 2)} | {_f(max(vv) - min(vv), 2) if vv else '–'} | {', '.join(_f(x, 2) for x in z)} | "
                     f"{_f(max(zz) - min(zz), 2) if zz else '–'} |")
        L.append("")
    # loss curves
    png = plot_loss_curves(rows, fig_dir / "loss_curves.png")
    if png:
        L += ["## Loss curves", "", f"Parsed from each run's `metrics.jsonl` (seed {first} solid, other seeds dotted).", "",
              f"![loss curves]({os.path.relpath(png, out.parent)})", ""]
    # frequency-stratified comparison through the evaluation suite's comparison
    first_rows = [r for r in rows if r["seed"] == first and r["eval"]]
    first_rows.sort(key=lambda r: ARMS.index(r["arm"]))
    cmp_md = None
    if len(first_rows) >= 2 and first_rows[0]["arm"] == "tied":
        from megatron_lev.evaluation.report import write_comparison

        outc = write_comparison([r["eval_path"] for r in first_rows], str(fig_dir), [r["arm"] for r in first_rows])
        cmp = json.loads(Path(outc["json"]).read_text())
        cmp_md = cmp
        L += ["## Perplexity by training frequency of the target token", "",
              f"Seed {first}; buckets by the token's relative frequency in the training set "
              "(`--output-token-counts`); change = PPL / PPL(tied) − 1.", ""]
        for name, e in cmp["perplexity"].items():
            L += [f"### {name}", "", "| bucket | tokens | " + " | ".join(f"PPL {lab}" for lab in cmp["labels"]) + " | "
                  + " | ".join(f"Δ {lab}" for lab in cmp["labels"][1:]) + " |",
                  "|---|---|" + "---|" * (2 * len(cmp["labels"]) - 1)]
            for b in e.get("buckets", []) + [{"bucket": "all", "tokens": e["tokens"], "ppl": e["ppl"],
                                               "relative_change": e["relative_change"]}]:
                L.append(f"| {b['bucket']} | {_f(b['tokens'][0])} | " + " | ".join(_f(p, 2) for p in b["ppl"]) + " | "
                         + " | ".join(_pct(c) for c in b["relative_change"][1:]) + " |")
            L.append("")
            for k, p in outc.items():
                if k.startswith("compare_") and k == f"compare_{''.join(c if c.isalnum() or c in '-_' else '_' for c in name)}":
                    L += [f"![{k}]({os.path.relpath(p, out.parent)})", ""]
    # ablation ladder
    L += ["## Ablation ladder (albert → flat_mlp → factored_mlp → lev)", "",
          "The paper's decomposition, all parameter-matched to LEV's input side: albert (a low-rank table), "
          "flat_mlp (adds a nonlinear MLP on the table), factored_mlp (replaces the table by LEV's compositional "
          "codebooks), lev (adds the spline / separable-product heads). Step = change against the previous rung.", "",
          "| rung | valid PPL | step | vs tied | zero-shot PPL | step | vs tied |", "|---|---|---|---|---|---|---|"]
    prev = None
    for arm in LADDER:
        if arm not in arms:
            continue
        v = _mean([summary_metrics(r)["valid_ppl"] for r in arms[arm]])
        z = _mean([summary_metrics(r)["zeroshot_ppl"] for r in arms[arm]])
        sv = (v / prev[0] - 1) if (prev and v and prev[0]) else None
        sz = (z / prev[1] - 1) if (prev and z and prev[1]) else None
        L.append(f"| {arm} | {_f(v, 2)} | {_pct(sv)} | {_pct(_ppl_relchange(arms[arm], tied, 'valid_ppl'))} | "
                 f"{_f(z, 2)} | {_pct(sz)} | {_pct(_ppl_relchange(arms[arm], tied, 'zeroshot_ppl'))} |")
        prev = (v, z)
    L.append("")
    L += science_lines(a, rows, pb)
    L += ["## Scale", "", scale_note(a.quick, a.train_iters * _tokens_per_step(cfg),
                                     "on one GPU" if cfg["precision"] else "on CPU"), ""]
    text = "\n".join(L)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return text


def _eval_extent(a, cfg) -> str:
    if cfg.get("eval_sample_tokens"):
        return (f"documents spread evenly over each set, about {cfg['eval_sample_tokens']:,} tokens of each "
                "(`--sample-tokens`)")
    return f"the first {a.eval_max_tokens:,} tokens of each" if a.eval_max_tokens else "every document of each set"


def _tokens_per_step(cfg) -> int:
    b = cfg["batch"]
    s = cfg["model"]
    return int(b[b.index("--global-batch-size") + 1]) * int(s[s.index("--seq-length") + 1])


def scale_note(quick: bool, train_tokens: int, where: str) -> str:
    return (("*Quick run: about ten thousand training tokens per run; plumbing only.* " if quick else "")
            + f"These are micro-scale runs ({train_tokens:,} training tokens per run, {where}); the paper's claims are "
              "at 200M+ parameters and billions of tokens, so a difference here is a data point about this scale.")


def train_and_evaluate(a, runs: List[Dict[str, Any]], parallel: int = 1) -> None:
    """Train and evaluate every run. One at a time (``parallel`` 1): each run is trained, then evaluated.
    Several: the runs are trained ``parallel`` at a time, then evaluated so (on one GPU, their start-ups
    overlap and the device is shared); a run that fails stops the others' next step, not their current one."""
    if parallel <= 1:
        for run in runs:
            train_run(a, run)
            eval_run(a, run)
        return
    for step in (train_run, eval_run):
        for i in range(0, len(runs), parallel):
            failures: List[str] = []

            def one(run, step=step, failures=failures):
                try:
                    step(a, run)
                except SystemExit as e:  # a run's own failure line
                    failures.append(str(e.code))

            threads = [threading.Thread(target=one, args=(run,)) for run in runs[i:i + parallel]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if failures:
                sys.exit("; ".join(failures))


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    command = "python bench/reproduce.py" + ("".join(" " + shlex.quote(x) for x in raw if x != "--report-only"))
    meta = {"load_start": _load(), "machine": f"{os.cpu_count()} CPUs"}
    try:
        import torch

        meta["machine"] += f", torch {torch.__version__}" + (
            f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU")
    except Exception:
        pass
    runs = runs_of(a)
    print(f"reproduce: config {a.config_name}, {len(runs)} runs ({', '.join(r['name'] for r in runs)}), "
          f"{a.train_iters} iterations each, work dir {a.work_dir}, load {meta['load_start']}", flush=True)
    if not a.report_only:
        prepare_data(a)
        train_and_evaluate(a, runs, parallel=a.parallel)
    if a.dry_run:
        return 0
    meta["load_end"] = _load()
    meta_path = a.work_dir / "run_meta.json"
    if a.report_only and meta_path.exists():  # the load figures of the run, not of this rebuild
        meta = json.loads(meta_path.read_text())
    elif not a.report_only:
        a.work_dir.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(meta) + "\n")
    build_report(a, collect(a), a.output, command, meta)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
