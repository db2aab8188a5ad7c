#!/usr/bin/env python
"""What converting a trained dense embedding to LEV costs, and how fast it recovers.

    python bench/dense_to_lev.py                       # CPU budget below; writes docs/results/dense_to_lev.md
    python bench/dense_to_lev.py --data-dir DIR        # reuse preprocessed GPT-2 data (bench/reproduce.py's)
    python bench/dense_to_lev.py --report-only         # rebuild the page from the files on disk

Steps (each skipped when its output exists, so an interrupted run continues):

1. data: the shared corpus (``../shared/data/corpus``) with the GPT-2 tokenizer, preprocessed as
   ``bench/reproduce.py`` does (training token counts included);
2. ``pretrain_lev.py``: a small tied model for ``--pretrain-iters`` iterations (the baseline);
3. ``tools/convert_checkpoint.py to-lev`` on its checkpoint, frequency-weighted with the training
   token counts; the fit report is kept (relative error per frequency bucket, parameters, time);
4. ``tools/evaluate.py`` on both checkpoints: validation PPL and PPL per training-frequency bucket
   (the cost of the conversion at step 0);
5. both continue for ``--continue-iters`` iterations on the same data order with the same flags
   (fresh Adam state for both: the converted checkpoint has none, so the dense one is loaded with
   ``--no-load-optim`` too; constant learning rate), validation loss every ``--eval-interval``
   iterations (how fast the converted model recovers);
6. ``tools/evaluate.py`` on both continued checkpoints, and the report.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import reproduce  # noqa: E402  (data preparation and the shared transformer flags)

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128"]
BATCH = ["--micro-batch-size", "8", "--global-batch-size", "8"]
LEV = ["--lev-digits", "3", "--lev-seed-dim", "32", "--lev-rank", "16", "--lev-heads", "4", "--lev-knots", "8",
       "--lev-init-sample-size", "4096"]
FIT = ["--fit-lr", "3e-3", "--fit-batch-size", "2048", "--fit-max-steps", "400", "--fit-eval-interval", "50",
       "--fit-patience", "3"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "dense_to_lev")
    p.add_argument("--data-dir", type=Path, default=None, help="preprocessed data (default WORK_DIR/data)")
    p.add_argument("--shared-data", type=Path, default=reproduce.SHARED)
    p.add_argument("--output", type=Path, default=REPO / "docs" / "results" / "dense_to_lev.md")
    p.add_argument("--pretrain-iters", type=int, default=400)
    p.add_argument("--continue-iters", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-max-tokens", type=int, default=65536)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    return p.parse_args(argv)


def _paths(a) -> Dict[str, Path]:
    d = a.data_dir or (a.work_dir / "data")
    w = a.work_dir
    return {"train": d / "gpt2_train_text_document", "valid": d / "gpt2_valid_text_document",
            "counts": d / "gpt2_train_text_token_counts.npy", "dense": w / "dense", "lev": w / "lev",
            "dense_cont": w / "dense_cont", "lev_cont": w / "lev_cont", "fit": w / "fit.json"}


def _ns(a) -> SimpleNamespace:
    """The namespace bench/reproduce.py's helpers read."""
    return SimpleNamespace(work_dir=(a.data_dir.parent if a.data_dir else a.work_dir), shared_data=a.shared_data,
                           config_name="cpu", dry_run=a.dry_run, nproc=1, parallel=1, threads=None)


def _train_flags(a, p, iters: int) -> List[str]:
    return (MODEL + reproduce.TRANSFORMER + BATCH + LEV + reproduce.tokenizer_args(_ns(a)) + [
        "--train-iters", str(iters), "--seed", str(a.seed), "--train-data-path", str(p["train"]),
        "--valid-data-path", str(p["valid"]), "--data-cache-path", str(a.work_dir / "cache"), "--log-interval", "10",
        "--eval-iters", "4", "--quiet-config"])


def _run(a, name: str, cmd: List[str]) -> None:
    rc = reproduce._run([sys.executable, *cmd], a.work_dir / "logs" / f"{name}.log", reproduce._env(_ns(a)),
                        a.dry_run)
    if rc != 0:
        sys.exit(f"{name} failed (exit {rc}); see {a.work_dir / 'logs' / f'{name}.log'}")


def _done(ckpt: Path, iteration: int) -> bool:
    t = ckpt / "latest_checkpointed_iteration.txt"
    return t.is_file() and t.read_text().strip() == str(iteration)


def evaluate(a, p, name: str) -> None:
    out = a.work_dir / "eval" / name
    if (out / "results.json").is_file():
        return
    _run(a, f"eval_{name}", [str(REPO / "tools" / "evaluate.py"), "--load", str(p[name]), "--valid-data",
                             f"valid={p['valid']}", "--token-counts", str(p["counts"]), "--max-tokens",
                             str(a.eval_max_tokens), "--output-dir", str(out), "--label", name, "--no-progress"])


def run_all(a) -> None:
    p = _paths(a)
    if a.data_dir is None:
        reproduce.prepare_data(_ns(a))
    T, C = a.pretrain_iters, a.continue_iters
    if not _done(p["dense"], T):
        _run(a, "pretrain_dense", [str(REPO / "pretrain_lev.py"), *_train_flags(a, p, T), "--lr", "1e-3",
                                   "--min-lr", "1e-4", "--lr-warmup-iters", str(max(1, T // 20)),
                                   "--eval-interval", str(T), "--input-embedding", "tied", "--save", str(p["dense"]),
                                   "--metrics-file", str(a.work_dir / "pretrain_metrics.jsonl")])
    if not _done(p["lev"], T):
        _run(a, "to_lev", [str(REPO / "tools" / "convert_checkpoint.py"), "to-lev", "--load", str(p["dense"]),
                           "--save", str(p["lev"]), "--token-counts", str(p["counts"]), "--report", str(p["fit"]),
                           *LEV[:-2], *FIT])
    evaluate(a, p, "dense")
    evaluate(a, p, "lev")
    for name in ("dense", "lev"):
        out = p[f"{name}_cont"]
        if not _done(out, T + C):
            cfg = p[name] / f"iter_{T:07d}" / "config.yaml"
            _run(a, f"continue_{name}", [
                str(REPO / "pretrain_lev.py"), "--config", str(cfg), *_train_flags(a, p, T + C), "--load", str(p[name]),
                "--no-load-optim", "--override-opt-param-scheduler", "--lr", "3e-4", "--min-lr", "3e-4",
                "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--eval-interval", str(a.eval_interval),
                "--save", str(out), "--metrics-file", str(a.work_dir / f"continue_{name}_metrics.jsonl")])
        evaluate(a, p, f"{name}_cont")


# ------------------------------------------------------------------------------------------------ report


def _valid_curve(path: Path) -> Dict[int, float]:
    out: Dict[int, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") in ("valid", "validation"):
                loss = row.get("lm loss") or row.get("validation/lm loss") or row.get("loss")
                if loss is not None:
                    out[int(row["iteration"])] = float(loss)
    return out


def _ppl(res: Dict[str, Any]) -> Dict[str, Any]:
    """Validation PPL and the per-bucket PPLs of an evaluate.py results.json."""
    sets = res.get("perplexity") or res.get("valid") or {}
    if isinstance(sets, list):
        sets = {s.get("name"): s for s in sets}
    v = sets.get("valid") or next(iter(sets.values()), {})
    return {"ppl": v.get("ppl"), "buckets": v.get("buckets") or v.get("frequency_buckets") or []}


def _load_at_start(log: Path) -> str:
    """The machine load a step's log recorded when it started (its ``# <time> load [...]`` line)."""
    if log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("# ") and " load [" in line:
                return "load average " + line.split(" load ", 1)[1] + " at its start"
    return "machine load not recorded"


def _f(x, d=2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def build_report(a, command: str) -> str:
    p = _paths(a)
    fit = json.loads(p["fit"].read_text())
    ev = {n: _ppl(json.loads((a.work_dir / "eval" / n / "results.json").read_text()))
          for n in ("dense", "lev", "dense_cont", "lev_cont")}
    curves = {n: _valid_curve(a.work_dir / f"continue_{n}_metrics.jsonl") for n in ("dense", "lev")}
    T, C = a.pretrain_iters, a.continue_iters
    step0 = (ev["lev"]["ppl"] / ev["dense"]["ppl"] - 1) if ev["lev"]["ppl"] and ev["dense"]["ppl"] else None
    end = (ev["lev_cont"]["ppl"] / ev["dense_cont"]["ppl"] - 1) if ev["lev_cont"]["ppl"] and ev["dense_cont"]["ppl"] \
        else None
    lines = [
        "# Dense -> LEV conversion: cost at step 0 and recovery", "",
        f"Generated by `{command}`.", "",
        "## Set-up", "",
        f"- Model: {' '.join(MODEL)}, RoPE, RMSNorm, SwiGLU, tied embedding (GPT-2 vocabulary padded to 50,304), "
        f"fp32, one CPU process; batch 8 x 128 = 1,024 tokens/step; seed {a.seed}.",
        f"- Pre-training: {T} iterations of the shared corpus (`../shared/data/corpus/train.jsonl.zst`), "
        "lr 1e-3 cosine to 1e-4.",
        f"- Conversion: `tools/convert_checkpoint.py to-lev` with {' '.join(LEV[:-2])}, fit {' '.join(FIT)}, "
        "frequency-weighted by the training token counts; the tied table becomes the untied output head.",
        f"- Continuation: both checkpoints for {C} more iterations ({C * 1024:,} tokens, the same data order), "
        "constant lr 3e-4, fresh Adam state for both, validation loss every "
        f"{a.eval_interval} iterations (4 batches).",
        f"- Evaluation: `tools/evaluate.py` on `valid` (first {a.eval_max_tokens:,} tokens), buckets by training "
        "frequency (the paper's edges).", "",
        "## The fit", "",
        f"Relative error {fit['relative_error']:.4f} overall (uniform over ids; initialisation "
        f"{fit['initial_relative_error']:.4f}), {_f(fit.get('weighted_relative_error'), 4)} frequency-weighted; "
        f"LEV {fit['lev_params']:,} parameters vs the table's {fit['table_params']:,} "
        f"({fit['lev_params'] / fit['table_params']:.2%}); {fit['steps']} steps in {fit['seconds']:.0f} s "
        f"(one run, {_load_at_start(a.work_dir / 'logs' / 'to_lev.log')}; stopped: {fit['stopped_because']}).", "",
        "| training-frequency bucket | ids | relative error |", "|---|---:|---:|",
    ]
    lines += [f"| {b['bucket']} | {b['vocab_ids']:,} | {_f(b['relative_error'], 4)} |" for b in fit["buckets"]]
    lines += ["", "## Perplexity", "",
              "| checkpoint | valid PPL | " + " | ".join(b["bucket"] for b in ev["dense"]["buckets"]) + " |",
              "|---|---:|" + "---:|" * len(ev["dense"]["buckets"])]
    names = {"dense": f"dense, iteration {T}", "lev": f"converted to LEV, iteration {T} (step 0)",
             "dense_cont": f"dense, iteration {T + C}", "lev_cont": f"LEV, iteration {T + C}"}
    for n, label in names.items():
        lines.append(f"| {label} | {_f(ev[n]['ppl'])} | " + " | ".join(_f(b.get('ppl')) for b in ev[n]["buckets"])
                     + " |")
    lines += ["", "## Recovery (validation loss during the continuation)", "",
              "| iteration | dense | LEV |", "|---:|---:|---:|"]
    for it in sorted(set(curves["dense"]) | set(curves["lev"])):
        lines.append(f"| {it} | {_f(curves['dense'].get(it), 3)} | {_f(curves['lev'].get(it), 3)} |")
    lines += ["", "## Reading", ""]
    if step0 is not None:
        lines.append(f"- At step 0 the conversion costs {step0:+.1%} validation PPL ({_f(ev['dense']['ppl'])} -> "
                     f"{_f(ev['lev']['ppl'])}).")
    if end is not None:
        lines.append(f"- After {C} iterations of both, the LEV model's PPL is {end:+.1%} relative to the dense "
                     f"model's ({_f(ev['dense_cont']['ppl'])} vs {_f(ev['lev_cont']['ppl'])}).")
        behind = ev["lev_cont"]["ppl"] > ev["dense"]["ppl"]
        lines.append(f"- The converted model {'has not yet' if behind else 'has'} reached the dense model's PPL at "
                     f"the conversion ({_f(ev['lev_cont']['ppl'])} after {C} iterations vs {_f(ev['dense']['ppl'])} "
                     "at step 0).")
    both = sorted(set(curves["dense"]) & set(curves["lev"]))
    if len(both) >= 2:
        first, last = both[0], both[-1]
        g0, g1 = curves["lev"][first] - curves["dense"][first], curves["lev"][last] - curves["dense"][last]
        lines.append(f"- Validation-loss gap (LEV - dense): {g0:.3f} nats at iteration {first}, {g1:.3f} at "
                     f"{last} ({1 - g1 / g0:.0%} of it closed in {last - first} iterations)." if g0 > 0 else
                     f"- Validation-loss gap (LEV - dense): {g0:.3f} nats at iteration {first}, {g1:.3f} at {last}.")
    lines.append("- The budget is tiny (a CPU run): the numbers show the plumbing and the order of magnitude, not "
                 "what a converted production model would do.")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    a.work_dir = a.work_dir.resolve()
    given = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--report-only"]  # the page's command
    command = "python bench/dense_to_lev.py " + " ".join(shlex.quote(x) for x in given)
    t0 = time.time()
    if not a.report_only:
        run_all(a)
    if a.dry_run:
        return 0
    text = build_report(a, command.strip())
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(text)
    print(f"wrote {a.output} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
