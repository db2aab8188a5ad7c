#!/usr/bin/env python
"""The GPU check's science run: tied, untied and LEV on the same data, order and seed, sized to the
time it is given.

    python bench/gpu_science.py --out OUT --work WORK --seconds 200 --assume-tflops 250 [--config gpu-science]
    python bench/gpu_science.py ... --tokens-per-s tied=6e5,untied=6e5,lev=4e5   # measured rates instead

Run by ``bench/gpu_check.py`` as its last stage with what is left of the budget and the tokens/s its
throughput stage measured at this model's shape. The runner is ``bench/reproduce.py``'s: its
configuration (``--config``, default ``gpu-science``: the model and why it was chosen are written there),
its data preparation, training and evaluation commands, and its report; here only the iteration count
is chosen and the three runs go at once (``reproduce.train_and_evaluate(..., parallel=3)``: on one GPU
their start-ups overlap and the device is shared), all killed at the deadline.

Sizing (``plan``): of the seconds given, ``OVERHEAD_S`` (preprocessing, start-ups, the checkpoint,
evaluation, the report) is set aside; ``TRAIN_SAFETY`` of the rest trains. The arms share the device,
so a token of every arm costs the sum of the three arms' seconds per token; tokens per arm = training
seconds / that sum, at most one pass over the corpus, in whole iterations. The rates are the measured
ones, or (planning without a device) ``--assume-tflops`` over the model's training FLOPs per token,
LEV's ``LEV_OVER_TIED_ASSUMED`` times slower than tied.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _check_harness import CheckFailed, Skip, write_text  # noqa: E402

ARMS = ("tied", "untied", "lev")
SEED = "1234"
OVERHEAD_S = {"preprocessing": 15.0, "start-ups": 25.0, "checkpoint": 5.0, "evaluation": 30.0, "report": 5.0}
TRAIN_SAFETY = 0.8  # of the training window planned: the three processes' switching and the measurement's error
LEV_OVER_TIED_ASSUMED = 1.3  # only when planning without a measured LEV rate
TOKENS_PER_COMPRESSED_BYTE = 1.06  # GPT-2 tokens per byte of the shared corpus's zstd file (21.6 M / 20.5 MB)


def _reproduce():
    import reproduce  # bench/ is this script's directory

    return reproduce


def model_shape(config: str) -> Dict[str, int]:
    """layers, hidden, heads, seq, micro_batch, global_batch of a ``bench/reproduce.py`` configuration."""
    cfg = _reproduce().CONFIGS[config]
    flags = dict(zip(cfg["model"][::2], cfg["model"][1::2]))
    flags.update(zip(cfg["batch"][::2], cfg["batch"][1::2]))
    return {"layers": int(flags["--num-layers"]), "hidden": int(flags["--hidden-size"]),
            "heads": int(flags["--num-attention-heads"]), "seq": int(flags["--seq-length"]),
            "micro_batch": int(flags["--micro-batch-size"]), "global_batch": int(flags["--global-batch-size"])}


def flops_per_token(shape: Dict[str, int], vocab: int = 50304) -> float:
    """Training FLOPs per token of the tied model of ``shape`` (the library's forward count, x3)."""
    from megatron_lev.training.flops import transformer_forward_flops_per_token

    cfg = SimpleNamespace(hidden_size=shape["hidden"], num_layers=shape["layers"], num_attention_heads=shape["heads"],
                          kv_channels=None, num_query_groups=None, ffn_hidden_size=4 * shape["hidden"],
                          gated_linear_unit=True)
    return 3.0 * transformer_forward_flops_per_token(cfg, vocab, shape["seq"])


def assumed_rates(config: str, tflops: float) -> Dict[str, float]:
    """tokens/s per arm at ``tflops`` achieved (planning without a device)."""
    tied = tflops * 1e12 / flops_per_token(model_shape(config))
    # albert: untied's head and a small input side, so untied's rate
    return {"tied": tied, "untied": tied, "albert": tied, "lev": tied / LEV_OVER_TIED_ASSUMED}


def corpus_tokens_estimate(shared_data: str) -> int:
    corpus = Path(shared_data) / "corpus" / "train.jsonl.zst"
    return int(corpus.stat().st_size * TOKENS_PER_COMPRESSED_BYTE) if corpus.exists() else 0


def plan(seconds: float, rates: Dict[str, float], corpus_tokens: int, config: str,
         max_iters: Optional[int] = None, overhead_s: Optional[float] = None, arms=ARMS) -> Dict[str, Any]:
    """Tokens and iterations per arm in ``seconds`` (module doc); ``overhead_s`` replaces the sum of
    OVERHEAD_S (what is still to come once some of it is spent)."""
    shape = model_shape(config)
    per_iter = shape["global_batch"] * shape["seq"]
    missing = [a for a in arms if not rates.get(a)]
    if missing:
        raise Skip(f"no tokens/s for {missing}: the throughput stage did not measure them (give --assume-tflops)")
    overhead = sum(OVERHEAD_S.values()) if overhead_s is None else overhead_s
    train_s = max(0.0, seconds - overhead) * TRAIN_SAFETY
    seconds_per_token = sum(1.0 / rates[a] for a in arms)
    by_time = train_s / seconds_per_token
    tokens, limit = by_time, "time"
    if corpus_tokens and corpus_tokens < tokens:
        tokens, limit = corpus_tokens, "one pass over the corpus"
    iters = int(tokens // per_iter)
    if max_iters is not None and iters > max_iters:
        iters, limit = max_iters, f"at most {max_iters} iterations (these sizes)"
    return {"seconds": seconds, "overhead_s": overhead, "train_s": train_s, "tokens_per_s": dict(rates),
            "iterations": iters, "tokens_per_arm": iters * per_iter, "limited_by": limit,
            "tokens_per_iteration": per_iter, "config": config, "shape": shape}


# ------------------------------------------------------------------------------------------ the run


def _dataset_tokens(prefix: Path) -> int:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))  # held while summing: its lengths are a view of its mmap
    return int(dataset.sequence_lengths.sum())


def run(config: str, shared_data: str, work: Path, out: Path, deadline: float, rates: Dict[str, float],
        max_iters: Optional[int] = None, min_iters: int = 1, partial: Callable[[Dict[str, Any]], None] = lambda f: None,
        clock=time.monotonic, arms=ARMS, seed: str = SEED) -> Dict[str, Any]:
    """Prepare the data, size the runs to what is left before ``deadline`` (``clock`` time), train and
    evaluate tied, untied and lev through ``bench/reproduce.py``; OUT/science.md is its report. Figures:
    the plan, each arm's summary and the validation set's frequency buckets."""
    rep = _reproduce()
    work, out = Path(work), Path(out)
    report = work / "report" / "science.md"
    a = rep.parse_args(["--config", config, "--arms", ",".join(arms), "--seeds", str(seed), "--multi-seed-arms", "",
                        "--work-dir", str(work), "--shared-data", str(shared_data), "--output", str(report)])
    a.deadline = deadline
    figures: Dict[str, Any] = {"config": config, "description": rep.CONFIGS[config]["description"], "steps": {}}

    def step(name: str, fn) -> None:
        t0 = clock()
        try:
            fn()
        except SystemExit as e:  # reproduce's one-line failure
            figures["steps"][name] = {"seconds": round(clock() - t0, 1), "ok": False}
            why = "killed at the deadline" if clock() >= deadline else str(e.code)
            raise CheckFailed(f"science {name}: {why}", figures)
        figures["steps"][name] = {"seconds": round(clock() - t0, 1), "ok": True}
        partial(figures)

    step("preprocess", lambda: rep.prepare_data(a))
    paths = rep.data_paths(a)
    # What is left now, less what is still to come after training.
    rest = sum(v for k, v in OVERHEAD_S.items() if k != "preprocessing")
    figures["plan"] = p = plan(deadline - clock(), rates, _dataset_tokens(paths["train"]), config, max_iters,
                               overhead_s=rest, arms=arms)
    if p["iterations"] < min_iters:
        raise Skip(f"{p['iterations']} iterations fit in {p['seconds']:.0f} s (fewer than {min_iters}): "
                   "not worth a run")
    a.train_iters = p["iterations"]
    runs = rep.runs_of(a)
    step("train_and_evaluate", lambda: rep.train_and_evaluate(a, runs, parallel=len(runs)))
    rows = _write_report(a, report, out, f"python bench/reproduce.py --config {config} --arms {','.join(arms)} --seeds "
                         f"{seed} --multi-seed-arms '' --train-iters {a.train_iters} --work-dir WORK", figures, clock)
    figures["arms"] = {r["arm"]: dict(rep.summary_metrics(r), **r["log"]) for r in rows}
    figures["buckets"] = frequency_buckets(rows)
    figures["report"] = "science.md"
    return figures


def _write_report(a, report: Path, out: Path, command: str, figures: Dict[str, Any], clock) -> List[Dict[str, Any]]:
    """bench/reproduce.py's report of the runs, copied to OUT/science.md (and its loss curves); the runs' rows."""
    rep = _reproduce()
    t0 = clock()
    rows = rep.collect(a)
    rep.build_report(a, rows, report, command, {"machine": _machine(), "load_start": None, "load_end": None})
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(report, out / "science.md")
    curves = report.parent / report.stem / "loss_curves.png"
    if curves.exists():
        shutil.copyfile(curves, out / "science_loss_curves.png")
    figures["steps"]["report"] = {"seconds": round(clock() - t0, 1), "ok": True}
    return rows


def run_paired(config: str, shared_data: str, work: Path, out: Path, deadline: float, arms_by_seed: Dict[int, List[str]],
               max_iters: Optional[int] = None, partial: Callable[[Dict[str, Any]], None] = lambda f: None,
               clock=time.monotonic) -> Dict[str, Any]:
    """The seed-paired science run (``bench/gpu_check.py --program science``): the arms of each seed
    (``arms_by_seed``, the first seed's arms a superset of the others') trained at once, one seed after the
    other, for one pass over the corpus (``max_iters`` at most), every command killed at ``deadline``;
    OUT/science.md is ``bench/reproduce.py``'s report with its seed-paired intervals and learning-curve gap."""
    rep = _reproduce()
    work, out = Path(work), Path(out)
    report = work / "report" / "science.md"
    seeds = list(arms_by_seed)
    first, later = arms_by_seed[seeds[0]], sorted({x for s in seeds[1:] for x in arms_by_seed[s]}, key=rep.ARMS.index)
    if any(arms_by_seed[s] != later for s in seeds[1:]) or not set(later) <= set(first):
        raise CheckFailed(f"arms by seed {arms_by_seed}: the later seeds must share one set of arms, within the first's")
    a = rep.parse_args(["--config", config, "--arms", ",".join(first), "--seeds", ",".join(map(str, seeds)),
                        "--multi-seed-arms", ",".join(later), "--work-dir", str(work), "--shared-data", str(shared_data),
                        "--output", str(report)])
    a.deadline = deadline
    figures: Dict[str, Any] = {"config": config, "description": rep.CONFIGS[config]["description"], "steps": {},
                               "arms_by_seed": {str(k): v for k, v in arms_by_seed.items()}}

    def step(name: str, fn) -> None:
        t0 = clock()
        try:
            fn()
        except SystemExit as e:
            figures["steps"][name] = {"seconds": round(clock() - t0, 1), "ok": False}
            raise CheckFailed(f"science {name}: {'killed at the deadline' if clock() >= deadline else e.code}", figures)
        figures["steps"][name] = {"seconds": round(clock() - t0, 1), "ok": True}
        partial(figures)

    step("preprocess", lambda: rep.prepare_data(a))
    per_iter = rep._tokens_per_step(rep.CONFIGS[config])
    a.train_iters = _dataset_tokens(rep.data_paths(a)["train"]) // per_iter
    if max_iters is not None:
        a.train_iters = min(a.train_iters, max_iters)
    figures["iterations"], figures["tokens_per_arm"] = a.train_iters, a.train_iters * per_iter
    runs = rep.runs_of(a)
    step("train_and_evaluate", lambda: rep.train_and_evaluate(a, runs, parallel=len(first)))
    rows = _write_report(a, report, out, f"python bench/reproduce.py --config {config} --arms {','.join(first)} --seeds "
                         f"{','.join(map(str, seeds))} --multi-seed-arms {','.join(later)} --train-iters {a.train_iters} "
                         "--work-dir WORK", figures, clock)
    figures["contrasts"] = {name: [{"contrast": f"{d['a']}-{d['b']}", "seeds": d["seeds"], "mean": d["t"].mean,
                                    "t95": [d["t"].lo, d["t"].hi], "bootstrap95": [d["documents"].lo, d["documents"].hi],
                                    "statement": d["statement"]} for d in rep.paired_differences(rows, name)]
                            for name, _ in rep.SETS}
    figures["curve_gaps"] = [{"contrast": f"{g['a']}-{g['b']}", "windows": [[iv.mean, iv.lo, iv.hi] for iv in g["windows"]]}
                             for g in rep.curve_gaps(rows)]
    figures["arms"] = {r["name"]: dict(rep.summary_metrics(r), **r["log"]) for r in rows}
    figures["report"] = "science.md"
    return figures


def _machine() -> str:
    try:
        import torch

        return f"{os.cpu_count()} CPUs, torch {torch.__version__}, " + (
            f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU")
    except Exception:
        return f"{os.cpu_count()} CPUs"


def frequency_buckets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Validation PPL per training-frequency bucket of each arm (the evaluation suite's buckets)."""
    table: Dict[str, Dict[str, Any]] = {}
    for r in rows:
        per = ((r.get("eval") or {}).get("perplexity") or {}).get("valid") or {}
        for b in per.get("frequency_buckets") or []:
            row = table.setdefault(b["bucket"], {"bucket": b["bucket"], "tokens": b.get("tokens"), "ppl": {}})
            row["ppl"][r["arm"]] = b.get("ppl")
    return list(table.values())


def markdown(figures: Dict[str, Any]) -> List[str]:
    """The science figures as markdown lines (bench/gpu_check.py's report)."""
    L: List[str] = []
    p = figures.get("plan")
    if p:
        rates = ", ".join(f"{a} {p['tokens_per_s'][a]:,.0f}" for a in ARMS)
        L += [f"{figures['description']}; {p['iterations']} iterations = {p['tokens_per_arm']:,} tokens per arm "
              f"(limited by {p['limited_by']}; {p['train_s']:.0f} s of training planned at tokens/s {rates}).", ""]
    arms = figures.get("arms") or {}
    if arms:
        L += ["| arm | valid PPL | zero-shot PPL | train loss (last 10%) | ms/iter | tokens/s |", "|---|---|---|---|---|---|"]
        for arm in ARMS:
            s = arms.get(arm) or {}
            L.append(f"| {arm} | {_f(s.get('valid_ppl'), 2)} | {_f(s.get('zeroshot_ppl'), 2)} | "
                     f"{_f(s.get('final_train_loss'), 3)} | {_f(s.get('ms_per_iter'), 0)} | {_f(s.get('tokens_per_s'), 0)} |")
        L.append("")
    buckets = figures.get("buckets") or []
    if buckets:
        L += ["Validation PPL by the target token's frequency in the training set:", "",
              "| bucket | tokens | " + " | ".join(ARMS) + " | lev vs tied | lev vs untied |", "|---|---|---|---|---|---|---|"]
        for b in buckets:
            ppl = b["ppl"]
            L.append(f"| {b['bucket']} | {_f(b['tokens'], 0)} | " + " | ".join(_f(ppl.get(a), 2) for a in ARMS)
                     + f" | {_rel(ppl.get('lev'), ppl.get('tied'))} | {_rel(ppl.get('lev'), ppl.get('untied'))} |")
        L.append("")
    L += [f"- {k}: {v['seconds']} s{'' if v['ok'] else ' (failed)'}" for k, v in figures.get("steps", {}).items()]
    return L


def _f(v, d: int) -> str:
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return "–" if v is None else f"{v:,.{d}f}"


def _rel(a, b) -> str:
    return "–" if not a or not b else f"{100 * (a / b - 1):+.1f}%"


def _rates(text: str) -> Dict[str, float]:
    try:
        return {k: float(v) for k, v in (x.split("=") for x in text.split(",") if x)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens-per-s wants ARM=RATE,... (got {text!r})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of science.md")
    p.add_argument("--work", required=True, help="preprocessed data, checkpoints, logs")
    p.add_argument("--shared-data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--config", default="gpu-science", help="a bench/reproduce.py configuration (default gpu-science)")
    p.add_argument("--seconds", type=float, required=True, help="the whole run's time, preprocessing to report")
    p.add_argument("--assume-tflops", type=float, default=None, help="achieved TFLOP/s to size the runs with")
    p.add_argument("--tokens-per-s", type=_rates, default=None, help="measured tokens/s per arm: tied=R,untied=R,lev=R")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list (default {','.join(ARMS)})")
    p.add_argument("--seeds", default=SEED, help="comma list; with several, every arm runs with every seed, the "
                   "arms of a seed at once, and the report gives seed-paired intervals (one pass over the corpus "
                   "each: not sized to --seconds)")
    a = p.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in _reproduce().ARMS]
    if bad or not arms:
        p.error(f"--arms {a.arms}: choose from {','.join(_reproduce().ARMS)}")
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x]
    except ValueError:
        seeds = []
    if not seeds:
        p.error(f"--seeds {a.seeds!r}: expected comma-separated integers")
    if a.config not in _reproduce().CONFIGS:
        p.error(f"--config {a.config}: not a bench/reproduce.py configuration ({', '.join(_reproduce().CONFIGS)})")
    if (a.assume_tflops is None) == (a.tokens_per_s is None):
        p.error("give one of --assume-tflops or --tokens-per-s (the rates the runs are sized with)")
    rates = a.tokens_per_s or assumed_rates(a.config, a.assume_tflops)
    deadline = time.monotonic() + a.seconds
    try:
        if len(seeds) > 1:
            figures = run_paired(a.config, a.shared_data, Path(a.work), Path(a.out), deadline, {s: arms for s in seeds})
        else:
            figures = run(a.config, a.shared_data, Path(a.work), Path(a.out), deadline, rates, arms=arms, seed=str(seeds[0]))
    except (Skip, CheckFailed) as e:
        raise SystemExit(f"bench/gpu_science.py: {e}")
    print("\n".join(markdown(figures)))
    print(json.dumps(figures.get("plan"), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
