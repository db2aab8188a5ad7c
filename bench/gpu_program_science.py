"""``bench/gpu_check.py --program science``: the seed-paired science run in one device window.

    python bench/gpu_check.py --program science --plan                 # what runs, and that it fits
    python bench/gpu_check.py --program science --out OUT --wheels wheels --shared-data .cache/gpu_data
    python bench/gpu_check.py --program science --out OUT --sizes tiny --budget-s 4000   # on a CPU

tied, untied, albert and lev on two seeds the earlier GPU runs did not use, at the science shape and token
budget of the default program (``bench/reproduce.py --config gpu-science``: 8 x 512, sequence 1024, 64 x 1024
tokens per step, one pass over the corpus), the arms of a seed at once and the seeds one after the other
(``gpu_science.run_paired``). The report (OUT/science.md) gives the seed-paired differences with their
intervals, the exposure buckets, the per-group gradient norms and clip rate, and the within-run
learning-curve gap (paired training losses in five windows).

Sizing (``plan``): each run's training time is its tokens over its arm's tokens/s measured alone on an H100
at this shape (``MEASURED``, the throughput stage of docs/results/gpu_check_h100_2026-12-06; albert at
untied's rate: the same head, a small input side), the arms of a seed sharing the device (their seconds
add up), times ``RATE_SAFETY``; to that the fixed costs (``FIXED_S``) and, per seed, ``GROUP_S`` (start-ups,
checkpoints, the full-set evaluations: the default program's H100 science stage took 199 s for 151 s of
training so planned, plus the full sets). Training is never shortened: where the runs do not fit the
budget, runs are dropped in ``DROP_ORDER`` (untied then tied of the second seed, then of the first; lev and
albert, the parameter-matched contrast, stay on both seeds), and a plan that does not fit even then is
refused. The budget (``BUDGET_S``) is one command under the device's 600 s limit, which leaves
``WINDOW_S - BUDGET_S`` of the 15-minute window for the machine's start and the carried files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import gpu_check
import gpu_science
from _check_harness import Skip
from gpu_check import REPO, SHARED, Ctx, Stage, in_child

ARMS = ("tied", "untied", "albert", "lev")
SEEDS = (2101, 2102)  # new seeds: the default program's science stage runs 1234
DROP_ORDER = (("untied", 1), ("tied", 1), ("untied", 0), ("tied", 0))  # (arm, index of its seed), first dropped first
MEASURED = REPO / "docs" / "results" / "gpu_check_h100_2026-12-06" / "gpu_check.json"
MEASURED_SHAPE = "science (gpu-science)"
BUDGET_S = 580.0
WINDOW_S = 900.0
RATE_SAFETY = 1.1
FIXED_S = {"env": 15.0, "preprocess": 16.0, "report": 5.0}
GROUP_S = 70.0  # per seed: start-ups, checkpoints, full-set evaluations (measured 48 s with 262,144-token sets)

SIZES: Dict[str, Dict[str, Any]] = {
    "device": dict(science=dict(config="gpu-science", max_iters=None), seeds=SEEDS),
    "tiny": dict(science=dict(config="gpu-science-tiny", max_iters=3), seeds=SEEDS),
}


def measured_rates(path: Path = MEASURED) -> Dict[str, float]:
    """tokens/s per arm at the science shape from a recorded check (albert at untied's rate)."""
    report = json.loads(Path(path).read_text())
    throughput = next(s for s in report["stages"] if s["name"] == "throughput")
    arms = throughput["figures"]["shapes"][MEASURED_SHAPE]["arms"]
    rates = {arm: float(arms[arm]["tokens_per_s"]) for arm in ("tied", "untied", "lev")}
    rates["albert"] = rates["untied"]
    return rates


def size_runs(budget_s: float, rates: Dict[str, float], tokens_per_arm: int, seeds=SEEDS) -> Dict[str, Any]:
    """The runs that fit ``budget_s`` at ``rates`` (tokens/s per arm), dropping in DROP_ORDER: the arms of
    each seed, the dropped runs, each seed's planned seconds and the total."""
    kept = {i: list(ARMS) for i in range(len(seeds))}
    dropped: List[str] = []

    def seconds() -> Dict[int, float]:
        return {i: GROUP_S + RATE_SAFETY * sum(tokens_per_arm / rates[a] for a in arms) for i, arms in kept.items()}

    order = list(DROP_ORDER)
    while sum(FIXED_S.values()) + sum(seconds().values()) > budget_s - gpu_check.RESERVE_S and order:
        arm, i = order.pop(0)
        kept[i].remove(arm)
        dropped.append(f"{arm} (seed {seeds[i]})")
    per_seed = seconds()
    total = sum(FIXED_S.values()) + sum(per_seed.values())
    return {"arms_by_seed": {seeds[i]: arms for i, arms in kept.items()}, "dropped": dropped,
            "seconds_by_seed": {seeds[i]: s for i, s in per_seed.items()}, "total_s": total,
            "fits": total <= budget_s - gpu_check.RESERVE_S}


def _tokens_per_arm(sizes: str, shared_data: str) -> int:
    s = SIZES[sizes]["science"]
    per_iter = gpu_science.model_shape(s["config"])
    per_iter = per_iter["global_batch"] * per_iter["seq"]
    iters = gpu_science.corpus_tokens_estimate(shared_data) // per_iter
    return (iters if s["max_iters"] is None else min(iters, s["max_iters"])) * per_iter


def plan(budget_s: float, sizes: str = "device", assume_tflops: Optional[float] = None,
         shared_data: str = str(SHARED)) -> List[Dict[str, Any]]:
    s = SIZES[sizes]["science"]
    rates = (gpu_science.assumed_rates(s["config"], assume_tflops) if assume_tflops else measured_rates())
    tokens = _tokens_per_arm(sizes, shared_data)
    runs = size_runs(budget_s, rates, tokens, SIZES[sizes]["seeds"])
    what = (f"{', '.join(ARMS)} by seed {runs['arms_by_seed']}, bench/reproduce.py --config {s['config']} "
            f"({gpu_science._reproduce().CONFIGS[s['config']]['description']}), {tokens:,} tokens per run (one pass"
            + (f", at most {s['max_iters']} iterations" if s["max_iters"] else "") + "); "
            + (f"dropped to fit: {', '.join(runs['dropped'])}" if runs["dropped"] else "no run dropped")
            + f"; {runs['total_s']:.0f} s planned of {budget_s:g} (per seed "
            + ", ".join(f"{k}: {v:.0f} s" for k, v in runs["seconds_by_seed"].items()) + ") at tokens/s "
            + ", ".join(f"{a} {rates[a]:,.0f}" for a in ARMS)
            + (f" (--assume-tflops {assume_tflops:g})" if assume_tflops else f" (measured: {MEASURED.relative_to(REPO)})")
            + ("" if runs["fits"] else "; DOES NOT FIT even with every drop"))
    env_s = FIXED_S["env"] * budget_s / BUDGET_S  # in proportion, as the default program's stages
    return [{"name": "env", "planned_s": env_s, "what": "the carried wheels, versions, the LEV basis"},
            {"name": "science", "planned_s": budget_s - gpu_check.RESERVE_S - env_s, "what": what,
             "runs": runs, "rates": rates, "tokens_per_arm": tokens}]


def plan_lines(entries: List[Dict[str, Any]], budget_s: float, sizes: str, assume_tflops: Optional[float]) -> List[str]:
    return ([f"plan: program science, budget {budget_s:g} s at the {sizes} sizes (one command; "
             f"{WINDOW_S - budget_s:g} s of the {WINDOW_S:g} s device window left for its start and the carry), "
             f"{gpu_check.RESERVE_S:g} s kept for the last report write"]
            + [f"stage {e['name']}: planned {e['planned_s']:.0f} s - {e['what']}" for e in entries])


def stage_seconds(budget_s: float) -> Dict[str, float]:
    return {e["name"]: e["planned_s"] for e in plan(budget_s, "device", None, str(SHARED))}


def child_science(ctx: Ctx, partial) -> Dict[str, Any]:
    s = ctx.size["science"]
    left = (ctx.deadline or time.monotonic() + 600.0) - time.monotonic()
    sized = plan(left + FIXED_S["env"], ctx.sizes, ctx.assume_tflops, ctx.shared_data)[1]
    if not sized["runs"]["fits"]:
        raise Skip(f"the science runs do not fit the {left:.0f} s left, even with {', '.join(sized['runs']['dropped'])} "
                   "dropped (training is not shortened)")
    deadline = (ctx.deadline or time.monotonic() + 600.0) - gpu_check.SCIENCE_END_S
    figures = gpu_science.run_paired(s["config"], ctx.shared_data, Path(ctx.work) / "science", Path(ctx.out), deadline,
                                     sized["runs"]["arms_by_seed"], max_iters=s["max_iters"], partial=partial)
    figures.update(planned=sized["runs"], rates=sized["rates"])
    return figures


def markdown_science(f: Dict[str, Any]) -> List[str]:
    L = [f"{f.get('description', '')}; {f.get('iterations', '–')} iterations = {f.get('tokens_per_arm', 0):,} tokens per "
         f"run; arms by seed {f.get('arms_by_seed')}" + (f"; dropped to fit: {', '.join(f['planned']['dropped'])}"
                                                        if (f.get("planned") or {}).get("dropped") else ""), ""]
    for name, rows in (f.get("contrasts") or {}).items():
        L += [f"{name}:", ""] + [r["statement"] for r in rows] + [""]
    gaps = f.get("curve_gaps") or []
    if gaps:
        k = len(gaps[0]["windows"])
        L += [f"Learning-curve gap (training loss A - B, {k} windows, mean over seeds):", "",
              "| A - B | " + " | ".join(f"window {i + 1}" for i in range(k)) + " |", "|---|" + "---|" * k]
        L += [f"| {g['contrast']} | " + " | ".join(f"{w[0]:+.3f}" for w in g["windows"]) + " |" for g in gaps]
        L.append("")
    L += [f"- {k}: {v['seconds']} s{'' if v['ok'] else ' (failed)'}" for k, v in (f.get("steps") or {}).items()]
    return L


CHILD_FUNCS = {"env": gpu_check.child_env, "science": child_science}
STAGES = (Stage("env", gpu_check.stage_env, cuda=False), Stage("science", in_child("science"), rest=True))
MARKDOWN = {"science": markdown_science}
