#!/usr/bin/env python
"""The one-GPU check: what this project can only learn on a CUDA device, in one command that fits a
7-minute window (``--budget-s 400`` runs inside a 420 s command limit).

    python bench/gpu_check.py --out OUT [--budget-s 400] [--wheels wheels] [--shared-data DIR] [--only a,b] [--skip a,b]
    python bench/gpu_check.py --plan --budget-s 400 --assume-tflops 250   # the plan, no GPU needed
    python bench/gpu_check.py --prepare-wheels wheels        # here (with PyPI): the wheels the GPU box lacks
    python bench/gpu_check.py --prepare-data .cache/gpu_data  # here: the shared data the stages read, to carry
    python bench/gpu_check.py --out OUT --sizes tiny --budget-s 2000     # every stage at tiny sizes (CPU too)
    python bench/gpu_check.py --program NAME ...   # another program's stages (PROGRAMS), same options

Programs: ``PROGRAMS`` maps a name to the module that holds its stages. ``default`` is this module (the
stages below); another program is a module ``bench/gpu_program_<name>.py`` with ``STAGES`` (a tuple of
``Stage``) and ``plan(budget_s, sizes, assume_tflops, shared_data)`` (one entry per stage: name,
planned_s, what), and optionally ``BUDGET_S``, ``SIZES``, ``stage_seconds``, ``plan_lines``,
``CHILD_FUNCS`` (what ``in_child`` runs), ``MARKDOWN`` (each stage's report section) and
``not_run_notes`` (``load_program`` says what stands in for each). ``--plan``, ``--only``, ``--skip``,
``--sizes`` and the report work per program.

Stages, in the order of what each figure is worth, each with its own time limit (``BASE_S`` at a 400 s
budget, in proportion at others; ``plan``):

  env          the carried wheels installed where missing (``pip --no-index --no-deps --target WORK/site``);
               versions, the device, the C compiler and Python headers Triton builds its launcher with,
               the LEV basis that will run (``--lev-basis auto`` resolved after the kernels register), the
               measured bf16 matrix rate and copy bandwidth.
  correctness  ``pretrain_lev.py`` at a GPU shape, bf16, distributed optimizer with overlapped grad reduce,
               a few steps each of LEV with the fused basis that runs (``--lev-basis triton`` on CUDA), LEV
               with the eager basis and tied, the three at once: the first iteration's loss and grad norm
               of the two LEV runs must agree (``LOSS_RTOL``, ``GRAD_NORM_RTOL``).
  kernels      the fused product alone (``megatron_lev.kernels.lev_timing``): CUDA-event medians of the
               forward and of each backward variant, at the defaults and at the tensor-parallel rank with
               several id partitions, and each variant against the fp64 eager product.
  throughput   tied, untied and LEV's default arm on one process, round-robin medians (``bench/throughput.py``'s
               ``measure``) with SDPA's flash/cuDNN attention: at the science model's shape first (its
               tokens/s size the science run), then gpu-400m.
  profile      a 2-step torch.profiler trace of ``pretrain_lev.py`` (LEV, production flags, gpu-400m): the
               share of step time in LEV's Triton kernels, LEV's GEMMs and the rest, and host syncs per
               step (``bench/_profile_trace.py``).
  science      what is left (at least 200 s of a 400 s budget): tied, untied and lev, same data, order and
               seed, through ``bench/reproduce.py`` (``bench/gpu_science.py``), tokens per arm sized from the
               throughput stage; validation and zero-shot perplexity with the frequency buckets.

``--sizes tiny`` runs every stage at tiny shapes (the CPU stands in for the device: eager or numba bases,
Triton's interpreter, gloo), so the first run on a device is not the first run. A stage that needs CUDA
at the device sizes is skipped with "no CUDA device" where there is none.

Budget: a stage runs under min(its limit, what is left); every stage is a child process or subprocess
whose process group is killed at it. Output: ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``, rewritten
(tmp file + rename) before the first stage and after every stage, so a killed run keeps what it learnt;
``throughput.md``, ``science.md`` and ``science_loss_curves.png`` beside them (the device returns at most
8 files). Logs and scratch files go to ``--work`` (default ``OUT/../gpu_check_work``). The JSON:
``{"state": "running"|"done", "created", "command", "program", "budget_s", "sizes", "elapsed_s", "plan", "stages":
[{"name", "status": ok|failed|skipped, "reason", "planned_s", "limit_s", "seconds", "figures", "log_tail"}],
"pending": [...], "not_run": [...]}``. Exit status 0 when no stage failed.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _check_harness import (CheckFailed, CheckTimeout, Skip, TIMEOUT_RC, run_logged, run_parallel,  # noqa: E402
                            tail, write_json, write_text)

# Program name -> the module holding its STAGES and plan (see the docstring); imported when chosen.
PROGRAMS: Dict[str, str] = {
    "default": "gpu_check",
    "science": "gpu_program_science",
    "speed": "gpu_program_speed",
    "te": "gpu_program_te",
}

SHARED = REPO.parent / "shared" / "data"
# What a bare GPU image (torch, triton, transformers, tokenizers, sentencepiece, safetensors) may lack;
# megatron-core is the newest release make test-next tests (the Makefile's MCORE_NEXT), so the device runs
# what CI runs.
WHEELS = ("megatron-core>=0.19,<0.20", "tiktoken", "zstandard", "psutil", "pyyaml")
MODULE_OF = {"megatron-core": "megatron.core", "pyyaml": "yaml", "transformer-engine-cu13": "transformer_engine",
             "nvidia-cudnn-frontend": "cudnn"}
PLAN_BUDGET_S = 400.0
BUDGET_S = PLAN_BUDGET_S  # the default program's --budget-s
# Each stage's limit at a 400 s budget (in proportion at others); the science stage gets the rest.
BASE_S = {"env": 15.0, "correctness": 55.0, "kernels": 30.0, "throughput": 50.0, "profile": 40.0}
RESERVE_S = 5.0  # kept back from the budget for the last report write
SCIENCE_END_S = 10.0  # the science run's commands end this long before its limit (its report, its result)
LOSS_RTOL = 1e-3  # first-iteration loss, fused vs eager LEV basis: only the product's fp32 rounding differs
GRAD_NORM_RTOL = 1e-2  # first-iteration grad norm, likewise (bf16 gradients amplify the rounding)
PRODUCTION = ("--use-distributed-optimizer", "--overlap-grad-reduce")
# The correctness runs leave megatron's torch.compile'd fusions out: they are not on LEV's path, and three
# cold compiles at once would spend the stage's limit (the throughput, profile and science stages keep them).
NO_COMPILED_FUSIONS = ("--no-bias-dropout-fusion", "--no-bias-swiglu-fusion")
LINE_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                     r".*?TFLOP/s/GPU\): ([\d.]+) \|.*?tokens per second: ([\d.]+) \|")
MEM_RE = re.compile(r"mem allocated \(GiB\): ([\d.]+)")


def _model(layers: int, hidden: int, heads: int, seq: int, mb: int, gb: int, vocab: int) -> List[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(mb),
            "--global-batch-size", str(gb), "--mock-data", "--vocab-size", str(vocab)]


# Every size the stages use. "device": one H200; "tiny": the same stages on a CPU in seconds.
SIZES: Dict[str, Dict[str, Any]] = {
    "device": dict(
        correctness=dict(model=_model(4, 1024, 16, 1024, 4, 8, 50257), steps=4,
                         describe="4 x 1024, seq 1024, 2 micro-batches of 4"),
        kernels=dict(shapes=None, reps=20, warmup=3),  # None: lev_timing.default_shapes()
        throughput=dict(configs=("gpu-400m",), repeats=5, warmup=1),
        profile=dict(model=_model(24, 1024, 16, 2048, 4, 4, 50257), steps=5, window=(3, 5),
                     describe="gpu-400m: 24 x 1024, seq 2048, micro-batch 4"),
        science=dict(config="gpu-science", max_iters=None, min_iters=30),
        precision=["--bf16"], lev=[],
    ),
    "tiny": dict(
        correctness=dict(model=_model(1, 32, 2, 32, 2, 4, 1000), steps=3, describe="1 x 32, seq 32, 2 micro-batches of 2"),
        kernels=dict(shapes=(("tiny", 40, 2, 3, 5, 6),), reps=2, warmup=1),
        throughput=dict(configs=(), repeats=1, warmup=1),
        profile=dict(model=_model(1, 32, 2, 32, 2, 2, 1000), steps=4, window=(2, 4), describe="1 x 32, seq 32"),
        science=dict(config="gpu-science-tiny", max_iters=3, min_iters=1),
        precision=["--bf16"], lev=["--lev-heads", "2", "--lev-seed-dim", "8", "--lev-knots", "5", "--lev-rank", "4",
                                   "--lev-init-sample-size", "4096"],
    ),
}


def _transformer() -> List[str]:
    from reproduce import TRANSFORMER  # the Llama-style transformer every bench run shares (dropout 0)

    return list(TRANSFORMER)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[["Ctx", float], Dict[str, Any]]
    """run(ctx, limit_s) -> figures; raises Skip, CheckFailed or CheckTimeout."""
    cuda: bool = True
    """At the device sizes, skipped with "no CUDA device" where torch sees none."""
    rest: bool = False
    """Its limit is what is left of the budget, not its planned share (the default program's science)."""


@dataclass
class Ctx:
    out: str
    work: str
    wheels: Optional[str]
    shared_data: str
    sizes: str
    cuda: bool
    assume_tflops: Optional[float] = None
    site: Optional[str] = None  # WORK/site once env installed something there
    timeout_s: Optional[float] = None  # the running child's limit
    deadline: Optional[float] = None  # and its end in time.monotonic() (one clock for every process)
    results: Optional[Dict[str, Dict[str, Any]]] = None  # earlier stages' entries, by name
    program: str = "default"  # whose stages run (PROGRAMS); a child runs that program's CHILD_FUNCS

    @property
    def size(self) -> Dict[str, Any]:
        return load_program(self.program).sizes[self.sizes]

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def env(self, **extra: str) -> Dict[str, str]:
        """The environment of every child: WORK/site and the repository first on the import path."""
        path = [p for p in (self.site, str(REPO), os.environ.get("PYTHONPATH")) if p]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(path), **extra)
        if not self.cuda:  # the CPU stand-in: the children share its cores (several run at once)
            env.setdefault("OMP_NUM_THREADS", "1")
        # One compile cache for every child: each run's first step would otherwise recompile the Triton
        # kernels and megatron's torch.compile'd fusions from nothing.
        env.setdefault("TRITON_CACHE_DIR", os.path.join(self.work, "triton_cache"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(self.work, "inductor_cache"))
        return env

    def figures(self, name: str, partial: bool = False) -> Dict[str, Any]:
        """An earlier stage's figures if it passed (``partial``: also what a failed or killed one measured)."""
        entry = (self.results or {}).get(name) or {}
        return entry.get("figures", {}) if entry.get("status") == "ok" or partial else {}


# --------------------------------------------------------------------------------------- children


def in_child(name: str, **extra_env: str) -> Callable[[Ctx, float], Dict[str, Any]]:
    """Run the program's CHILD_FUNCS[name](ctx, partial) in a fresh process (its own CUDA context, killable at the limit).

    The child writes its figures (or its error) to a JSON file; it may rewrite that file while it runs
    (``partial``), so a timeout still reports what it measured."""

    def run(ctx: Ctx, timeout: float) -> Dict[str, Any]:
        work = Path(ctx.work)
        ctx_file, result = work / f"{name}.ctx.json", work / f"{name}.result.json"
        result.unlink(missing_ok=True)
        ctx.timeout_s, ctx.deadline = timeout, time.monotonic() + timeout
        write_json(ctx_file, ctx.__dict__)
        rc, output = run_logged([sys.executable, str(Path(__file__).resolve()), "--program", ctx.program, "--child", name,
                                 "--child-ctx", str(ctx_file), "--child-result", str(result)], timeout,
                                work / "logs" / f"{name}.log", ctx.env(**extra_env))
        res = json.loads(result.read_text()) if result.exists() else {}
        figures = res.get("figures", {})
        if rc == TIMEOUT_RC:
            raise CheckTimeout(timeout, figures, tail(output))
        if res.get("status") == "skipped":
            raise Skip(res["reason"], figures)
        if res.get("status") == "failed":
            raise CheckFailed(res["reason"], figures)
        if rc != 0 or res.get("status") != "ok":
            raise CheckFailed(f"child exited {rc} without a result: {tail(output, 400)}", figures)
        return figures

    return run


def child_main(name: str, ctx_file: str, result_file: str) -> int:
    ctx = Ctx(**json.loads(Path(ctx_file).read_text()))
    out = Path(result_file)

    def partial(figures: Dict[str, Any]) -> None:
        write_json(out, {"status": "running", "figures": figures})

    try:
        figures = load_program(ctx.program).children[name](ctx, partial)
        write_json(out, {"status": "ok", "figures": figures})
    except Skip as e:
        write_json(out, {"status": "skipped", "reason": str(e), "figures": e.figures})
    except CheckFailed as e:
        write_json(out, {"status": "failed", "reason": str(e), "figures": e.figures})
    except Exception as e:  # reported in the file, never hidden
        import traceback

        traceback.print_exc()
        write_json(out, {"status": "failed", "reason": f"{type(e).__name__}: {e}"})
    return 0


# ------------------------------------------------------------------------------------------ 1. env


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None and bool(__import__(module))
    except Exception:
        return False


def _dist(wheel: str) -> str:
    return Path(wheel).name.split("-")[0].replace("_", "-").lower()


def _wheels_twice(folder: Optional[str]) -> Optional[Tuple[str, List[str]]]:
    """(distribution, its wheels) of the first distribution with several wheels in ``folder``: pip would refuse."""
    by: Dict[str, List[str]] = {}
    for w in sorted(glob.glob(os.path.join(folder or "", "*.whl"))) if folder else []:
        by.setdefault(_dist(w), []).append(Path(w).name)
    return next(((d, ws) for d, ws in by.items() if len(ws) > 1), None)


def install_wheels(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    """``pip install --no-index --no-deps --target WORK/site`` of the wheels whose module is missing."""
    wheels = sorted(glob.glob(os.path.join(ctx.wheels or "", "*.whl"))) if ctx.wheels else []
    if not wheels:
        return {"wheels": f"none in {ctx.wheels}"}
    missing, present = [], []
    for w in wheels:
        dist = _dist(w)
        (present if _importable(MODULE_OF.get(dist, dist.replace("-", "_"))) else missing).append(Path(w).name)
    if not missing:
        return {"installed": [], "already_importable": present}
    site = Path(ctx.work) / "site"
    rc, output = run_logged([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--no-cache-dir", "--upgrade", "--target", str(site),
                             *[os.path.join(ctx.wheels, m) for m in missing]],
                            timeout, Path(ctx.work) / "logs" / "install.log")
    if rc == TIMEOUT_RC:
        raise CheckTimeout(timeout, log_tail=tail(output))
    if rc != 0:
        raise CheckFailed(f"pip install exit {rc}: {tail(output, 400)}")
    ctx.site = str(site)
    sys.path.insert(0, ctx.site)  # this process reads bench/reproduce.py's configurations too
    return {"installed": missing, "already_importable": present, "target": str(site)}


def stage_env(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    t0 = time.monotonic()
    installed = install_wheels(ctx, timeout)
    figures = in_child("env")(ctx, timeout - (time.monotonic() - t0))
    return dict(figures, install=installed)


def child_env(ctx: Ctx, partial) -> Dict[str, Any]:
    import torch

    figures: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    for mod in ("megatron.core", "transformer_engine", "apex", "triton", "numba"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            figures[mod] = str(getattr(m, "__version__", "yes"))
        except Exception as e:
            figures[mod] = f"not importable ({type(e).__name__})"
    import sysconfig

    from megatron_lev.kernels import register_default_kernels, triton_build_missing

    figures["c_compiler"] = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    figures["python_headers"] = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    figures["triton_build_missing"] = triton_build_missing()
    register_default_kernels()
    from megatron_lev.lev import LEVConfig
    from megatron_lev.lev.functional import has_fused_product

    device = "cuda" if torch.cuda.is_available() else "cpu"
    figures["lev_basis"] = LEVConfig().resolved_basis(device)
    figures["lev_fused_registered"] = bool(has_fused_product(device))
    from megatron_lev.kernels import lev_triton

    figures["triton_backward"] = {"default": lev_triton.DEFAULT_BACKWARD, "variants": list(lev_triton.BACKWARD_VARIANTS)}
    if device == "cpu":
        figures["device"] = None
        return figures
    props = torch.cuda.get_device_properties(0)
    figures.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   sdpa={"flash": torch.backends.cuda.flash_sdp_enabled(),
                         "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                         "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled()})
    partial(figures)
    figures.update(measure_ceilings())
    return figures


def measure_ceilings() -> Dict[str, float]:
    """bf16 matrix rate (8192^3 on random data) and device-to-device copy bandwidth (bytes read + written)."""
    import torch

    def timed(fn, reps):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    t_mm = timed(lambda: a @ b, 10)
    del a, b
    src = torch.randn(2**29 // 2, device="cuda")  # 1 GiB of fp32
    dst = torch.empty_like(src)
    t_cp = timed(lambda: dst.copy_(src), 10)
    return {"bf16_matmul_tflops": round(2 * n**3 / t_mm / 1e12, 1),
            "copy_tb_per_s": round(2 * src.numel() * 4 / t_cp / 1e12, 2)}


# ---------------------------------------------------------------------------------- 2. correctness


def lev_bases(ctx: Ctx) -> Tuple[str, str]:
    """(the fused basis that runs, the eager basis it is compared with), from the env stage."""
    basis = ctx.figures("env").get("lev_basis")
    if basis is None:
        raise Skip("the env stage did not say which LEV basis runs")
    return basis, "dense" if basis == "sparse" else "sparse"


def correctness_runs(ctx: Ctx) -> Dict[str, List[str]]:
    """name -> the pretrain_lev.py argv of each run (the metrics file is added by the stage)."""
    size = ctx.size
    fused, eager = lev_bases(ctx)
    c = size["correctness"]
    base = ["pretrain_lev.py", *c["model"], *_transformer(), *size["precision"], *PRODUCTION, *NO_COMPILED_FUSIONS,
            "--train-iters", str(c["steps"]), "--lr", "3e-4", "--lr-warmup-iters", "1", "--seed", "1234",
            "--log-interval", "1", "--eval-iters", "0", "--quiet-config"]
    return {f"lev_{fused}": base + ["--input-embedding", "lev", "--lev-basis", fused, *size["lev"]],
            f"lev_{eager}": base + ["--input-embedding", "lev", "--lev-basis", eager, *size["lev"]],
            "tied": base + ["--input-embedding", "tied"]}


def parse_training(log_text: str, metrics_file: Path) -> Dict[str, Any]:
    """Per-iteration loss and grad norm (the metrics file) and the log lines' ms, TFLOP/s and tokens/s
    (medians over the iterations after the first two, which compile and warm up)."""
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()] if metrics_file.exists() else []
    train = [r for r in rows if r.get("kind") == "train"]
    lines = LINE_RE.findall(log_text)
    out: Dict[str, Any] = {"iterations": len(train), "losses": [r["lm loss"] for r in train],
                           "grad_norms": [r.get("grad norm") for r in train]}
    steady = lines[2:] or lines
    if steady:
        out.update(median_ms=statistics.median(float(x[1]) for x in steady),
                   median_tflops=statistics.median(float(x[2]) for x in steady),
                   median_tokens_per_s=statistics.median(float(x[3]) for x in steady),
                   total_step_s=sum(float(x[1]) for x in lines) / 1e3)
    mem = MEM_RE.findall(log_text)
    if mem:
        out["max_allocated_gib"] = float(mem[-1])
    return out


def _gap(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return abs(a - b) / abs(b) if a is not None and b else None


def judge_correctness(runs: Dict[str, Dict[str, Any]], fused: str, eager: str, steps: int) -> Dict[str, Any]:
    """Every run complete with finite losses; the fused LEV run's first loss and grad norm within
    LOSS_RTOL / GRAD_NORM_RTOL of the eager run's. Raises CheckFailed with the figures."""
    problems = []
    for name, r in runs.items():
        losses = [x for x in r["losses"] if x is not None]
        if r["exit"] != 0:
            problems.append(f"{name}: exit {r['exit']}: {r.get('tail', '')[-300:]}")
        elif r["iterations"] != steps:
            problems.append(f"{name}: {r['iterations']} of {steps} iterations recorded")
        elif not losses or not all(math.isfinite(x) for x in losses):
            problems.append(f"{name}: non-finite or missing losses {r['losses']}")
    f, e = runs[f"lev_{fused}"], runs[f"lev_{eager}"]
    agreement: Dict[str, Any] = {}
    if f["losses"] and e["losses"]:
        agreement = {"first_loss": (f["losses"][0], e["losses"][0]), "first_grad_norm": (f["grad_norms"][0], e["grad_norms"][0]),
                     "loss_gap": _gap(f["losses"][0], e["losses"][0]),
                     "grad_norm_gap": _gap(f["grad_norms"][0], e["grad_norms"][0]),
                     "max_loss_gap_any_iteration": max((g for g in map(_gap, f["losses"], e["losses"]) if g is not None),
                                                       default=None)}
        if agreement["loss_gap"] is None or agreement["loss_gap"] > LOSS_RTOL:
            problems.append(f"first loss {fused} {f['losses'][0]} vs {eager} {e['losses'][0]} (relative gap "
                            f"{agreement['loss_gap']}, tolerance {LOSS_RTOL:g})")
        if agreement["grad_norm_gap"] is None or agreement["grad_norm_gap"] > GRAD_NORM_RTOL:
            problems.append(f"first grad norm {fused} {f['grad_norms'][0]} vs {eager} {e['grad_norms'][0]} (relative "
                            f"gap {agreement['grad_norm_gap']}, tolerance {GRAD_NORM_RTOL:g})")
    figures = {"fused": fused, "eager": eager, "runs": runs, "agreement": agreement,
               "tolerance": {"loss": LOSS_RTOL, "grad_norm": GRAD_NORM_RTOL}}
    if problems:
        raise CheckFailed("; ".join(problems), figures)
    return figures


def stage_correctness(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    fused, eager = lev_bases(ctx)
    work = Path(ctx.work) / "correctness"
    argvs = correctness_runs(ctx)
    jobs = []
    for name, argv in argvs.items():
        metrics = work / f"{name}.metrics.jsonl"
        metrics.unlink(missing_ok=True)
        jobs.append(([sys.executable, *argv, "--metrics-file", metrics], work / f"{name}.log"))
    t0 = time.monotonic()
    results = run_parallel(jobs, t0 + timeout, ctx.env())
    runs = {}
    for (name, _), (rc, output) in zip(argvs.items(), results):
        r = parse_training(output, work / f"{name}.metrics.jsonl")
        r.update(exit=rc, tail=tail(output, 600) if rc else "")
        runs[name] = r
    if any(rc == TIMEOUT_RC for rc, _ in results):
        raise CheckTimeout(timeout, {"runs": runs}, "; ".join(f"{n}: {r['tail'][-200:]}" for n, r in runs.items() if r["exit"]))
    return judge_correctness(runs, fused, eager, ctx.size["correctness"]["steps"])


# -------------------------------------------------------------------------------------- 3. kernels


def stage_kernels(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    # Without CUDA the kernels run in Triton's interpreter, which must be chosen before triton is imported.
    return in_child("kernels", **({} if ctx.cuda else {"TRITON_INTERPRET": "1"}))(ctx, timeout)


def kernel_shapes(sizes: str):
    from megatron_lev.kernels.lev_timing import KernelShape, default_shapes

    given = SIZES[sizes]["kernels"]["shapes"]
    return default_shapes() if given is None else tuple(KernelShape(*s) for s in given)


def shape_partitions(shape) -> Dict[str, int]:
    """Id partitions of each backward variant's launch at ``shape`` (a function of the shape only)."""
    from megatron_lev.kernels import lev_triton

    return {v: lev_triton._bwd_partitions(shape.n, shape.h, shape.d_s, shape.kappa, shape.r, v)[0]
            for v in lev_triton.BACKWARD_VARIANTS}


def child_kernels(ctx: Ctx, partial) -> Dict[str, Any]:
    from megatron_lev.kernels import lev_timing

    k = ctx.size["kernels"]
    shapes = kernel_shapes(ctx.sizes)
    try:
        timings = lev_timing.time_kernels(shapes, reps=k["reps"], warmup=k["warmup"])
    except RuntimeError as e:  # no triton, or no device it runs on
        if ctx.cuda:
            raise
        raise Skip(str(e))
    figures: Dict[str, Any] = {"timings": timings}
    partial(figures)
    errors = lev_timing.compare_backward(shapes)
    figures["errors"] = errors
    ok = {(r["shape"], r["variant"]) for r in errors if r["ok"]}
    figures["fastest"] = {}
    for shape in dict.fromkeys(r["shape"] for r in timings):
        rows = [r for r in timings if r["shape"] == shape and (shape, r["variant"]) in ok]
        if rows:
            best = min(rows, key=lambda r: r["bwd_ms"])
            figures["fastest"][shape] = {"variant": best["variant"], "bwd_ms": best["bwd_ms"]}
    bad = [f"{r['shape']}/{r['variant']}" for r in errors if not r["ok"]]
    if bad:
        raise CheckFailed(f"backward over the fp64 tolerance: {bad}", figures)
    return figures


# ----------------------------------------------------------------------------------- 4. throughput


def throughput_shapes(ctx_or_sizes) -> List[Tuple[str, Dict[str, int]]]:
    """(title, shape) measured: the science model's first, then the size's bench/throughput.py configs."""
    import gpu_science
    from throughput import CONFIGS

    sizes = ctx_or_sizes.sizes if isinstance(ctx_or_sizes, Ctx) else ctx_or_sizes
    science = SIZES[sizes]["science"]["config"]
    shape = {k: v for k, v in gpu_science.model_shape(science).items() if k != "global_batch"}
    return [(f"science ({science})", shape)] + [(c, CONFIGS[c]) for c in SIZES[sizes]["throughput"]["configs"]]


def child_throughput(ctx: Ctx, partial) -> Dict[str, Any]:
    import torch
    from lev_layer import _init_parallel
    from throughput import _load, _machine, _versions, arm_list, measure, write_report

    device = ctx.device
    _init_parallel(device)
    arms = [a for a in arm_list(device, ("unique",)) if a["arm"] != "lev" or a.get("default")]
    t = ctx.size["throughput"]
    results: Dict[str, Any] = {"command": "python bench/gpu_check.py (throughput stage)",
                               "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": _machine(),
                               "versions": _versions(), "load_start": _load(), "sections": [],
                               "gpu_ran": device == "cuda"}
    figures: Dict[str, Any] = {"device": device, "attention": _sdpa(torch), "shapes": {}}
    for title, shape in throughput_shapes(ctx):
        res = measure(shape, arms, device=device, dtype_name="bfloat16" if device == "cuda" else "float32",
                      repeats=t["repeats"], warmup=t["warmup"], shared=Path(ctx.shared_data), log=print)
        results["sections"].append({"title": title, "target": 1.01, "result": res})
        figures["shapes"][title] = _throughput_figures(res)
        results["load_end"] = _load()
        write_report(Path(ctx.out) / "throughput.md", results)
        partial(figures)
    return figures


def _sdpa(torch) -> Dict[str, Any]:
    if not torch.cuda.is_available():
        return {"note": "no CUDA device: SDPA's math kernel on CPU"}
    return {"flash": torch.backends.cuda.flash_sdp_enabled(), "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}


def _throughput_figures(res: Dict[str, Any]) -> Dict[str, Any]:
    """Per arm (tied, untied, lev) its median ms and tokens/s; LEV/TIED, LEV/UNTIED, UNTIED/TIED."""
    lev = res["lev_default"]
    arms = {"tied": res["arms"]["tied"], "untied": res["arms"]["untied"], "lev": res["arms"][lev]}
    out = {"shape": res["shape"], "tokens_per_step": res["tokens_per_step"], "lev_arm": lev,
           "arms": {k: {"ms_per_iter": a["ms_per_iter"], "ms_min": a["ms_min"], "tokens_per_s": a["tokens_per_s"],
                        "input_layer_ms": a["input_layer_ms"], "parameters": a["parameters"]} for k, a in arms.items()}}
    ms = {k: a["ms_per_iter"] for k, a in arms.items()}
    out.update(lev_over_tied=ms["lev"] / ms["tied"], lev_over_untied=ms["lev"] / ms["untied"],
               untied_over_tied=ms["untied"] / ms["tied"])
    return out


def measured_rates(ctx: Ctx) -> Optional[Dict[str, float]]:
    """tokens/s per arm at the science model's shape, if the throughput stage measured them (also when it
    was killed later, at the next shape: each shape's figures are complete when written)."""
    shapes = ctx.figures("throughput", partial=True).get("shapes") or {}
    first = shapes.get(throughput_shapes(ctx)[0][0])
    return {k: a["tokens_per_s"] for k, a in first["arms"].items()} if first else None


# -------------------------------------------------------------------------------------- 5. profile


def profile_argv(ctx: Ctx, tensorboard: Path) -> List[str]:
    p, size = ctx.size["profile"], ctx.size
    start, end = p["window"]
    return ["pretrain_lev.py", *p["model"], *_transformer(), *size["precision"], *PRODUCTION,
            "--train-iters", str(p["steps"]), "--lr", "3e-4", "--lr-warmup-iters", "1", "--seed", "1234",
            "--log-interval", "1", "--eval-iters", "0", "--quiet-config", "--input-embedding", "lev", *size["lev"],
            "--profile", "--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end", str(end),
            "--tensorboard-dir", str(tensorboard)]


def stage_profile(ctx: Ctx, timeout: float, extra: Sequence[str] = ()) -> Dict[str, Any]:
    """The profiled run (``extra``: flags added to ``profile_argv``'s) and its trace's figures."""
    import _profile_trace

    work = Path(ctx.work) / "profile"
    tensorboard = work / "tensorboard"
    shutil.rmtree(tensorboard, ignore_errors=True)
    t0 = time.monotonic()
    rc, output = run_logged([sys.executable, *profile_argv(ctx, tensorboard), *extra], timeout, work / "pretrain.log",
                            ctx.env())
    if rc == TIMEOUT_RC:
        raise CheckTimeout(timeout, log_tail=tail(output))
    trace = _profile_trace.find_trace(tensorboard)
    if rc != 0 or trace is None:
        raise CheckFailed(f"pretrain_lev.py --profile exit {rc}, trace {'found' if trace else 'missing'}: "
                          f"{tail(output, 600)}")
    figures = _profile_trace.summarize(trace)
    figures.update(run_s=round(time.monotonic() - t0, 1), trace_mib=round(os.path.getsize(trace) / 2**20, 1),
                   basis=ctx.figures("env").get("lev_basis"))
    want = ctx.size["profile"]["window"][1] - ctx.size["profile"]["window"][0]
    if figures["steps"] != want:
        raise CheckFailed(f"the trace holds {figures['steps']} steps, not {want}", figures)
    if ctx.cuda and figures["basis"] == "triton" and not figures["ms_per_step"]["lev_triton"]:
        raise CheckFailed("--lev-basis auto resolved to triton, but no LEV Triton kernel is in the trace", figures)
    return figures


# -------------------------------------------------------------------------------------- 6. science


def child_science(ctx: Ctx, partial) -> Dict[str, Any]:
    import gpu_science

    s = ctx.size["science"]
    rates, source = measured_rates(ctx), "the throughput stage's measurement"
    if rates is None and ctx.assume_tflops:
        rates, source = gpu_science.assumed_rates(s["config"], ctx.assume_tflops), f"--assume-tflops {ctx.assume_tflops:g}"
    if rates is None:
        raise Skip("no tokens/s to size the runs with: the throughput stage did not measure them "
                   "(give --assume-tflops)")
    # Every command ends SCIENCE_END_S before the child's own limit: the report and the result are written then.
    deadline = (ctx.deadline or time.monotonic() + 600.0) - SCIENCE_END_S
    figures = gpu_science.run(s["config"], ctx.shared_data, Path(ctx.work) / "science", Path(ctx.out), deadline,
                              rates, max_iters=s["max_iters"], min_iters=s["min_iters"], partial=partial)
    figures["rates_from"] = source
    return figures


CHILD_FUNCS: Dict[str, Callable] = {"env": child_env, "kernels": child_kernels, "throughput": child_throughput,
                                    "science": child_science}

STAGES: Tuple[Stage, ...] = (
    Stage("env", stage_env, cuda=False),
    Stage("correctness", stage_correctness),
    Stage("kernels", stage_kernels),
    Stage("throughput", in_child("throughput")),
    Stage("profile", stage_profile),
    Stage("science", in_child("science"), rest=True),
)
NAMES = tuple(s.name for s in STAGES)


# ------------------------------------------------------------------------------------------ plan


def stage_seconds(budget_s: float) -> Dict[str, float]:
    """Each stage's limit: ``BASE_S`` in proportion to the budget; the science stage gets the rest."""
    k = budget_s / PLAN_BUDGET_S
    out = {name: s * k for name, s in BASE_S.items()}
    out["science"] = budget_s - RESERVE_S - sum(out.values())
    return out


def plan(budget_s: float, sizes: str = "device", assume_tflops: Optional[float] = None,
         shared_data: str = str(SHARED)) -> List[Dict[str, Any]]:
    """One entry per stage: name, planned_s, what it runs; the science stage's tokens per arm at
    ``assume_tflops`` (None: sized later from the throughput stage)."""
    import gpu_science

    size = SIZES[sizes]
    secs = stage_seconds(budget_s)
    c, p = size["correctness"], size["profile"]
    shapes = []
    for s in kernel_shapes(sizes):
        parts = shape_partitions(s)
        shapes.append(f"{s.label} N={s.n} h={s.h} d_s={s.d_s} kappa={s.kappa} r={s.r} (backward partitions: "
                      + ", ".join(f"{v} {n}" for v, n in parts.items()) + ")")
    from megatron_lev.kernels import lev_triton

    what = {
        "env": "the carried wheels, versions, the C compiler and Python.h Triton builds with, the LEV basis that "
               "will run, the bf16 matmul and copy ceilings",
        "correctness": f"pretrain_lev.py {c['describe']}, {size['precision'][0][2:]}, distributed optimizer with "
                       f"overlapped grad reduce, megatron's compiled fusions off, {c['steps']} steps each of lev with the "
                       "fused basis (--lev-basis triton on CUDA), lev with the eager basis, and tied, at once; first-iteration loss and grad "
                       f"norm of the two lev runs within {LOSS_RTOL:g} / {GRAD_NORM_RTOL:g}",
        "kernels": "the fused product alone with CUDA events: forward and backward variants "
                   f"{', '.join(lev_triton.BACKWARD_VARIANTS)} at " + "; ".join(shapes)
                   + "; each variant against the fp64 eager product",
        "throughput": "tied, untied and lev (default arm) round-robin medians, flash/cuDNN attention, at "
                      + ", ".join(f"{t} {s['layers']} x {s['hidden']} seq {s['seq']} micro-batch {s['micro_batch']}"
                                  for t, s in throughput_shapes(sizes)),
        "profile": f"2-step torch.profiler trace of pretrain_lev.py (lev, {p['describe']}, production flags): share "
                   "of step time in LEV's Triton kernels, LEV's GEMMs and the rest; host syncs per step",
    }
    out = [{"name": n, "planned_s": secs[n], "what": what[n]} for n in BASE_S]
    s = size["science"]
    science: Dict[str, Any] = {"name": "science", "planned_s": secs["science"],
                               "what": f"tied, untied and lev, same data, order and seed, bench/reproduce.py "
                                       f"--config {s['config']}: {gpu_science._reproduce().CONFIGS[s['config']]['description']}"}
    if assume_tflops:
        sp = gpu_science.plan(secs["science"], gpu_science.assumed_rates(s["config"], assume_tflops),
                              gpu_science.corpus_tokens_estimate(shared_data), s["config"], s["max_iters"])
        science.update(tokens_per_arm=sp["tokens_per_arm"], iterations=sp["iterations"], limited_by=sp["limited_by"],
                       train_s=sp["train_s"])
    out.append(science)
    return out


def plan_lines(entries: List[Dict[str, Any]], budget_s: float, sizes: str, assume_tflops: Optional[float]) -> List[str]:
    lines = [f"plan: budget {budget_s:g} s at the {sizes} sizes, {RESERVE_S:g} s kept for the last report write"
             + (f"; science sized at {assume_tflops:g} TFLOP/s achieved (LEV assumed "
                f"{_science_lev_factor():g}x slower than tied)" if assume_tflops else "")]
    for e in entries:
        if e["name"] == "science":
            tokens = (f", {e['tokens_per_arm']} tokens per arm ({e['iterations']} iterations, limited by "
                      f"{e['limited_by']}; {e['train_s']:.0f} s of training)") if "tokens_per_arm" in e else \
                ", tokens per arm sized from the throughput stage's measurement"
            lines.append(f"stage science: planned {e['planned_s']:.0f} s{tokens} - {e['what']}")
        else:
            lines.append(f"stage {e['name']}: planned {e['planned_s']:.0f} s - {e['what']}")
    return lines


def _science_lev_factor() -> float:
    import gpu_science

    return gpu_science.LEV_OVER_TIED_ASSUMED


# ------------------------------------------------------------------------------------------ runner


def run_stages(stages: Sequence[Stage], ctx: Ctx, budget_s: float, *, clock=time.monotonic, start: Optional[float] = None,
               on_result: Callable[[List[Dict[str, Any]]], None] = lambda results: None, log=print,
               limits: Optional[Dict[str, float]] = None):
    """Run ``stages`` in order within ``budget_s`` seconds of ``clock`` from ``start``; ``on_result(results)``
    after each. A stage runs under min(its limit, what is left); a ``rest`` stage's limit (the science
    stage's), or one without a limit in ``limits`` (default: this program's ``stage_seconds``), is what is left."""
    start = clock() if start is None else start
    limits = stage_seconds(budget_s) if limits is None else limits
    results: List[Dict[str, Any]] = []
    ctx.results = {}
    for stage in stages:
        t0 = clock()
        left = budget_s - RESERVE_S - (t0 - start)
        planned = limits.get(stage.name, left)
        entry: Dict[str, Any] = {"name": stage.name, "status": "ok", "reason": "", "planned_s": round(planned),
                                 "figures": {}}
        try:
            if stage.cuda and not ctx.cuda and ctx.sizes == "device":
                raise Skip("no CUDA device")
            limit = left if stage.rest else min(left, planned)
            entry["limit_s"] = round(limit)
            if limit < 1:
                raise Skip(f"budget: {max(0.0, left):.0f} s left")
            entry["figures"] = stage.run(ctx, limit) or {}
        except Skip as e:
            entry.update(status="skipped", reason=str(e), figures=e.figures)
        except CheckTimeout as e:
            entry.update(status="failed", reason=str(e), figures=e.figures, log_tail=e.log_tail)
        except CheckFailed as e:
            entry.update(status="failed", reason=str(e), figures=e.figures)
        except Exception as e:  # reported in the file, never hidden
            entry.update(status="failed", reason=f"{type(e).__name__}: {e}")
        entry["seconds"] = round(clock() - t0, 1)
        log(f"gpu_check: {stage.name:<12} {entry['status']:<8} {entry['seconds']:7.1f} s  {entry['reason'][:300]}")
        results.append(entry)
        ctx.results[stage.name] = entry
        on_result(results)
    return results


@dataclass(frozen=True)
class Program:
    """A named tuple of stages and the functions that plan and report them (one module's, see PROGRAMS)."""
    name: str
    stages: Tuple[Stage, ...]
    plan: Callable[..., List[Dict[str, Any]]]
    """plan(budget_s, sizes, assume_tflops, shared_data) -> one entry per stage: name, planned_s, what."""
    budget_s: float
    sizes: Dict[str, Dict[str, Any]]
    stage_seconds: Callable[[float], Dict[str, float]]
    plan_lines: Callable[..., List[str]]
    children: Dict[str, Callable]
    markdown: Dict[str, Callable]
    notes: Callable[[Ctx], List[str]]

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.stages)


def load_program(name: str) -> Program:
    """The program registered as ``name`` in PROGRAMS, read from its module now (a test may have replaced
    its STAGES). What a module leaves out: the default sizes and budget, limits from its plan, one plan
    line per stage, no child functions, each stage's figures as JSON in the report, no notes."""
    import importlib

    m = importlib.import_module(PROGRAMS[name])

    def seconds_from_plan(budget_s: float) -> Dict[str, float]:
        return {e["name"]: e["planned_s"] for e in m.plan(budget_s, "device", None, str(SHARED))}

    return Program(name=name, stages=tuple(m.STAGES), plan=m.plan, budget_s=getattr(m, "BUDGET_S", PLAN_BUDGET_S),
                   sizes=getattr(m, "SIZES", SIZES), stage_seconds=getattr(m, "stage_seconds", seconds_from_plan),
                   plan_lines=getattr(m, "plan_lines", stage_plan_lines), children=getattr(m, "CHILD_FUNCS", {}),
                   markdown=getattr(m, "MARKDOWN", {}), notes=getattr(m, "not_run_notes", lambda ctx: []))


def stage_plan_lines(entries: List[Dict[str, Any]], budget_s: float, sizes: str, assume_tflops: Optional[float]) -> List[str]:
    """A program's plan as printed by --plan when its module has no plan_lines of its own."""
    return ([f"plan: budget {budget_s:g} s at the {sizes} sizes, {RESERVE_S:g} s kept for the last report write"]
            + [f"stage {e['name']}: planned {e['planned_s']:.0f} s - {e['what']}" for e in entries])


def not_run_notes(ctx: Ctx) -> List[str]:
    notes = ["Multi-rank collectives: one GPU runs TP=1 over NCCL at most (NCCL refuses two ranks on one device); "
             "tensor/pipeline-parallel LEV and its gradient reductions are tested on CPU (gloo) only."]
    if str(ctx.figures("env").get("transformer_engine", "not")).startswith("not"):
        notes.append("FP8 / Transformer Engine: not installed here; this program runs the local spec in bf16 "
                     "(--program te checks TE and FP8, with TE carried in pieces: docs/gpu.md).")
    if not ctx.cuda:
        notes.append("No CUDA device: the stages ran at the tiny sizes on the CPU (eager or numba bases, Triton's "
                     "interpreter, gloo); no figure here is a GPU figure." if ctx.sizes == "tiny" else
                     "No CUDA device: every stage but env was skipped.")
    return notes


# ------------------------------------------------------------------------------------------ report


def write_report(out: Path, report: Dict[str, Any], markdown: Optional[Dict[str, Callable]] = None) -> None:
    """``OUT/gpu_check.json`` and ``OUT/gpu_check.md``; ``markdown``: each stage's section (default: this program's)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "gpu_check.json", report)
    env = next((c["figures"] for c in report["stages"] if c["name"] == "env" and c["status"] == "ok"), {})
    program = report.get("program", "default")
    L = ["# GPU check" + ("" if program == "default" else f": program {program}"), "", f"`{report['command']}`, started {report['created']}; state **{report['state']}**, "
         f"{report['elapsed_s']} s of a {report['budget_s']} s budget, {report['sizes']} sizes.", "",
         f"Device: {env.get('device') or 'none (no CUDA device)'}"
         + (f" (sm {env.get('capability')}, {env.get('memory_gib')} GiB; bf16 matmul {env.get('bf16_matmul_tflops')} "
            f"TFLOP/s, copy {env.get('copy_tb_per_s')} TB/s measured)" if env.get("device") else "")
         + "; " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "megatron.core", "triton") if k in env)
         + (f"; LEV basis that runs: **{env['lev_basis']}**" if env.get("lev_basis") else ""), "",
         "| stage | status | planned s | limit s | seconds | reason |", "|---|---|---|---|---|---|"]
    for c in report["stages"]:
        L.append(f"| {c['name']} | {c['status']} | {c.get('planned_s', '')} | {c.get('limit_s', '')} | {c['seconds']} | "
                 f"{(c['reason'] or '').replace('|', '/')[:400]} |")
    for name in report.get("pending", []):
        L.append(f"| {name} | pending | | | | |")
    if report.get("not_run"):
        L += ["", "## Not proved by this check", ""] + [f"- {x}" for x in report["not_run"]]
    for c in report["stages"]:
        if c.get("figures"):
            L += ["", f"## {c['name']}", ""] + _figures_md(c["name"], c["figures"], markdown)
    write_text(out / "gpu_check.md", "\n".join(L) + "\n")


def _figures_md(name: str, f: Dict[str, Any], markdown: Optional[Dict[str, Callable]] = None) -> List[str]:
    try:
        return (MARKDOWN if markdown is None else markdown)[name](f)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):  # a partial run's figures: as JSON
        return ["```json", json.dumps(f, indent=1, default=str)[:6000], "```"]


def _n(v, d: int = 3) -> str:
    return "–" if v is None else f"{v:.{d}g}" if isinstance(v, float) else str(v)


def _md_env(f):
    keys = ("lev_basis", "lev_fused_registered", "triton_build_missing", "c_compiler", "python_headers",
            "triton_backward", "sdpa", "transformer_engine", "apex", "numba", "cuda", "cpus", "install")
    return [f"- {k}: {f[k]}" for k in keys if k in f]


def _md_correctness(f):
    L = [f"LEV with the {f['fused']} basis against the {f['eager']} basis (and tied beside them); tolerance loss "
         f"{f['tolerance']['loss']:g}, grad norm {f['tolerance']['grad_norm']:g} (relative, first iteration).", "",
         "| run | exit | iterations | first loss | first grad norm | last loss | median ms | tokens/s |",
         "|---|---|---|---|---|---|---|---|"]
    for name, r in f["runs"].items():
        L.append(f"| {name} | {r['exit']} | {r['iterations']} | {_n((r['losses'] or [None])[0], 7)} | "
                 f"{_n((r['grad_norms'] or [None])[0], 6)} | {_n((r['losses'] or [None])[-1], 6)} | "
                 f"{_n(r.get('median_ms'), 4)} | {_n(r.get('median_tokens_per_s'), 4)} |")
    a = f.get("agreement") or {}
    if a:
        L += ["", f"Gaps: first loss {_n(a['loss_gap'])}, first grad norm {_n(a['grad_norm_gap'])}, largest loss gap "
                  f"at any iteration {_n(a['max_loss_gap_any_iteration'])}."]
    return L


def _md_kernels(f):
    errs = {(r["shape"], r["variant"]): r for r in f.get("errors", [])}
    L = ["| shape | N, h, d_s, kappa, r | backward | partitions | forward ms | backward ms | bwd / fwd | "
         "max rel. error M / dx / dDelta | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for r in f["timings"]:
        e = errs.get((r["shape"], r["variant"]))
        err = (f"{e['max_rel_err_m']:.1e} / {e['max_rel_err_grad_x']:.1e} / {e['max_rel_err_grad_delta']:.1e}"
               if e else "–")
        L.append(f"| {r['shape']} | {r['n']}, {r['h']}, {r['d_s']}, {r['kappa']}, {r['r']} | {r['variant']} | "
                 f"{r['partitions']} | {r['fwd_ms']:.4f} | {r['bwd_ms']:.4f} | {r['bwd_fwd_ratio']:.2f} | {err} | "
                 f"{e['ok'] if e else '–'} |")
    if f["timings"]:
        L += ["", f"Timer: {f['timings'][0]['timer']} ({f['timings'][0]['device']}), median of {f['timings'][0]['reps']}."]
    for shape, best in (f.get("fastest") or {}).items():
        L.append(f"- {shape}: fastest backward within tolerance: **{best['variant']}** ({best['bwd_ms']:.4f} ms)")
    return L


def _md_throughput(f):
    L = [f"Attention: {f.get('attention')}", ""]
    for title, s in f["shapes"].items():
        sh = s["shape"]
        L += [f"### {title}: {sh['layers']} x {sh['hidden']}, seq {sh['seq']}, micro-batch {sh['micro_batch']}", "",
              f"**LEV/TIED {s['lev_over_tied']:.3f}, LEV/UNTIED {s['lev_over_untied']:.3f}** (median steps; "
              f"UNTIED/TIED {s['untied_over_tied']:.3f}; LEV arm {s['lev_arm']})", "",
              "| arm | ms/iter (median) | best | tokens/s | input layer ms | parameters |", "|---|---|---|---|---|---|"]
        for arm, a in s["arms"].items():
            L.append(f"| {arm} | {a['ms_per_iter']:.2f} | {a['ms_min']:.2f} | {a['tokens_per_s']:,.0f} | "
                     f"{a['input_layer_ms']:.2f} | {a['parameters']:,} |")
        L.append("")
    return L


def _md_profile(f):
    L = [f"Timeline: {f['timeline']}; {f['steps']} steps, {f['step_ms']:.2f} ms per step (trace {f.get('trace_mib')} MiB).",
         "", "| part of the step | ms per step | share |", "|---|---|---|"]
    for k in ("lev_triton", "lev_gemm", "attention", "other", "idle"):
        L.append(f"| {k} | {f['ms_per_step'][k]:.3f} | {100 * f['share'][k]:.1f}% |")
    rest = sum(f["share"][k] for k in ("attention", "other", "idle"))
    L += ["", f"LEV's Triton kernels {100 * f['share']['lev_triton']:.1f}%, LEV's GEMMs {100 * f['share']['lev_gemm']:.1f}%, "
              f"the rest {100 * rest:.1f}% of the step.",
          f"Host syncs per step (CUDA runtime): {_n(f['host_syncs_per_step'])}; scalar reads per step "
          f"(aten::_local_scalar_dense): {_n(f['scalar_reads_per_step'])}.", "", "Largest items:", ""]
    L += [f"- {t['category']}: `{t['name']}` {t['ms_per_step']:.3f} ms/step" for t in f.get("top", [])[:8]]
    for key, what in (("syncs_by_place", "Host syncs"), ("scalar_reads_by_place", "Scalar reads")):
        if f.get(key):
            L += ["", f"{what} per step by place (named range / operator):", ""]
            L += [f"- `{p['place']}`: {p['per_step']:g}" for p in f[key][:8]]
    return L


def _md_science(f):
    import gpu_science

    return gpu_science.markdown(f)


MARKDOWN = {"env": _md_env, "correctness": _md_correctness, "kernels": _md_kernels, "throughput": _md_throughput,
            "profile": _md_profile, "science": _md_science}


# ------------------------------------------------------------------------------------------ preparing


def prepare_wheels(dest: str) -> int:
    """Download (here, with PyPI) the Python 3.12 wheels the GPU image lacks into ``dest``."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "-d", dest]
    for spec in WHEELS:
        r = subprocess.run(base + [spec], capture_output=True, text=True)
        print(f"{spec}: {'ok' if r.returncode == 0 else 'FAILED ' + tail(r.stderr, 300)}")
        if r.returncode != 0:
            return 1
    return 0


# Files of the shared data folder the stages read (the science run's corpus and evaluation sets, the
# GPT-2 tokenizer; the throughput stage's ids come from the valid set).
DATA_FILES = ("corpus/train.jsonl.zst", "corpus/valid.jsonl.zst", "corpus/zeroshot_wiki.jsonl.zst",
              "tokenizers/gpt2/vocab.json", "tokenizers/gpt2/merges.txt")


def prepare_data(dest: str, shared: str) -> int:
    """Copy what the stages read from ``shared`` into ``dest`` (same layout), to carry to the GPU machine."""
    src, dst = Path(shared), Path(dest)
    missing = [f for f in DATA_FILES if not (src / f).exists()]
    if missing:
        print(f"--prepare-data: {src} lacks {missing}; point --shared-data at the shared data folder")
        return 1
    for f in DATA_FILES:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / f, dst / f)
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"--prepare-data: {dst} holds {size / 2**20:.1f} MiB")
    return 0


# ------------------------------------------------------------------------------------------ main


def _csv(value: Optional[str]) -> List[str]:
    return [x for x in (value or "").split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run the GPU check's stages within a budget and write a report after "
                                            "every stage (bench/gpu_check.py's docstring says what each does).")
    p.add_argument("--out", default=None, help="folder for gpu_check.json / gpu_check.md (required to run)")
    p.add_argument("--work", default=None, help="logs and scratch files (default OUT/../gpu_check_work)")
    p.add_argument("--program", default="default", choices=sorted(PROGRAMS),
                   help="which stages to run (default: the stages below; PROGRAMS in bench/gpu_check.py)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-clock budget of the whole run (default: the program's, {PLAN_BUDGET_S:g} for default)")
    p.add_argument("--sizes", default="device",
                   help="device (one GPU, default) or tiny (every stage in seconds, on a CPU too)")
    p.add_argument("--wheels", default=str(REPO / "wheels"), help="wheels to install with --no-deps (default wheels/)")
    p.add_argument("--shared-data", default=str(SHARED), help=f"shared data folder (default {SHARED})")
    p.add_argument("--assume-tflops", type=float, default=None,
                   help="achieved TFLOP/s to size the science run with: for --plan, or when the throughput stage "
                        "measured nothing")
    p.add_argument("--plan", action="store_true", help="print each stage's planned seconds (and the science run's "
                                                       "tokens per arm at --assume-tflops), then exit; no GPU needed")
    p.add_argument("--only", default=None, help=f"comma list of the program's stages to run (default's: {','.join(NAMES)})")
    p.add_argument("--skip", default="", help="comma list of stages to leave out")
    p.add_argument("--prepare-wheels", default=None, metavar="DIR",
                   help="download the wheels the GPU machine lacks into DIR, then exit")
    p.add_argument("--prepare-data", default=None, metavar="DIR",
                   help="copy the shared data the stages read into DIR (to carry), then exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-ctx", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child or a.prepare_wheels or a.prepare_data:
        return a
    prog = load_program(a.program)
    if a.sizes not in prog.sizes:
        p.error(f"--sizes {a.sizes}: program {a.program} has the sizes {','.join(sorted(prog.sizes))}")
    a.budget_s = prog.budget_s if a.budget_s is None else a.budget_s
    if not a.budget_s > 0:
        p.error(f"--budget-s must be a positive number of seconds (got {a.budget_s})")
    if a.assume_tflops is not None and not a.assume_tflops > 0:
        p.error(f"--assume-tflops must be a positive number (got {a.assume_tflops})")
    if min(prog.stage_seconds(a.budget_s).values(), default=0.0) < 0:
        p.error(f"--budget-s {a.budget_s:g} leaves nothing once {RESERVE_S:g} s are kept for the report")
    if a.plan:
        return a
    twice = _wheels_twice(a.wheels)
    if twice:
        p.error(f"--wheels {a.wheels}: several wheels of {twice[0]} ({', '.join(twice[1])}); keep one")
    if a.out is None:
        p.error("--out DIR is required (or --plan, --prepare-wheels DIR, --prepare-data DIR)")
    names = prog.names
    chosen, skip = (_csv(a.only) or list(names)), _csv(a.skip)
    unknown = [c for c in chosen + skip if c not in names]
    if unknown:
        p.error(f"unknown stage(s) {unknown}" + ("" if a.program == "default" else f" of program {a.program}")
                + f"; choose from {','.join(names)}")
    a.stages = [c for c in names if c in chosen and c not in skip]
    return a


def main(argv=None) -> int:
    t0 = time.monotonic()
    a = parse_args(argv)
    if a.child:
        return child_main(a.child, a.child_ctx, a.child_result)
    if a.prepare_wheels:
        return prepare_wheels(a.prepare_wheels)
    if a.prepare_data:
        return prepare_data(a.prepare_data, a.shared_data)
    prog = load_program(a.program)
    if a.plan:
        print("\n".join(prog.plan_lines(prog.plan(a.budget_s, a.sizes, a.assume_tflops, a.shared_data), a.budget_s,
                                        a.sizes, a.assume_tflops)))
        return 0
    import torch

    out = Path(a.out)
    work = Path(a.work or out.resolve().parent / "gpu_check_work")
    out.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out=str(out), work=str(work), wheels=a.wheels, shared_data=a.shared_data, sizes=a.sizes,
              cuda=torch.cuda.is_available(), assume_tflops=a.assume_tflops, program=a.program)
    report: Dict[str, Any] = {
        "state": "running", "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "program": a.program, "budget_s": a.budget_s, "sizes": a.sizes, "elapsed_s": 0.0,
        "plan": {e["name"]: round(e["planned_s"]) for e in prog.plan(a.budget_s, a.sizes, None, a.shared_data)},
        "stages": [], "pending": list(a.stages), "not_run": []}

    def on_result(results):
        report.update(stages=results, pending=a.stages[len(results):], elapsed_s=round(time.monotonic() - t0, 1),
                      not_run=prog.notes(ctx))
        write_report(out, report, prog.markdown)

    write_report(out, report, prog.markdown)
    results = run_stages([s for s in prog.stages if s.name in a.stages], ctx, a.budget_s, start=t0, on_result=on_result,
                         limits=prog.stage_seconds(a.budget_s))
    report.update(state="done")
    on_result(results)
    print(f"gpu_check: report in {out / 'gpu_check.md'} ({report['elapsed_s']} s)")
    return 1 if any(c["status"] == "failed" for c in results) else 0


if __name__ == "__main__":
    # Run as the module ``gpu_check`` (bench/ is on the path): a program's module imports it, and gets
    # this one's registry and helpers rather than a second copy of the script.
    import gpu_check

    sys.exit(gpu_check.main())
