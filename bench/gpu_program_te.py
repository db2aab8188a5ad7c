"""Program ``te`` of bench/gpu_check.py: Transformer Engine and FP8 on one GPU, in one 15-minute window.

    python bench/gpu_check.py --program te --plan                  # the window: start, carrying calls, stages
    python bench/gpu_check.py --program te --out OUT               # on the GPU machine (after the carry calls)
    python bench/gpu_check.py --program te --out OUT --sizes tiny  # every stage on a CPU; TE's runs skipped

Stages, in the order of what each figure is worth (``BASE_S`` at a ``BUDGET_S`` budget; docs/gpu.md has
the window's calls):

  install      the carried wheels (``wheels/``) and Transformer Engine's pieces (``.carry/te.*``, joined and
               sha256-checked by ``bench/carry_pieces.py``) into WORK/site, the extension built there when
               the pieces carry its source; run by the last carrying call (``--only install``), and a no-op
               in the next call once WORK/site holds TE.
  env          TE's version, ``transformer_engine.pytorch``, its extension and fused kernels importable, the
               device's FP8 support; versions, the LEV basis, the bf16 matrix rate and copy bandwidth.
  correctness  per arm (lev with the device's fused basis, untied, tied): one iteration on the local spec,
               saved; from that checkpoint the local spec and the TE spec each run ``STEPS`` more, bf16:
               their first iteration's loss and grad norm (same weights, data and seed) within
               ``LOSS_RTOL`` / ``GRAD_NORM_RTOL``.
  fp8          lev on the science model (real data at the device sizes), same seed and data: bf16, FP8
               hybrid with delayed scaling, FP8 tensorwise current scaling; the loss gap over the last tenth
               of the iterations, and a probe that LEV's layer stays out of FP8 (bf16 output, bf16/fp32
               parameters, no TE module inside it).
  speed        tied, untied and lev (default arm) round-robin medians (``bench/throughput.py``'s ``measure``,
               un-profiled) with TE in bf16 and in FP8 (hybrid, delayed) at gpu-400m and at
               examples/pile/configs/400m.yaml's shape on one GPU: TFLOP/s, MFU against the bf16 matrix rate
               of the env stage, LEV/TIED, LEV/UNTIED, FP8/bf16.
  checkpoint   lev saved under the TE spec, then continued from it by the local spec and by the TE spec:
               the checkpoint loads across specs and the two continuations' first losses agree.

Without Transformer Engine a stage runs what needs none (the local-spec and bf16 runs) and is skipped
with "no TE", its figures holding the command lines of the runs it left out.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import gpu_check as gc
from _check_harness import CheckFailed, CheckTimeout, Skip, TIMEOUT_RC, run_logged, run_parallel, tail
from gpu_check import Ctx, Stage, in_child

REPO = gc.REPO
CARRY = REPO / ".carry"  # the piece folders bench/prepare_te.py writes (git-ignored)
PIECES = "te"

# The window (one session's device time) and what it holds besides the stages.
WINDOW_S = 900.0
MACHINE_START_S = 150.0  # "machine start 1-3 min" (../shared/notes/gpu-device.md)
CALL_S = 30.0  # one call's own cost: sending up to 64 MiB of working tree, starting the command, the reply
PIECES_ASSUMED = 1  # before bench/prepare_te.py has written .carry/te.*/manifest.json here
BUDGET_S = 605.0
# install: in the last carrying call (``--only install``), with the extension's 33 C++ files built on 16
# cores when the pieces carry its source (about 150 s); in the run's own call it finds them installed.
BASE_S = {"install": 200.0, "env": 30.0, "correctness": 80.0, "fp8": 120.0, "speed": 125.0, "checkpoint": 45.0}
RESERVE_S = gc.RESERVE_S

# TE spec vs local spec from the same checkpoint, first iteration. Same weights, data and seed; the TE
# layers fuse the norm into the linear, use cuDNN's attention and their own GEMM epilogues, all in bf16
# (8-bit mantissa: 3.9e-3 per rounding). The loss is a mean over the step's tokens, which averages the
# per-token differences: 5e-3 relative admits bf16 rounding and rejects a wrong layer (a missing norm or
# a transposed weight moves the loss by tenths). Gradient norms sum squares of bf16 gradients reduced in
# another order: 5e-2.
LOSS_RTOL = 5e-3
GRAD_NORM_RTOL = 5e-2
FP8_GAP_TARGET = 0.01  # FP8 within 1% of bf16 over the last tenth (the target; reported, not failed)
ARMS = ("lev", "untied", "tied")
FP8_RUNS = {"bf16": [], "fp8_delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
            "fp8_tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]}
NO_TE = "no TE"

_LEV_TINY = ["--lev-heads", "2", "--lev-seed-dim", "8", "--lev-knots", "5", "--lev-rank", "4",
             "--lev-init-sample-size", "4096"]
SIZES: Dict[str, Dict[str, Any]] = {
    "device": dict(
        correctness=dict(model=gc._model(4, 1024, 16, 1024, 4, 8, 50257), steps=3, arms=ARMS,
                         describe="4 x 1024, seq 1024, 2 micro-batches of 4"),
        # Three runs at once: 200 x 3 x ~80 ms (the H100's science step) ~ 50 s of the stage's 120.
        fp8=dict(config="gpu-science", iters=200, data="corpus",
                 describe="the science model (8 x 512, seq 1024, batch 64), 200 iterations, the shared corpus"),
        probe=dict(layers=2, hidden=512, heads=8, seq=1024, micro_batch=4),
        speed=dict(shapes=("gpu-400m", "pile-400m"), repeats=5, warmup=2),
        checkpoint=dict(model=gc._model(4, 1024, 16, 1024, 4, 8, 50257), steps=2),
        precision=["--bf16"], lev=[], carry=CARRY,
    ),
    "tiny": dict(
        # One arm: the plumbing is the same for the three, and each run is two process start-ups on a CPU.
        correctness=dict(model=gc._model(1, 32, 2, 32, 2, 4, 1000), steps=2, arms=("lev",), describe="1 x 32, seq 32"),
        fp8=dict(config="gpu-science-tiny", iters=10, data="mock", describe="1 x 32, seq 32, 10 iterations, mock data"),
        probe=dict(layers=1, hidden=32, heads=2, seq=32, micro_batch=2),
        speed=dict(shapes=("tiny",), repeats=1, warmup=1),
        checkpoint=dict(model=gc._model(1, 32, 2, 32, 2, 4, 1000), steps=2),
        # No pieces at the tiny sizes: TE's would install a 33 MB wheel and build its extension on this
        # machine (tests/bench/test_carry_pieces.py covers the pieces' join, checks and install).
        precision=["--bf16"], lev=_LEV_TINY, carry=None,
    ),
}
TINY_SHAPE = dict(layers=1, hidden=32, heads=2, seq=32, micro_batch=2)


def te_ready(ctx: Ctx) -> bool:
    """Whether the env stage imported transformer_engine.pytorch with its extension."""
    return bool(ctx.figures("env").get("te_pytorch"))


def _cmdline(argv: List[Any]) -> str:
    return " ".join(str(a) for a in argv)


# ------------------------------------------------------------------------------------------ env


def pieces_manifest(root: Path = CARRY) -> Optional[Dict[str, Any]]:
    import _carry

    try:
        return _carry.read_manifest(root, PIECES)
    except _carry.CarryError:
        return None


def te_installed(site: Path) -> bool:
    return (site / "transformer_engine").is_dir() and any(site.glob("transformer_engine_torch*.so"))


def install_pieces(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    """Join, check and install TE's pieces into WORK/site; build the extension there from its source
    distribution when the pieces carry that instead of a wheel. Nothing to do once TE is there (an
    earlier call on this machine installed it)."""
    site = Path(ctx.work) / "site"
    if te_installed(site):
        ctx.site = str(site)
        return {"pieces": f"already installed in {site}"}
    root = ctx.size["carry"]
    manifest = pieces_manifest(root) if root else None
    if manifest is None:
        return {"pieces": f"none under {root}" if root else f"none at the {ctx.sizes} sizes"}
    t0 = time.monotonic()
    rc, out = run_logged([sys.executable, str(REPO / "bench" / "carry_pieces.py"), "install", "--root", str(root),
                          "--name", PIECES, "--target", str(site)], timeout, Path(ctx.work) / "logs" / "pieces.log")
    if rc == TIMEOUT_RC:
        raise CheckTimeout(timeout, log_tail=tail(out))
    if rc:
        raise CheckFailed(f"TE pieces: {tail(out, 400).strip()}")
    fig: Dict[str, Any] = {"pieces": len(manifest["pieces"]), "install_s": round(time.monotonic() - t0, 1)}
    sdists = [f["path"] for f in manifest["files"] if f["path"].startswith("build/")]
    if sdists:
        fig["extension_build"] = build_extension_here(ctx, root, site, timeout - (time.monotonic() - t0))
    ctx.site = str(site)
    if ctx.site not in sys.path:
        sys.path.insert(0, ctx.site)
    return fig


def build_extension_here(ctx: Ctx, root: Path, site: Path, timeout: float) -> Dict[str, Any]:
    """``transformer-engine-torch`` built from the carried source on this machine's cores (nvcc, CMake,
    ninja, pybind11 and torch are there; cuDNN frontend's headers came with the pieces)."""
    import _carry

    work = Path(ctx.work) / "te_build"
    _carry.join(root, PIECES, work)
    src = next((work / "build").glob("transformer_engine_torch-*.tar.gz"))
    import sysconfig

    # cuDNN frontend's headers came with the pieces (WORK/site/include); cuDNN's, NCCL's and CUDA's are in the
    # machine's own NVIDIA packages, beside its torch.
    purelib = Path(sysconfig.get_paths()["purelib"])
    include = [str(p) for root in (site, purelib) for p in [*root.glob("include"), *root.glob("nvidia/*/include")]]
    env = ctx.env(MAX_JOBS=str(os.cpu_count() or 8), NVTE_PYTORCH_FORCE_BUILD="TRUE", NVTE_CUDA_ARCHS="90",
                  NVTE_WITH_NCCL_EP="0", CPATH=os.pathsep.join(include + [os.environ.get("CPATH", "")]))
    t0 = time.monotonic()
    rc, out = run_logged([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w",
                          str(work / "wheel"), str(src)], timeout, Path(ctx.work) / "logs" / "te_build.log", env)
    if rc == TIMEOUT_RC:
        raise CheckTimeout(timeout, log_tail=tail(out))
    if rc:
        raise CheckFailed(f"building transformer-engine-torch exited {rc}: {tail(out, 400)}")
    wheel = next((work / "wheel").glob("*.whl"))
    rc, out = run_logged([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                          str(wheel)], 120, Path(ctx.work) / "logs" / "te_build.log", append=True)
    if rc:
        raise CheckFailed(f"installing {wheel.name} exited {rc}: {tail(out, 400)}")
    return {"seconds": round(time.monotonic() - t0, 1), "wheel": wheel.name, "cores": os.cpu_count()}


def stage_install(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    """The carried wheels and TE's pieces into WORK/site (what an earlier call installed there is kept)."""
    t0 = time.monotonic()
    site = Path(ctx.work) / "site"
    if site.is_dir():  # installed by an earlier call: importable here, and for every child
        ctx.site = str(site)
        sys.path.insert(0, ctx.site)
    wheels = gc.install_wheels(ctx, timeout)
    return {"wheels": wheels, "te_pieces": install_pieces(ctx, timeout - (time.monotonic() - t0))}


def child_env(ctx: Ctx, partial) -> Dict[str, Any]:
    figures = te_probe()  # before megatron-core's import (which asks for TE too)
    partial(figures)
    figures.update(gc.child_env(ctx, partial))  # versions, LEV basis, device; bf16 and copy ceilings on CUDA
    return figures


def te_probe() -> Dict[str, Any]:
    """TE's version, whether transformer_engine.pytorch, its extension and fused kernels import, and the
    device's FP8 support as TE reports it."""
    out: Dict[str, Any] = {"te_pytorch": False}
    from importlib.metadata import PackageNotFoundError, version

    # TE 2.13-2.20's library needs cublasLtGroupedMatrixLayoutInit_internal, which cuBLAS 13.1.0.3 (torch
    # 2.11.0+cu130's pin) lacks: the cuBLAS this machine has says whether its import can work (docs/gpu.md).
    for dist in ("nvidia-cublas", "nvidia-cublas-cu13"):
        try:
            out["cublas"] = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:
            out["cublas"] = "no nvidia-cublas package"
    try:
        import transformer_engine

        out["te_version"] = getattr(transformer_engine, "__version__", "?")
        import transformer_engine.pytorch as te  # noqa: F401
        import transformer_engine_torch  # noqa: F401

        out["te_pytorch"] = True
    except Exception as e:  # reported, never hidden: the stages after this one skip with "no TE"
        out["te_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return out
    fused = {}
    for name, path in (("fused_adam", "transformer_engine.pytorch.optimizers:FusedAdam"),
                       ("multi_tensor_l2norm", "transformer_engine_torch:multi_tensor_l2norm"),
                       ("layernorm_linear", "transformer_engine.pytorch:LayerNormLinear"),
                       ("dot_product_attention", "transformer_engine.pytorch:DotProductAttention")):
        mod, attr = path.split(":")
        try:
            fused[name] = hasattr(__import__(mod, fromlist=[attr]), attr)
        except Exception as e:
            fused[name] = f"{type(e).__name__}: {str(e)[:120]}"
    out["te_fused"] = fused
    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            m = __import__(mod, fromlist=["check_fp8_support"])
            ok, why = m.check_fp8_support()
            out.update(fp8_supported=bool(ok), fp8_reason=str(why))
            break
        except Exception as e:
            out["fp8_supported"] = f"unknown ({type(e).__name__} from {mod})"
    return out


# ---------------------------------------------------------------------------------- training runs


def _base(ctx: Ctx, which: str, steps: int) -> List[str]:
    size = ctx.size
    return ["pretrain_lev.py", *size[which]["model"], *gc._transformer(), *size["precision"], *gc.PRODUCTION,
            *gc.NO_COMPILED_FUSIONS, "--train-iters", str(steps), "--lr", "3e-4", "--lr-warmup-iters", "1",
            "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--quiet-config"]


def _arm(ctx: Ctx, arm: str) -> List[str]:
    if arm != "lev":
        return ["--input-embedding", arm]
    basis = ctx.figures("env").get("lev_basis")
    return ["--input-embedding", "lev", *(["--lev-basis", basis] if basis else []), *ctx.size["lev"]]


def _impl(te: bool) -> List[str]:
    return ["--transformer-impl", "transformer_engine" if te else "local"]


def run_jobs(ctx: Ctx, runs: Dict[str, List[Any]], work: Path, deadline: float) -> Dict[str, Dict[str, Any]]:
    """Run pretrain_lev.py argvs at once, each with its metrics file; name -> parse_training's figures,
    exit status and, on failure, the output's tail."""
    jobs = []
    for name, argv in runs.items():
        metrics = work / f"{name}.metrics.jsonl"
        metrics.unlink(missing_ok=True)
        jobs.append(([sys.executable, *argv, "--metrics-file", metrics], work / f"{name}.log"))
    results = run_parallel(jobs, deadline, ctx.env())
    out = {}
    for (name, _), (rc, output) in zip(runs.items(), results):
        r = gc.parse_training(output, work / f"{name}.metrics.jsonl")
        r.update(exit=rc, tail=tail(output, 600) if rc else "")
        r["loaded"] = "successfully loaded checkpoint" in output
        out[name] = r
    if any(rc == TIMEOUT_RC for rc, _ in results):
        raise CheckTimeout(deadline - time.monotonic(), {"runs": out},
                           "; ".join(f"{n}: {r['tail'][-200:]}" for n, r in out.items() if r["exit"]))
    return out


def _problems(runs: Dict[str, Dict[str, Any]], steps: Dict[str, int]) -> List[str]:
    problems = []
    for name, r in runs.items():
        losses = [x for x in r["losses"] if x is not None]
        if r["exit"] != 0:
            problems.append(f"{name}: exit {r['exit']}: {r.get('tail', '')[-300:]}")
        elif r["iterations"] != steps[name]:
            problems.append(f"{name}: {r['iterations']} of {steps[name]} iterations recorded")
        elif not losses or not all(math.isfinite(x) for x in losses):
            problems.append(f"{name}: non-finite or missing losses {r['losses']}")
    return problems


def _agreement(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    if not (a["losses"] and b["losses"]):
        return {}
    return {"first_loss": (a["losses"][0], b["losses"][0]), "first_grad_norm": (a["grad_norms"][0], b["grad_norms"][0]),
            "loss_gap": gc._gap(a["losses"][0], b["losses"][0]),
            "grad_norm_gap": gc._gap(a["grad_norms"][0], b["grad_norms"][0])}


# ---------------------------------------------------------------------------------- correctness


def correctness_runs(ctx: Ctx, work: Path) -> Tuple[Dict[str, List[Any]], Dict[str, List[Any]], Dict[str, List[Any]]]:
    """(saving runs, local continuations, TE continuations): argvs by name."""
    steps = ctx.size["correctness"]["steps"]
    save, local, te = {}, {}, {}
    for arm in ctx.size["correctness"]["arms"]:
        ckpt = work / f"{arm}_ckpt"
        # The same schedule as the continuations (1 + steps iterations), stopped and saved after the first.
        cont = _base(ctx, "correctness", 1 + steps) + _arm(ctx, arm)
        save[f"{arm}_save"] = cont + _impl(False) + ["--save", ckpt, "--save-interval", "1", "--exit-interval", "1"]
        cont = cont + ["--load", ckpt]
        local[f"{arm}_local"] = cont + _impl(False)
        te[f"{arm}_te"] = cont + _impl(True)
    return save, local, te


def judge_correctness(runs: Dict[str, Dict[str, Any]], steps: int) -> Dict[str, Any]:
    want = {n: (1 if n.endswith("_save") else steps) for n in runs}
    problems = _problems(runs, want)
    agreement = {}
    for arm in dict.fromkeys(n.rsplit("_", 1)[0] for n in runs):
        te, local = runs.get(f"{arm}_te"), runs.get(f"{arm}_local")
        for n in (f"{arm}_te", f"{arm}_local"):
            if runs.get(n) and runs[n]["exit"] == 0 and not runs[n]["loaded"]:
                problems.append(f"{n}: did not load the saved checkpoint")
        if te is None or local is None:
            continue
        a = agreement[arm] = _agreement(te, local)
        if not a or a["loss_gap"] is None or a["loss_gap"] > LOSS_RTOL:
            problems.append(f"{arm}: first loss TE {a.get('first_loss')} vs local (gap {a.get('loss_gap')}, "
                            f"tolerance {LOSS_RTOL:g})")
        elif a["grad_norm_gap"] is None or a["grad_norm_gap"] > GRAD_NORM_RTOL:
            problems.append(f"{arm}: first grad norm TE {a['first_grad_norm']} vs local (gap {a['grad_norm_gap']}, "
                            f"tolerance {GRAD_NORM_RTOL:g})")
    figures = {"runs": runs, "agreement": agreement, "tolerance": {"loss": LOSS_RTOL, "grad_norm": GRAD_NORM_RTOL}}
    if problems:
        raise CheckFailed("; ".join(problems), figures)
    return figures


def stage_correctness(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    work = Path(ctx.work) / "te_correctness"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    save, local, te = correctness_runs(ctx, work)
    runs = run_jobs(ctx, save, work, deadline)
    steps = ctx.size["correctness"]["steps"]
    if not te_ready(ctx):
        runs.update(run_jobs(ctx, local, work, deadline))
        judge_correctness(runs, steps)  # the runs that need no TE must pass
        raise Skip(NO_TE, {"runs": runs, "not_run": {n: _cmdline(a) for n, a in te.items()}})
    runs.update(run_jobs(ctx, {**local, **te}, work, deadline))
    return dict(judge_correctness(runs, steps), commands={n: _cmdline(a) for n, a in {**save, **local, **te}.items()})


# ------------------------------------------------------------------------------------------ fp8


def fp8_data(ctx: Ctx, work: Path) -> List[str]:
    """The science run's preprocessed corpus (bench/reproduce.py prepares it), or megatron's mock data."""
    f = ctx.size["fp8"]
    if f["data"] == "mock":
        return ["--mock-data", "--vocab-size", "50257"]
    import reproduce

    a = reproduce.parse_args(["--config", f["config"], "--work-dir", str(work), "--shared-data", ctx.shared_data])
    a.deadline = ctx.deadline
    reproduce.prepare_data(a)
    paths = reproduce.data_paths(a)
    return ["--train-data-path", str(paths["train"]), "--valid-data-path", str(paths["valid"]),
            *reproduce.tokenizer_args(a)]


def fp8_runs(ctx: Ctx, data: List[str], work: Path) -> Dict[str, List[Any]]:
    import reproduce

    f = ctx.size["fp8"]
    cfg = reproduce.CONFIGS[f["config"]]
    base = ["pretrain_lev.py", *cfg["model"], *cfg["batch"], *gc._transformer(), "--bf16", *gc.PRODUCTION,
            "--train-iters", str(f["iters"]), "--lr", cfg["lr"], "--min-lr", cfg["min_lr"],
            "--lr-warmup-iters", str(max(1, f["iters"] // 50)), "--seed", "1234", "--log-interval", "1",
            "--eval-iters", "0", "--quiet-config", "--input-embedding", "lev", *ctx.size["lev"], *data]
    # Each run its own index cache: runs side by side would build and map the same index files at once.
    cache = (lambda name: []) if "--mock-data" in data else (lambda name: ["--data-cache-path", str(work / f"cache_{name}")])
    return {name: base + _impl(te_ready(ctx)) + extra + cache(name) for name, extra in FP8_RUNS.items()}


def last_tenth_gap(fp8: List[float], bf16: List[float]) -> Optional[Dict[str, float]]:
    """Mean loss over the last tenth of the iterations both runs recorded: FP8's relative gap to bf16."""
    n = min(len(fp8), len(bf16))
    if n == 0:
        return None
    k = max(1, n // 10)
    a, b = statistics.fmean(fp8[n - k:n]), statistics.fmean(bf16[n - k:n])
    return {"iterations": n, "last": k, "fp8_mean": a, "bf16_mean": b, "gap": (a - b) / b}


def stage_fp8(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    work = Path(ctx.work) / "te_fp8"
    work.mkdir(parents=True, exist_ok=True)
    data = fp8_data(ctx, work)
    argvs = fp8_runs(ctx, data, work)
    iters = ctx.size["fp8"]["iters"]
    if not te_ready(ctx):  # the bf16 run and the probe (without FP8) run; the FP8 runs need TE
        runs = run_jobs(ctx, {"bf16": argvs["bf16"]}, work, deadline)
        figures = {"runs": runs, "lev_layer": in_child("fp8_probe")(ctx, max(1.0, deadline - time.monotonic())),
                   "not_run": {n: _cmdline(a) for n, a in argvs.items() if n != "bf16"}}
        problems = _problems(runs, {"bf16": iters})
        if problems or not figures["lev_layer"].get("stays_out_of_fp8"):
            raise CheckFailed("; ".join(problems) or f"LEV's layer: {figures['lev_layer']}", figures)
        raise Skip(NO_TE, figures)
    runs = run_jobs(ctx, argvs, work, deadline)
    figures: Dict[str, Any] = {"runs": {n: {k: r[k] for k in ("exit", "iterations", "median_ms") if k in r}
                                        for n, r in runs.items()},
                               "gap": {n: last_tenth_gap(runs[n]["losses"], runs["bf16"]["losses"])
                                       for n in argvs if n != "bf16"},
                               "target": FP8_GAP_TARGET, "commands": {n: _cmdline(a) for n, a in argvs.items()}}
    figures["lev_layer"] = in_child("fp8_probe")(ctx, max(1.0, deadline - time.monotonic()))
    problems = _problems(runs, {n: iters for n in runs})
    if not figures["lev_layer"].get("stays_out_of_fp8"):
        problems.append(f"LEV's layer under FP8: {figures['lev_layer']}")
    if figures["lev_layer"].get("decoder_layers_in_fp8") is False:
        problems.append(f"the decoder did not run in FP8 (--fp8-format hybrid reached no layer): {figures['lev_layer']}")
    if problems:
        raise CheckFailed("; ".join(problems), figures)
    return figures


def child_fp8_probe(ctx: Ctx, partial) -> Dict[str, Any]:
    """One forward and backward of a bf16 lev model built with FP8 (hybrid, delayed; without TE, without
    FP8): the LEV layer's output dtype, its parameters' dtypes and any TE module inside it."""
    import torch
    from lev_layer import _init_parallel
    from throughput import _build

    device = ctx.device
    _init_parallel(device)
    shape = ctx.size["probe"]
    fp8 = "hybrid" if te_ready(ctx) else None
    # GPT-2's 50257 ids pad to 50304 rows, as in the speed stage.
    model, *_ = _build({"name": "lev", "arm": "lev"}, shape, device, "bfloat16", fp8)
    seen: Dict[str, str] = {}
    model.embedding.register_forward_hook(lambda m, i, o: seen.update(output=str(o.dtype)))
    decoder_fp8: List[bool] = []  # FP8 on in each decoder layer's forward (TE's state, not the flag we passed)
    if fp8:
        state = _fp8_state_manager()
        for layer in model.decoder.layers:
            layer.register_forward_pre_hook(lambda m, i: decoder_fp8.append(bool(state.is_fp8_enabled())))
    ids = torch.randint(0, 50257, (shape["micro_batch"], shape["seq"]), device=device)
    pos = torch.arange(shape["seq"], device=device).unsqueeze(0).expand_as(ids)
    model(ids, pos, attention_mask=None, labels=torch.roll(ids, -1, 1)).float().mean().backward()
    params = sorted({str(p.dtype) for p in model.embedding.parameters()})
    te_inside = [n for n, m in model.embedding.named_modules() if type(m).__module__.startswith("transformer_engine")]
    te_outside = sum(type(m).__module__.startswith("transformer_engine") for m in model.decoder.modules())
    ok = seen.get("output") == "torch.bfloat16" and set(params) <= {"torch.bfloat16", "torch.float32"} and not te_inside
    decoder_in_fp8 = bool(decoder_fp8) and all(decoder_fp8) if fp8 else None
    return {"fp8": fp8, "lev_output_dtype": seen.get("output"), "lev_param_dtypes": params,
            "te_modules_in_lev": te_inside, "te_modules_in_decoder": te_outside, "stays_out_of_fp8": ok,
            # The comparison means something only if the decoder did run in FP8 while LEV stayed out.
            "decoder_layers_in_fp8": decoder_in_fp8, "decoder_layer_calls": len(decoder_fp8)}


def _fp8_state_manager():
    """Transformer Engine's FP8GlobalStateManager (``quantization`` in newer releases, ``fp8`` before)."""
    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            return __import__(mod, fromlist=["FP8GlobalStateManager"]).FP8GlobalStateManager
        except (ImportError, AttributeError):
            continue
    raise ImportError("Transformer Engine has no FP8GlobalStateManager in transformer_engine.pytorch.quantization "
                      "or .fp8")


# ------------------------------------------------------------------------------------------ speed


def speed_shapes(sizes: str) -> List[Tuple[str, Dict[str, Any]]]:
    from throughput import CONFIGS

    return [(s, TINY_SHAPE if s == "tiny" else CONFIGS[s]) for s in SIZES[sizes]["speed"]["shapes"]]


def flops_per_token(shape: Dict[str, Any]) -> float:
    """Training FLOPs per token of the tied model of a bench/throughput.py shape (its FFN and vocabulary)."""
    from types import SimpleNamespace

    from megatron_lev.training.flops import transformer_forward_flops_per_token

    cfg = SimpleNamespace(hidden_size=shape["hidden"], num_layers=shape["layers"], num_attention_heads=shape["heads"],
                          kv_channels=None, num_query_groups=None, ffn_hidden_size=shape.get("ffn", 4 * shape["hidden"]),
                          gated_linear_unit=True)
    return 3.0 * transformer_forward_flops_per_token(cfg, shape.get("vocab", 50304), shape["seq"])


def child_speed(ctx: Ctx, partial) -> Dict[str, Any]:
    import torch
    from lev_layer import _init_parallel
    from throughput import arm_list, measure

    device = ctx.device
    _init_parallel(device)
    arms = [a for a in arm_list(device, ("unique",)) if a["arm"] != "lev" or a.get("default")]
    sp = ctx.size["speed"]
    ceiling = ctx.figures("env").get("bf16_matmul_tflops")
    precisions = [None, "hybrid"] if te_ready(ctx) else [None]
    figures: Dict[str, Any] = {"device": device, "bf16_ceiling_tflops": ceiling, "shapes": {}}
    for title, shape in speed_shapes(ctx.sizes):
        for fp8 in precisions:
            res = measure(shape, arms, device=device, dtype_name="bfloat16" if device == "cuda" else "float32",
                          repeats=sp["repeats"], warmup=sp["warmup"], shared=Path(ctx.shared_data), fp8=fp8, log=print)
            f = gc._throughput_figures(res)
            flops = flops_per_token(shape)
            for a in f["arms"].values():
                a["tflops"] = flops * a["tokens_per_s"] / 1e12
                a["mfu"] = a["tflops"] / ceiling if ceiling else None
            figures["shapes"].setdefault(title, {})["fp8" if fp8 else "bf16"] = f
            partial(figures)
            if device == "cuda":  # the next measure builds three models of its own
                torch.cuda.empty_cache()
    for s in figures["shapes"].values():
        if "fp8" in s:
            s["fp8_over_bf16"] = {k: s["fp8"]["arms"][k]["ms_per_iter"] / s["bf16"]["arms"][k]["ms_per_iter"]
                                  for k in s["bf16"]["arms"]}
    if not te_ready(ctx):
        raise Skip(NO_TE, dict(figures, not_run="FP8 (hybrid, delayed) at every shape, and the TE spec's bf16"))
    return figures


# ------------------------------------------------------------------------------------------ checkpoint


def checkpoint_runs(ctx: Ctx, work: Path) -> Tuple[Dict[str, List[Any]], Dict[str, List[Any]]]:
    steps = ctx.size["checkpoint"]["steps"]
    ckpt = work / "te_ckpt"
    # One schedule for the three (megatron refuses to resume a different one), the first stopped and saved.
    run = _base(ctx, "checkpoint", 2 * steps) + _arm(ctx, "lev")
    save = {"te_save": run + _impl(True) + ["--save", ckpt, "--save-interval", str(steps), "--exit-interval", str(steps)]}
    cont = run + ["--load", ckpt]
    return save, {"local_from_te": cont + _impl(False), "te_from_te": cont + _impl(True)}


def stage_checkpoint(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    work = Path(ctx.work) / "te_checkpoint"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    save, cont = checkpoint_runs(ctx, work)
    commands = {n: _cmdline(a) for n, a in {**save, **cont}.items()}
    if not te_ready(ctx):
        raise Skip(NO_TE, {"not_run": commands})
    steps = ctx.size["checkpoint"]["steps"]
    runs = run_jobs(ctx, save, work, deadline)
    runs.update(run_jobs(ctx, cont, work, deadline))
    problems = _problems(runs, {n: steps for n in runs})
    problems += [f"{n}: did not load the TE checkpoint" for n in cont if runs[n]["exit"] == 0 and not runs[n]["loaded"]]
    a = _agreement(runs["local_from_te"], runs["te_from_te"])
    if a and (a["loss_gap"] is None or a["loss_gap"] > LOSS_RTOL):
        problems.append(f"first loss after loading: local {a['first_loss'][0]} vs TE {a['first_loss'][1]} "
                        f"(gap {a['loss_gap']}, tolerance {LOSS_RTOL:g})")
    figures = {"runs": runs, "agreement": a, "commands": commands}
    if problems:
        raise CheckFailed("; ".join(problems), figures)
    return figures


# ------------------------------------------------------------------------------------------ program

CHILD_FUNCS = {"env": child_env, "speed": child_speed, "fp8_probe": child_fp8_probe}
STAGES: Tuple[Stage, ...] = (
    Stage("install", stage_install, cuda=False),
    Stage("env", in_child("env"), cuda=False),
    Stage("correctness", stage_correctness),
    Stage("fp8", stage_fp8),
    Stage("speed", in_child("speed")),
    Stage("checkpoint", stage_checkpoint),
)


def stage_seconds(budget_s: float) -> Dict[str, float]:
    """Each stage's limit: ``BASE_S`` (which sums to ``BUDGET_S`` less the reserve) in proportion to the budget."""
    return {name: s * budget_s / BUDGET_S for name, s in BASE_S.items()}


def carry_calls(root: Path = CARRY) -> Tuple[int, str]:
    """(calls that carry TE's pieces, where the count comes from)."""
    m = pieces_manifest(root)
    if m is None:
        return PIECES_ASSUMED, f"assumed: no {root}/{PIECES}.1/manifest.json here yet (run bench/prepare_te.py)"
    return len(m["pieces"]), f"{root}/{PIECES}.*/manifest.json"


def plan(budget_s: float, sizes: str = "device", assume_tflops: Optional[float] = None,
         shared_data: str = str(gc.SHARED)) -> List[Dict[str, Any]]:
    size = SIZES[sizes]
    secs = stage_seconds(budget_s)
    c, f = size["correctness"], size["fp8"]
    shapes = ", ".join(f"{t} {s['layers']} x {s['hidden']} seq {s['seq']} micro-batch {s['micro_batch']}"
                       + (f" vocab {s['vocab']}" if "vocab" in s else "") for t, s in speed_shapes(sizes))
    what = {
        "install": "the carried wheels and TE's pieces (joined, sha256-checked) into WORK/site; the extension built "
                   "there when the pieces carry its source; nothing once an earlier call installed them",
        "env": "TE version, transformer_engine.pytorch and its fused kernels importable, the device's FP8 support, "
               "versions, the LEV basis, the bf16 matrix and copy ceilings",
        "correctness": f"pretrain_lev.py {c['describe']}, bf16: {', '.join(c['arms'])}, each one iteration saved on the "
                       f"local spec then {c['steps']} more on the local and the TE spec; first-iteration loss and "
                       f"grad norm within {LOSS_RTOL:g} / {GRAD_NORM_RTOL:g}",
        "fp8": f"lev, {f['describe']}: bf16, FP8 hybrid delayed, FP8 tensorwise current scaling at once; loss gap "
               f"over the last tenth (target {FP8_GAP_TARGET:.0%}); LEV's layer out of FP8 (probe)",
        "speed": f"tied, untied, lev round-robin medians, TE bf16 and FP8 hybrid, at {shapes}; TFLOP/s, MFU vs the "
                 "bf16 ceiling, LEV/TIED, LEV/UNTIED, FP8/bf16",
        "checkpoint": "lev saved under the TE spec, continued by the local spec and by the TE spec: it loads, "
                      f"first losses within {LOSS_RTOL:g}",
    }
    return [{"name": n, "planned_s": secs[n], "what": what[n]} for n in BASE_S]


def window(budget_s: float, root: Path = CARRY) -> Dict[str, Any]:
    """The 15-minute window: machine start, the calls that carry TE's pieces (the last one runs the
    install stage), the run's call (every other stage), what is left."""
    calls, source = carry_calls(root)
    install = stage_seconds(budget_s)["install"]
    used = MACHINE_START_S + (calls + 1) * CALL_S + budget_s
    return {"window_s": WINDOW_S, "machine_start_s": MACHINE_START_S, "carry_calls": calls, "carry_source": source,
            "calls_s": (calls + 1) * CALL_S, "install_s": install, "run_s": budget_s - install, "left_s": WINDOW_S - used}


def plan_lines(entries: List[Dict[str, Any]], budget_s: float, sizes: str, assume_tflops: Optional[float]) -> List[str]:
    w = window(budget_s)
    n = w["carry_calls"]
    lines = [f"window: {w['window_s']:.0f} s of device time: machine start {w['machine_start_s']:.0f} s, "
             f"{n + 1} calls x {CALL_S:.0f} s = {w['calls_s']:.0f} s ({n} carrying TE's pieces: {w['carry_source']}; "
             f"one running the stages), the install stage {w['install_s']:.0f} s in the last carrying call, the "
             f"other stages {w['run_s']:.0f} s; {w['left_s']:.0f} s left",
             f"calls 1-{n}: carry .carry/{PIECES}.N, one a call; the last runs `python bench/gpu_check.py "
             f"--program te --only install --work .carry/work --out .carry/install --budget-s 800` (docs/gpu.md)",
             f"call {n + 1}: carries wheels and .cache/gpu_data, runs `python bench/gpu_check.py --program te --work "
             ".carry/work --out $OUT --shared-data .cache/gpu_data` (its install stage adds the wheels, finds TE there)",
             f"plan: budget {budget_s:g} s at the {sizes} sizes, {RESERVE_S:g} s kept for the last report write"]
    lines += [f"stage {e['name']}: planned {e['planned_s']:.0f} s - {e['what']}" for e in entries]
    return lines


def not_run_notes(ctx: Ctx) -> List[str]:
    notes = ["One GPU: TP=1; TE's tensor-parallel communication overlap and FP8 all-gathers are not exercised."]
    if not te_ready(ctx):
        notes.append("Transformer Engine did not import here: every TE and FP8 run was skipped (\"no TE\"); no TE or "
                     "FP8 figure in this report.")
    if not ctx.cuda:
        notes.append("No CUDA device: the stages ran at the tiny sizes on the CPU; no figure here is a GPU figure.")
    return notes


def _md_runs(runs: Dict[str, Dict[str, Any]]) -> List[str]:
    L = ["| run | exit | iterations | first loss | first grad norm | last loss | median ms |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        L.append(f"| {name} | {r['exit']} | {r['iterations']} | {gc._n((r['losses'] or [None])[0], 7)} | "
                 f"{gc._n((r['grad_norms'] or [None])[0], 6)} | {gc._n((r['losses'] or [None])[-1], 6)} | "
                 f"{gc._n(r.get('median_ms'), 4)} |")
    return L


def _md_not_run(f: Dict[str, Any]) -> List[str]:
    nr = f.get("not_run")
    if not nr:
        return []
    if isinstance(nr, str):
        return ["", f"Not run: {nr}."]
    return ["", "Not run (no TE):", ""] + [f"- {n}: `{c}`" for n, c in nr.items()]


def _md_env(f):
    keys = ("te_version", "te_pytorch", "te_error", "cublas", "te_fused", "fp8_supported", "fp8_reason", "lev_basis",
            "bf16_matmul_tflops", "copy_tb_per_s")
    return [f"- {k}: {f[k]}" for k in keys if k in f]


def _md_correctness(f):
    L = (_md_runs(f["runs"]) if f.get("runs") else [])
    for arm, a in (f.get("agreement") or {}).items():
        if a:
            L.append(f"- {arm}: TE vs local first loss gap {gc._n(a['loss_gap'])}, grad norm gap {gc._n(a['grad_norm_gap'])} "
                     f"(tolerances {LOSS_RTOL:g} / {GRAD_NORM_RTOL:g})")
    return L + _md_not_run(f)


def _md_fp8(f):
    L = []
    for n, g in (f.get("gap") or {}).items():
        if g:
            L.append(f"- {n}: loss over the last {g['last']} of {g['iterations']} iterations {g['fp8_mean']:.4f} vs bf16 "
                     f"{g['bf16_mean']:.4f}: gap {100 * g['gap']:+.2f}% (target within {100 * FP8_GAP_TARGET:.0f}%)")
    if f.get("lev_layer"):
        L.append(f"- LEV's layer under FP8: {f['lev_layer']}")
    return L + _md_not_run(f)


def _md_speed(f):
    L = [f"bf16 ceiling {f.get('bf16_ceiling_tflops')} TFLOP/s (env stage)."]
    for title, s in f["shapes"].items():
        for prec in ("bf16", "fp8"):
            if prec not in s:
                continue
            x = s[prec]
            L += ["", f"### {title}, {prec}: LEV/TIED {x['lev_over_tied']:.3f}, LEV/UNTIED {x['lev_over_untied']:.3f}", "",
                  "| arm | ms/iter | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|---|"]
            L += [f"| {k} | {a['ms_per_iter']:.2f} | {a['tokens_per_s']:,.0f} | {a['tflops']:.1f} | "
                  f"{gc._n(a['mfu'])} |" for k, a in x["arms"].items()]
        if "fp8_over_bf16" in s:
            L.append("FP8/bf16 step: " + ", ".join(f"{k} {v:.3f}" for k, v in s["fp8_over_bf16"].items()))
    return L + _md_not_run(f)


def _md_checkpoint(f):
    L = _md_runs(f["runs"]) if f.get("runs") else []
    if f.get("agreement"):
        L.append(f"- first loss after loading, local vs TE: gap {gc._n(f['agreement']['loss_gap'])}")
    return L + _md_not_run(f)


MARKDOWN = {"install": lambda f: [f"- {k}: {v}" for k, v in f.items()], "env": _md_env, "correctness": _md_correctness, "fp8": _md_fp8, "speed": _md_speed,
            "checkpoint": _md_checkpoint}
