#!/usr/bin/env python
"""The one-GPU check: what this project can only prove on a CUDA device, in one command that fits a
short lease.

    python bench/gpu_check.py --out OUT --budget-s 400 [--wheels wheels] [--shared-data DIR] [--only a,b] [--skip a,b]
    python bench/gpu_check.py --prepare-wheels wheels        # here (with PyPI): the wheels the GPU box lacks
    python bench/gpu_check.py --prepare-data .cache/gpu_data  # here: the shared data the checks read, to carry

Checks, in the order of what we most need to know (``CHECKS`` holds each one's timeout and estimate):

  install          ``pip install --no-index --no-deps --target WORK/site`` of the wheels in ``--wheels`` whose
                   module is not importable (megatron-core, a few small pure dependencies); children see WORK/site.
  env              python, torch, CUDA device, megatron-core, Transformer Engine, apex, Triton, pytest; the
                   device's bf16 matrix rate and copy bandwidth (the ceilings the later figures are read against).
  lev_layer        the LEV layer on CUDA against the fp64 CPU layer holding the same weights, forward and every
                   gradient: eager (sparse) and Triton bases, fp32 and bf16, unique and table modes. The kernels
                   are registered first and each row records the basis that actually ran (counted calls).
  train_tied       ``pretrain_lev.py`` for ``--steps`` bf16 steps at TP=1 over NCCL, mock data; then
  train_lev        the LEV arm (unique mode), and
  train_lev_table  LEV in table mode with the distributed optimizer and overlapped grad reduce (the shipped
                   Pile configs' flags); its first-iteration grad norm must match train_lev's.
  throughput       ``bench/throughput.py --config gpu-400m``: LEV/TIED and LEV/UNTIED median step ratios.
  kernel           ``bench/lev_layer.py --kernel-only``: Triton forward/backward per 1,000 ids against the
                   published fused-kernel figure (Kitsunp's, ``lev_layer.ANCHOR_MS_PER_1K``).
  pytest_gpu       ``pytest -m "gpu and not te"`` (``gpu`` where TE imports) when pytest is installed.
  next_mcore       the newest megatron-core wheel in ``--wheels/next`` and a 2-step LEV run on it (optional).
  science          only with time left: tied and LEV for one pass over ``--corpus`` at ~125M parameters in
                   bf16, preprocessed there, evaluated, reported (``bench/gpu_science.py``); its time is
                   estimated from the training checks' measured throughput and it is skipped when it does
                   not fit.

Budget: ``--budget-s`` is enforced. A check whose estimate does not fit in what is left is skipped with
"budget: needs ~X s, Y s left"; a running check is killed at its own timeout or at the budget's end,
whichever is first (every check runs in a child process or a subprocess, its process group killed).
A check that needs CUDA is skipped with "no CUDA device" where there is none, so the script (and its
report) runs anywhere.

Output: ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``, rewritten (tmp file + rename) before the first
check and after every check, so a killed run keeps what it learnt; ``throughput.md`` and the science
run's ``science.md`` beside them (the device returns at most 8 files). Logs and scratch files go to
``--work`` (default ``OUT/../gpu_check_work``). The JSON: ``{"state": "running"|"done", "created",
"command", "budget_s", "elapsed_s", "checks": [{"name", "status": ok|failed|skipped, "reason",
"seconds", "figures", "log_tail"}], "pending": [...], "not_run": [...]}``. Exit status 0 when no
check failed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
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
# bench/gpu_science.py imports this module by name: run as a script, it is that module too (one Skip class).
sys.modules.setdefault("gpu_check", sys.modules[__name__])
SHARED = REPO.parent / "shared" / "data"

# What a bare GPU image (torch, triton, transformers, tokenizers, sentencepiece, safetensors) may lack.
WHEELS = ("megatron-core==0.16.1", "tiktoken", "zstandard", "psutil", "pyyaml")
NEXT_MCORE = "megatron-core>=0.19,<0.20"  # the newer release pyproject admits and make test-next tests
MODULE_OF = {"megatron-core": "megatron.core", "pyyaml": "yaml"}
LAYER_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max |error| / max |reference|; LEV's GEMMs are true fp32 (no TF32)
GRAD_NORM_TOLERANCE = 0.1  # relative gap of the first grad norm, table+distopt+overlap vs unique
MEM_RE = re.compile(r"mem allocated \(GiB\): ([\d.]+)")
RESERVE_S = 5.0  # kept back from the budget for the last report write
LINE_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                     r".*?TFLOP/s/GPU\): ([\d.]+) \|.*?tokens per second: ([\d.]+) \|")


class Skip(Exception):
    """A check that cannot run here; the message says why."""


class CheckFailed(Exception):
    """A check that ran and found a fault; ``figures`` are kept in the report."""

    def __init__(self, message: str, figures: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.figures = figures or {}


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[["Ctx", float], Dict[str, Any]]
    """run(ctx, timeout_s) -> figures; raises Skip, CheckFailed or CheckTimeout."""
    timeout_s: float
    """Its own limit; the runner passes min(this, what is left of the budget)."""
    estimate_s: Any
    """Seconds it is expected to take (a number, or estimate(ctx) -> (seconds, basis) or raises Skip)."""
    cuda: bool = True
    """Skipped with "no CUDA device" where torch sees none."""


class CheckTimeout(Exception):
    def __init__(self, seconds: float, figures: Optional[Dict[str, Any]] = None, log_tail: str = ""):
        super().__init__(f"timeout: killed after {seconds:.0f} s")
        self.figures, self.log_tail = figures or {}, log_tail


@dataclass
class Ctx:
    out: str
    work: str
    wheels: Optional[str]
    shared_data: str
    corpus: str
    steps: int
    cuda: bool
    site: Optional[str] = None  # WORK/site once install put something there
    have_te: bool = False
    science_tflops: Optional[float] = None
    timeout_s: Optional[float] = None  # the running child's timeout
    results: Optional[Dict[str, Dict[str, Any]]] = None  # earlier checks' entries, by name

    def env(self) -> Dict[str, str]:
        """The environment of every child: WORK/site and the repository first on the import path."""
        path = [p for p in (self.site, str(REPO), os.environ.get("PYTHONPATH")) if p]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(path))
        # One compile cache for every child: each arm's first step would otherwise recompile the Triton
        # kernels and megatron's torch.compile'd fusions from nothing.
        env.setdefault("TRITON_CACHE_DIR", os.path.join(self.work, "triton_cache"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(self.work, "inductor_cache"))
        return env

    def figures(self, name: str) -> Dict[str, Any]:
        entry = (self.results or {}).get(name) or {}
        return entry.get("figures", {}) if entry.get("status") == "ok" else {}


# --------------------------------------------------------------------------------------- processes


def _tail(text: str, n: int = 2000) -> str:
    return text[-n:] if text else ""


def run_logged(cmd: Sequence[str], timeout: float, log: Path, env: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
    """Run ``cmd`` (from the repository root) with stdout+stderr to ``log``; (exit status, output).

    At ``timeout`` the whole process group is killed (a launcher's workers too) and 124 is returned:
    the output written until then stays in the log. The group stays in this session, so whatever
    ends this run's session (a device's command limit) ends the group too."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        p = subprocess.Popen(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO),
                             env=env, process_group=0)
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
    return rc, log.read_text(encoding="utf-8", errors="replace")


def _write_json(path: Path, obj: Any) -> None:
    """Atomic: a reader (or a killed run) sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def in_child(name: str) -> Callable[[Ctx, float], Dict[str, Any]]:
    """Run CHILD_FUNCS[name](ctx) in a fresh process (its own CUDA context, killable at the timeout).

    The child writes its figures (or its error) to a JSON file; a child may rewrite that file while it
    runs (``partial`` figures), so a timeout still reports what it measured."""

    def run(ctx: Ctx, timeout: float) -> Dict[str, Any]:
        work = Path(ctx.work)
        ctx_file, result = work / f"{name}.ctx.json", work / f"{name}.result.json"
        result.unlink(missing_ok=True)
        ctx.timeout_s = timeout
        _write_json(ctx_file, ctx.__dict__)
        rc, output = run_logged([sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-ctx",
                                 str(ctx_file), "--child-result", str(result)], timeout,
                                work / "logs" / f"{name}.log", ctx.env())
        res = json.loads(result.read_text()) if result.exists() else {}
        figures = res.get("figures", {})
        if rc == 124:
            raise CheckTimeout(timeout, figures, _tail(output))
        if res.get("status") == "skipped":
            raise Skip(res["reason"])
        if res.get("status") == "failed":
            raise CheckFailed(res["reason"], figures)
        if rc != 0 or res.get("status") != "ok":
            raise CheckFailed(f"child exited {rc} without a result: {_tail(output, 400)}", figures)
        return figures

    return run


def child_main(name: str, ctx_file: str, result_file: str) -> int:
    ctx = Ctx(**json.loads(Path(ctx_file).read_text()))
    out = Path(result_file)

    def partial(figures: Dict[str, Any]) -> None:
        _write_json(out, {"status": "running", "figures": figures})

    try:
        figures = CHILD_FUNCS[name](ctx, partial)
        _write_json(out, {"status": "ok", "figures": figures})
    except Skip as e:
        _write_json(out, {"status": "skipped", "reason": str(e)})
    except CheckFailed as e:
        _write_json(out, {"status": "failed", "reason": str(e), "figures": e.figures})
    except Exception as e:  # reported in the file, never hidden
        import traceback

        traceback.print_exc()
        _write_json(out, {"status": "failed", "reason": f"{type(e).__name__}: {e}"})
    return 0


# ------------------------------------------------------------------------------------------ checks


def _importable(module: str, env: Optional[Dict[str, str]] = None) -> bool:
    """Whether ``module`` imports (in a child when ``env`` is given: WORK/site may hold it)."""
    if env is None:
        try:
            return importlib.util.find_spec(module.split(".")[0]) is not None and bool(__import__(module))
        except Exception:
            return False
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, env=env, timeout=60)
    return r.returncode == 0


def check_install(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    wheel_dir = ctx.wheels
    if not wheel_dir or not Path(wheel_dir).is_dir():
        raise Skip(f"no wheel directory ({wheel_dir}); nothing to install")
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    missing, present = [], []
    for w in wheels:
        dist = Path(w).name.split("-")[0].replace("_", "-").lower()
        module = MODULE_OF.get(dist, dist.replace("-", "_"))
        (present if _importable(module) else missing).append(Path(w).name)
    if not missing:
        return {"installed": [], "already_importable": present}
    site = Path(ctx.work) / "site"
    rc, output = run_logged([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--no-cache-dir", "--upgrade", "--target", str(site),
                             *[os.path.join(wheel_dir, m) for m in missing]],
                            timeout, Path(ctx.work) / "logs" / "install.log")
    if rc == 124:
        raise CheckTimeout(timeout, log_tail=_tail(output))
    if rc != 0:
        raise CheckFailed(f"pip install exit {rc}: {_tail(output, 400)}")
    ctx.site = str(site)
    sys.path.insert(0, ctx.site)  # the science estimate reads the library's FLOP counts here
    return {"installed": missing, "already_importable": present, "target": str(site)}


def child_env(ctx: Ctx, partial) -> Dict[str, Any]:
    import torch

    figures: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    for mod in ("megatron.core", "transformer_engine", "apex", "triton", "pytest", "numba", "zstandard"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            figures[mod] = str(getattr(m, "__version__", "yes"))
        except Exception as e:
            figures[mod] = f"not importable ({type(e).__name__})"
    # torch.compile's Triton backend builds a C launcher at run time: without both, the fusions stay off.
    import shutil
    import sysconfig

    figures["c_compiler"] = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or None
    figures["python_headers"] = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not torch.cuda.is_available():
        figures["device"] = None
        return figures
    props = torch.cuda.get_device_properties(0)
    figures.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
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


def child_lev_layer(ctx: Ctx, partial) -> Dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    rows = compare_lev_layer("cuda", bases=("sparse", "triton"), partial=partial)
    return judge_layer_rows(rows)


def judge_layer_rows(rows: Dict[str, Any]) -> Dict[str, Any]:
    """Fail on any row over its tolerance or whose basis did not run as asked (figures kept)."""
    bad = [k for k, v in rows.items() if not v["max_rel_error"] <= LAYER_TOLERANCE[v["dtype"]]]
    wrong = [k for k, v in rows.items() if not v["basis_ok"]]
    if bad or wrong:
        raise CheckFailed(f"LEV layer on CUDA vs the fp64 CPU layer: over tolerance {bad}; basis not run as asked "
                          f"{wrong}", rows)
    return rows


@contextlib.contextmanager
def basis_probe():
    """Count which separable-product implementations run: the registered fused kernels (by basis, and
    their eager fallback for flagged inputs) and the eager form (by basis). Yields the Counter."""
    from megatron_lev.lev import functional

    counts: collections.Counter = collections.Counter()
    fused = dict(functional._FUSED_PRODUCTS)
    eager = functional._SeparableProduct.apply

    def wrap(basis, fn):
        def product(x, delta, num_knots, *, log_eps, fallback):
            counts[f"{basis} kernel"] += 1

            def counted_fallback(x_, d_):
                counts[f"{basis} kernel's eager fallback"] += 1
                return fallback(x_, d_)

            return fn(x, delta, num_knots, log_eps=log_eps, fallback=counted_fallback)

        return product

    def eager_apply(x, delta, num_knots, basis, *rest):
        counts[f"eager {basis}"] += 1
        return eager(x, delta, num_knots, basis, *rest)

    for (basis, device), fn in fused.items():
        functional._FUSED_PRODUCTS[(basis, device)] = wrap(basis, fn)
    functional._SeparableProduct.apply = eager_apply
    try:
        yield counts
    finally:
        functional._FUSED_PRODUCTS.clear()
        functional._FUSED_PRODUCTS.update(fused)
        functional._SeparableProduct.apply = eager


def _ran_as_asked(basis: str, counts: Dict[str, int]) -> bool:
    """Every product of the row ran in the asked basis (a fused kernel's flagged inputs may fall back)."""
    if basis in ("triton", "fused"):
        return counts.get(f"{basis} kernel", 0) > 0 and all(
            k.startswith(basis) or k == "eager dense" and counts.get(f"{basis} kernel's eager fallback")
            for k in counts)
    return set(counts) == {f"eager {basis}"}


def compare_lev_layer(device: str = "cuda", vocab: int = 4099, hidden: int = 256, batch=(4, 512),
                      lev_kw: Optional[Dict[str, Any]] = None, bases: Sequence[str] = ("sparse", "triton"),
                      dtypes: Sequence[str] = ("float32", "bfloat16"), modes: Sequence[str] = ("unique", "table"),
                      partial=None) -> Dict[str, Any]:
    """The LEV layer on ``device`` against the fp64 CPU layer holding the same weights (the paper's
    defaults unless ``lev_kw``): max |error| / max |reference| of the forward and of every gradient,
    per ``mode/dtype/basis`` row, with the implementations that actually ran (``ran``) and whether
    they are the asked basis (``basis_ok``). The fused kernels are registered first, so "triton" is
    the Triton kernel where one exists (an error where none does, as the layer's ``--lev-basis triton``)."""
    import torch

    from megatron_lev.kernels import register_default_kernels
    from megatron_lev.lev import LEVConfig, LEVEmbedding

    register_default_kernels()
    kw = dict(lev_kw or {}, chunk_size=1024)
    ids = torch.randint(0, vocab, batch, generator=torch.Generator().manual_seed(0))
    up = torch.randn(*batch, hidden, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out: Dict[str, Any] = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        source = LEVEmbedding(vocab, hidden, LEVConfig(**kw), init_seed=1, device=device, dtype=dtype)
        ref = LEVEmbedding(vocab, hidden, LEVConfig(**dict(kw, basis="dense")), initialize=False, dtype=torch.float64)
        ref.load_state_dict({k: v.to("cpu", torch.float64) for k, v in source.state_dict().items()})
        y_ref = ref(ids)
        (y_ref * up).sum().backward()
        for mode in modes:
            for basis in bases:
                layer = LEVEmbedding(vocab, hidden, LEVConfig(**dict(kw, compute_mode=mode, basis=basis)),
                                     initialize=False, device=device, dtype=dtype)
                layer.load_state_dict(source.state_dict())
                with basis_probe() as counts:
                    y = layer(ids.to(device))
                    (y.float() * up.to(device, torch.float32)).sum().backward()
                    if mode == "table":
                        layer.finish_table_step()
                errs = {"forward": _rel(y, y_ref)}
                for (pname, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
                    errs[pname] = _rel(p.grad, q.grad)
                out[f"{mode}/{dtype_name}/{basis}"] = {
                    "mode": mode, "dtype": dtype_name, "basis": basis, "max_rel_error": max(errs.values()),
                    "errors": errs, "ran": dict(counts), "basis_ok": _ran_as_asked(basis, counts),
                    "params_device": str(layer.offset.device), "params_dtype": str(layer.offset.dtype)}
                if partial is not None:
                    partial(out)
                del layer
        del source, ref
    return out


def _rel(a, b) -> float:
    a, b = a.detach().to("cpu", b.dtype), b.detach()
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    return err if math.isfinite(err) else float("inf")


def _pretrain_argv(arm: str, steps: int, extra: Sequence[str] = ()) -> List[str]:
    return ["pretrain_lev.py", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "8",
            "--global-batch-size", "8", "--train-iters", str(steps), "--lr", "3e-4", "--lr-warmup-iters", "2",
            "--mock-data", "--vocab-size", "50257", "--bf16", "--log-interval", "1", "--eval-iters", "0",
            "--quiet-config", "--input-embedding", arm, *extra]


TABLE_FLAGS = ("--lev-compute-mode", "table", "--use-distributed-optimizer", "--overlap-grad-reduce")


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


def train_check(arm: str, extra: Sequence[str] = ()) -> Callable[[Ctx, float], Dict[str, Any]]:
    def run(ctx: Ctx, timeout: float) -> Dict[str, Any]:
        name = "train_" + arm + ("_table" if extra else "")
        metrics = Path(ctx.work) / f"{name}.metrics.jsonl"
        metrics.unlink(missing_ok=True)
        t0 = time.monotonic()
        rc, output = run_logged([sys.executable, *_pretrain_argv(arm, ctx.steps, extra), "--metrics-file", metrics],
                                timeout, Path(ctx.work) / "logs" / f"{name}.log", ctx.env())
        figures = parse_training(output, metrics)
        figures.update(exit=rc, seconds=round(time.monotonic() - t0, 1), flags=list(extra))
        figures["startup_s"] = round(figures["seconds"] - figures.get("total_step_s", 0.0), 1)
        if rc == 124:
            raise CheckTimeout(timeout, figures, _tail(output))
        problems = []
        if figures["iterations"] != ctx.steps:
            problems.append(f"{figures['iterations']} of {ctx.steps} iterations recorded")
        losses = [x for x in figures["losses"] if x is not None]
        if not losses or not all(math.isfinite(x) for x in losses):
            problems.append(f"non-finite or missing losses {figures['losses']}")
        elif len(losses) > 1 and not losses[-1] < losses[0]:
            problems.append(f"loss did not decrease ({losses[0]:.3f} -> {losses[-1]:.3f})")
        if extra:
            ref = ctx.figures("train_lev").get("grad_norms") or [None]
            got = figures["grad_norms"][:1] or [None]
            if ref[0] and got[0]:
                gap = abs(got[0] - ref[0]) / ref[0]
                figures["first_grad_norm_vs_unique"] = {"unique": ref[0], "table": got[0], "relative_gap": gap}
                if gap > GRAD_NORM_TOLERANCE:
                    problems.append(f"first grad norm {got[0]:.4f} vs {ref[0]:.4f} in unique mode "
                                    f"(gap {100 * gap:.1f}% > {100 * GRAD_NORM_TOLERANCE:.0f}%): table-mode gradients lost?")
        if rc != 0:
            problems.append(f"exit {rc}: {_tail(output, 600)}")
        if problems:
            raise CheckFailed("; ".join(problems), figures)
        return figures

    return run


def check_throughput(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    work = Path(ctx.work)
    md, js = work / "throughput.md", work / "throughput.json"
    js.unlink(missing_ok=True)
    rc, output = run_logged([sys.executable, "bench/throughput.py", "--config", "gpu-400m", "--skip-preprocess",
                             "--modes", "unique,table", "--repeats", "5", "--shared-data", ctx.shared_data,
                             "--output", md, "--json", js], timeout, work / "logs" / "throughput.log", ctx.env())
    if rc == 124:
        raise CheckTimeout(timeout, log_tail=_tail(output))
    if rc != 0 or not js.exists():
        raise CheckFailed(f"bench/throughput.py exit {rc}: {_tail(output, 600)}")
    shutil.copy(md, Path(ctx.out) / "throughput.md")
    data = json.loads(js.read_text())
    arms = {}
    for sec in data.get("sections", []):
        for name, a in sec["result"]["arms"].items():
            arms[f"{sec['title']}: {name}"] = {k: a.get(k) for k in ("ms_per_iter", "ms_min", "tokens_per_s",
                                                                      "peak_extra_mib") if k in a}
    return {"ratios": _ratios(data), "arms": arms, "tokens_per_step": _tokens_per_step(data), "report": "throughput.md"}


def _tokens_per_step(data: Dict[str, Any]) -> Optional[int]:
    from throughput import CONFIGS  # bench/ is this script's directory

    shape = CONFIGS["gpu-400m"]
    return shape["micro_batch"] * shape["seq"] if data.get("sections") else None


def _ratios(data: Dict[str, Any]) -> Dict[str, Any]:
    """Median-step ratios of the default LEV arm over tied and untied, per section of a throughput run."""
    out = {}
    for sec in data.get("sections", []):
        res = sec["result"]
        arms, lev = res["arms"], res.get("lev_default")
        if lev is None or "tied" not in arms:
            continue
        ms = {name: arm["ms_per_iter"] for name, arm in arms.items()}  # medians
        out[sec["title"]] = {"lev_arm": lev, "lev_over_tied": ms[lev] / ms["tied"],
                             "lev_over_untied": ms[lev] / ms["untied"] if "untied" in ms else None}
    return out


def check_kernel(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    from lev_layer import ANCHOR_MS_PER_1K

    path = Path(ctx.work) / "lev_kernel.json"
    path.unlink(missing_ok=True)
    rc, output = run_logged([sys.executable, "bench/lev_layer.py", "--device", "cuda", "--dtype", "bfloat16",
                             "--kernel-only", "--repeats", "5", "--json", path], timeout,
                            Path(ctx.work) / "logs" / "kernel.log", ctx.env())
    if rc == 124:
        raise CheckTimeout(timeout, log_tail=_tail(output))
    if rc != 0 or not path.exists():
        raise CheckFailed(f"bench/lev_layer.py --kernel-only exit {rc}: {_tail(output, 600)}")
    kernel = json.loads(path.read_text())["kernel"]
    if not kernel.get("rows"):
        raise CheckFailed(f"no kernel figures: {kernel.get('note')}")
    fa, ba = ANCHOR_MS_PER_1K
    for row in kernel["rows"]:
        row["time_over_anchor"] = (row["triton_fwd_ms_per_1k"] + row["triton_bwd_ms_per_1k"]) / (fa + ba)
    return {"rows": kernel["rows"], "gpu": kernel.get("gpu"),
            "anchor": {"fwd_ms_per_1k": fa, "bwd_ms_per_1k": ba,
                       "what": "Kitsunp's published fused LEV kernel: about 1.1 ms forward and 3.0 ms backward for "
                               "4,096 ids at D=2048 on an RTX 5070 Ti (bench/lev_layer.py ANCHOR_MS_PER_1K)"}}


def check_pytest_gpu(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    env = ctx.env()
    if not _importable("pytest", env):
        raise Skip("pytest is not installed here; the checks above run the same code without it")
    marker = "gpu" if ctx.have_te else "gpu and not te"
    rc, output = run_logged([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", "tests"],
                            timeout, Path(ctx.work) / "logs" / "pytest_gpu.log", env)
    summary = (output.strip().splitlines() or [""])[-1]
    if rc == 124:
        raise CheckTimeout(timeout, {"marker": marker}, _tail(output))
    if rc not in (0, 5):  # 5: nothing collected
        raise CheckFailed(f"pytest -m '{marker}': {summary}", {"marker": marker, "summary": summary})
    return {"marker": marker, "summary": summary}


def check_next_mcore(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    wheels = sorted(glob.glob(os.path.join(ctx.wheels or "", "next", "megatron_core-*.whl")))
    if not wheels:
        raise Skip("no newer megatron-core wheel in --wheels/next")
    if sys.version_info < (3, 12):
        raise Skip(f"newer megatron-core needs Python >= 3.12 (this is {platform.python_version()})")
    t0 = time.monotonic()
    work = Path(ctx.work)
    target = work / "next_mcore_site"
    rc, output = run_logged([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                             target, wheels[-1]], timeout, work / "logs" / "next_mcore_install.log")
    if rc != 0:
        raise CheckFailed(f"pip install {Path(wheels[-1]).name}: {_tail(output, 300)}")
    env = dict(ctx.env(), PYTHONPATH=os.pathsep.join([str(target), ctx.env()["PYTHONPATH"]]))
    rc, output = run_logged([sys.executable, *_pretrain_argv("lev", 2)], timeout - (time.monotonic() - t0),
                            work / "logs" / "next_mcore.log", env)
    figures = {"wheel": Path(wheels[-1]).name, "exit": rc}
    if rc == 124:
        raise CheckTimeout(timeout, figures, _tail(output))
    if rc != 0:
        raise CheckFailed(f"{Path(wheels[-1]).name}: a 2-step LEV run fails: {_tail(output, 600)}", figures)
    return figures


def science_estimate(ctx: Ctx) -> Tuple[float, str]:
    """Seconds of the science run from this run's measured throughput (``gpu_science.estimate_seconds``)."""
    import gpu_science  # bench/ is this script's directory

    return gpu_science.estimate_seconds(ctx.figures("train_tied"), ctx.figures("train_lev"),
                                        ctx.figures("throughput"), ctx.science_tflops, corpus=ctx.corpus)


def child_science(ctx: Ctx, partial) -> Dict[str, Any]:
    import gpu_science

    # Its steps are bounded by the child's own timeout, less a moment to write the result.
    deadline = time.monotonic() + max(1.0, (ctx.timeout_s or 600.0) - 5.0)
    return gpu_science.run(corpus=ctx.corpus, shared_data=ctx.shared_data, work=Path(ctx.work) / "science",
                           out=Path(ctx.out), deadline=deadline, env=ctx.env(), partial=partial)


CHILD_FUNCS: Dict[str, Callable] = {"env": child_env, "lev_layer": child_lev_layer, "science": child_science}

CHECKS: Tuple[Check, ...] = (
    Check("install", check_install, timeout_s=120, estimate_s=15, cuda=False),
    Check("env", in_child("env"), timeout_s=60, estimate_s=15, cuda=False),
    Check("lev_layer", in_child("lev_layer"), timeout_s=150, estimate_s=40),
    Check("train_tied", train_check("tied"), timeout_s=150, estimate_s=30),
    Check("train_lev", train_check("lev"), timeout_s=150, estimate_s=35),
    Check("train_lev_table", train_check("lev", TABLE_FLAGS), timeout_s=150, estimate_s=35),
    Check("throughput", check_throughput, timeout_s=240, estimate_s=130),
    Check("kernel", check_kernel, timeout_s=150, estimate_s=45),
    Check("pytest_gpu", check_pytest_gpu, timeout_s=150, estimate_s=60),
    Check("next_mcore", check_next_mcore, timeout_s=120, estimate_s=40),
    Check("science", in_child("science"), timeout_s=3600, estimate_s=science_estimate),
)
NAMES = tuple(c.name for c in CHECKS)


# ------------------------------------------------------------------------------------------ runner


def _estimate(check: Check, ctx: Ctx) -> Tuple[float, str]:
    if callable(check.estimate_s):
        return check.estimate_s(ctx)
    return float(check.estimate_s), "fixed estimate"


def run_checks(checks: Sequence[Check], ctx: Ctx, budget_s: float, *, clock=time.monotonic,
               on_result: Callable[[List[Dict[str, Any]]], None] = lambda results: None, log=print):
    """Run ``checks`` in order within ``budget_s`` seconds of ``clock``; ``on_result(results)`` after each."""
    start = clock()
    results: List[Dict[str, Any]] = []
    ctx.results = {}
    for check in checks:
        t0 = clock()
        left = budget_s - RESERVE_S - (t0 - start)
        entry: Dict[str, Any] = {"name": check.name, "status": "ok", "reason": "", "figures": {}}
        try:
            if check.cuda and not ctx.cuda:
                raise Skip("no CUDA device")
            need, basis = _estimate(check, ctx)
            entry["estimate_s"], entry["estimate_basis"] = round(need), basis
            if need > left:
                raise Skip(f"budget: needs ~{need:.0f} s, {max(0.0, left):.0f} s left")
            timeout = min(check.timeout_s, left)
            entry["timeout_s"] = round(timeout)
            entry["figures"] = check.run(ctx, timeout) or {}
        except Skip as e:
            entry.update(status="skipped", reason=str(e))
        except CheckTimeout as e:
            entry.update(status="failed", reason=str(e), figures=e.figures, log_tail=e.log_tail)
        except CheckFailed as e:
            entry.update(status="failed", reason=str(e), figures=e.figures)
        except Exception as e:  # reported in the file, never hidden
            entry.update(status="failed", reason=f"{type(e).__name__}: {e}")
        entry["seconds"] = round(clock() - t0, 1)
        if check.name == "env" and entry["status"] == "ok":
            ctx.have_te = not str(entry["figures"].get("transformer_engine", "not")).startswith("not")
        log(f"gpu_check: {check.name:<16} {entry['status']:<8} {entry['seconds']:7.1f} s  {entry['reason'][:300]}")
        results.append(entry)
        ctx.results[check.name] = entry
        on_result(results)
    return results


def not_run_notes(ctx: Ctx) -> List[str]:
    notes = ["Multi-rank collectives: one GPU runs TP=1 over NCCL at most (NCCL refuses two ranks on one device); "
             "tensor/pipeline-parallel LEV and its gradient reductions are tested on CPU (gloo) only."]
    if not ctx.have_te:
        notes.append("FP8 / Transformer Engine: not installed here (its wheel is over the carry limit); the TE spec "
                     "and FP8 recipes are tested on CPU for configuration and refusal only.")
    return notes


def write_report(out: Path, report: Dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "gpu_check.json", report)
    env = next((c["figures"] for c in report["checks"] if c["name"] == "env" and c["status"] == "ok"), {})
    L = ["# GPU check", "", f"`{report['command']}`, started {report['created']}; state **{report['state']}**, "
         f"{report['elapsed_s']} s of a {report['budget_s']} s budget.", "",
         f"Device: {env.get('device') or 'none (no CUDA device: every GPU check skipped)'}"
         + (f" (sm {env.get('capability')}, {env.get('memory_gib')} GiB; bf16 matmul {env.get('bf16_matmul_tflops')} "
            f"TFLOP/s, copy {env.get('copy_tb_per_s')} TB/s measured)" if env.get("device") else "")
         + "; " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "megatron.core", "triton") if k in env), "",
         "| check | status | seconds | reason |", "|---|---|---|---|"]
    for c in report["checks"]:
        L.append(f"| {c['name']} | {c['status']} | {c['seconds']} | {(c['reason'] or '').replace('|', '/')[:400]} |")
    for name in report.get("pending", []):
        L.append(f"| {name} | pending | | |")
    if report.get("not_run"):
        L += ["", "## Not proved by this check", ""] + [f"- {x}" for x in report["not_run"]]
    for c in report["checks"]:
        if c.get("figures"):
            L += ["", f"## {c['name']}", ""] + _figures_md(c["name"], c["figures"])
    _write_text(out / "gpu_check.md", "\n".join(L) + "\n")


def _figures_md(name: str, f: Dict[str, Any]) -> List[str]:
    try:
        return _tables_md(name, f)
    except (KeyError, TypeError, ValueError):  # figures of an unexpected shape (a partial run): as JSON
        return ["```json", json.dumps(f, indent=1, default=str)[:6000], "```"]


def _tables_md(name: str, f: Dict[str, Any]) -> List[str]:
    if name == "lev_layer":
        rows = ["| mode/dtype/basis | max rel. error | tolerance | ran | basis as asked |", "|---|---|---|---|---|"]
        for k, v in f.items():
            rows.append(f"| {k} | {v['max_rel_error']:.2e} | {LAYER_TOLERANCE[v['dtype']]:.0e} | "
                        f"{', '.join(f'{a} x{n}' for a, n in v['ran'].items())} | {v['basis_ok']} |")
        return rows
    if name == "kernel" and f.get("rows"):
        rows = [f"Against {f['anchor']['what']}.", "", "| D | ids | triton fwd / bwd ms per 1k | eager fwd / bwd | "
                "speed-up vs eager | time / anchor |", "|---|---|---|---|---|---|"]
        for r in f["rows"]:
            rows.append(f"| {r['hidden']} | {r['ids']} | {r['triton_fwd_ms_per_1k']:.3f} / {r['triton_bwd_ms_per_1k']:.3f} "
                        f"| {r['sparse_fwd_ms_per_1k']:.3f} / {r['sparse_bwd_ms_per_1k']:.3f} | "
                        f"{r['speedup_vs_eager']:.1f}x | {r['time_over_anchor']:.2f}x |")
        return rows
    return ["```json", json.dumps(f, indent=1, default=str)[:6000], "```"]


# ------------------------------------------------------------------------------------------ preparing


def prepare_wheels(dest: str) -> int:
    """Download (here, with PyPI) the Python 3.12 wheels the GPU image lacks into ``dest``."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "-d"]
    # The newest megatron-core 0.19.x (Python >= 3.12 only; the release make test-next tests, the Makefile's
    # MCORE_NEXT) goes to DIR/next for the next_mcore check.
    for spec, where in [(w, dest) for w in WHEELS] + [(NEXT_MCORE, os.path.join(dest, "next"))]:
        r = subprocess.run(base + [where, spec], capture_output=True, text=True)
        print(f"{spec}: {'ok' if r.returncode == 0 else 'FAILED ' + _tail(r.stderr, 300)}")
        if r.returncode != 0:
            return 1
    return 0


# Files of the shared data folder the checks read (the science run's corpus and evaluation sets, the
# GPT-2 tokenizer, the throughput check's ids); downstream sets are cut to their first lines.
DATA_FILES = ("corpus/train.jsonl.zst", "corpus/valid.jsonl.zst", "corpus/zeroshot_wiki.jsonl.zst",
              "tokenizers/gpt2/vocab.json", "tokenizers/gpt2/merges.txt")


def prepare_data(dest: str, shared: str, task_lines: int) -> int:
    """Copy what the checks read from ``shared`` into ``dest`` (same layout), to carry to the GPU machine."""
    import gpu_science

    src, dst = Path(shared), Path(dest)
    missing = [f for f in DATA_FILES if not (src / f).exists()]
    if missing:
        print(f"--prepare-data: {src} lacks {missing}; point --shared-data at the shared data folder")
        return 1
    for f in DATA_FILES:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / f, dst / f)
    for f in sorted((src / "downstream").glob("*.jsonl")):
        (dst / "downstream").mkdir(parents=True, exist_ok=True)
        with open(f, "rb") as r, open(dst / "downstream" / f.name, "wb") as w:
            for i, line in enumerate(r):
                if i >= task_lines:
                    break
                w.write(line)
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"--prepare-data: {dst} holds {size / 2**20:.1f} MiB (downstream sets cut to {task_lines} lines; the "
          f"science run evaluates --limit {gpu_science.TASK_LIMIT})")
    return 0


# ------------------------------------------------------------------------------------------ main


def _csv(value: Optional[str]) -> List[str]:
    return [x for x in (value or "").split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run the GPU-only checks of megatron-lev within a budget and write a "
                                            "report after every check.")
    p.add_argument("--out", default=None, help="folder for gpu_check.json / gpu_check.md (required to run)")
    p.add_argument("--work", default=None, help="logs and scratch files (default OUT/../gpu_check_work)")
    p.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget of the whole run (default 400)")
    p.add_argument("--wheels", default=str(REPO / "wheels"), help="wheels to install with --no-deps (default wheels/)")
    p.add_argument("--shared-data", default=str(SHARED), help=f"shared data folder (default {SHARED})")
    p.add_argument("--corpus", default=None, help="training corpus of the science run "
                                                  "(default SHARED_DATA/corpus/train.jsonl.zst)")
    p.add_argument("--science-tflops", type=float, default=None,
                   help="achieved TFLOP/s to plan the science run with when no training check ran in this run")
    p.add_argument("--steps", type=int, default=10, help="training steps of each train_* check (default 10)")
    p.add_argument("--only", default=None, help=f"comma list of checks to run ({','.join(NAMES)})")
    p.add_argument("--skip", default="", help="comma list of checks to leave out")
    p.add_argument("--prepare-wheels", default=None, metavar="DIR",
                   help="download the wheels the GPU machine lacks into DIR, then exit")
    p.add_argument("--prepare-data", default=None, metavar="DIR",
                   help="copy the shared data the checks read into DIR (to carry), then exit")
    p.add_argument("--task-lines", type=int, default=2000, help="lines kept of each downstream set by --prepare-data")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-ctx", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child or a.prepare_wheels or a.prepare_data:
        return a
    if a.out is None:
        p.error("--out DIR is required (or --prepare-wheels DIR / --prepare-data DIR)")
    chosen, skip = (_csv(a.only) or list(NAMES)), _csv(a.skip)
    unknown = [c for c in chosen + skip if c not in NAMES]
    if unknown:
        p.error(f"unknown check(s) {unknown}; choose from {','.join(NAMES)}")
    if a.steps < 3:
        p.error(f"--steps must be >= 3 (the first two iterations warm up; got {a.steps})")
    if not a.budget_s > 0:
        p.error(f"--budget-s must be a positive number of seconds (got {a.budget_s})")
    a.checks = [c for c in NAMES if c in chosen and c not in skip]
    a.corpus = a.corpus or str(Path(a.shared_data) / "corpus" / "train.jsonl.zst")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a.child, a.child_ctx, a.child_result)
    if a.prepare_wheels:
        return prepare_wheels(a.prepare_wheels)
    if a.prepare_data:
        return prepare_data(a.prepare_data, a.shared_data, a.task_lines)
    import torch

    out = Path(a.out)
    work = Path(a.work or out.resolve().parent / "gpu_check_work")
    out.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out=str(out), work=str(work), wheels=a.wheels, shared_data=a.shared_data, corpus=a.corpus,
              steps=a.steps, cuda=torch.cuda.is_available(), science_tflops=a.science_tflops)
    t0 = time.monotonic()
    report: Dict[str, Any] = {
        "state": "running", "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "budget_s": a.budget_s, "elapsed_s": 0.0, "checks": [], "pending": list(a.checks), "not_run": []}

    def on_result(results):
        report.update(checks=results, pending=a.checks[len(results):], elapsed_s=round(time.monotonic() - t0, 1),
                      not_run=not_run_notes(ctx))
        write_report(out, report)

    write_report(out, report)
    checks = run_checks([c for c in CHECKS if c.name in a.checks], ctx, a.budget_s, on_result=on_result)
    report.update(state="done")
    on_result(checks)
    print(f"gpu_check: report in {out / 'gpu_check.md'} ({report['elapsed_s']} s)")
    return 1 if any(c["status"] == "failed" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
