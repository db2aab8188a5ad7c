#!/usr/bin/env python
"""The one-GPU check: everything this project can only prove on a CUDA device, in one command.

    python bench/gpu_check.py --out OUT [--wheels wheels/] [--steps 20] [--only a,b] [--skip a,b]
    python bench/gpu_check.py --prepare-wheels wheels/     # here (CPU, with PyPI): fetch what the GPU box lacks

Checks, in order (each timed, each with a status ok / failed / skipped and a one-line reason):

  install     ``pip install --no-deps`` of the wheels in ``--wheels`` that are not importable yet
              (megatron-core and the few small pure dependencies a bare GPU image lacks).
  env         torch, CUDA device, megatron-core, Transformer Engine, Triton: what is importable.
  pytest_gpu  ``pytest -m gpu`` (FP8/Transformer Engine tests only where TE imports: they are marked ``te``).
  lev_layer   the LEV layer on CUDA in fp32 and bf16 (parameters created there) against the fp64 CPU layer
              holding the same weights: forward and every gradient, unique and table modes.
  kernel      ``bench/lev_layer.py --device cuda --kernel-only``: the Triton kernel's forward and backward
              time per 1,000 ids (paper defaults, D x N grid) beside the eager path and VocabParallelEmbedding.
  arms        every input arm trained ``--steps`` steps through ``pretrain_lev.py`` in bf16 over NCCL at
              TP=1 (mock data), and LEV once more with the shipped Pile configs' flags (table mode,
              distributed optimizer, overlapped grad reduce); final loss and ms/iteration per arm.
  throughput  ``bench/throughput.py --config gpu-400m``: LEV/TIED and LEV/UNTIED step-time ratios.
  next_mcore  optional: the newest megatron-core wheel found in ``--wheels/next`` (Python 3.12 only),
              installed into a scratch directory, and a 2-step LEV run on it; what breaks is recorded.

Output: ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` (format below) plus each check's log tail.
The JSON holds ``{"created", "command", "machine", "versions", "checks": [{"name", "status",
"seconds", "reason", "figures", "log_tail"}], "not_run": [...]}``; the markdown is a table of the
checks, then the figures of each. Exit status 0 when no check failed (skipped checks say why).
The budget is about 8 minutes on one H100/H200-class GPU; ``--only``/``--skip`` pick checks.
On a machine without CUDA every GPU check is skipped with that reason, so the script can be
exercised (and its report read) anywhere.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHECKS = ("install", "env", "pytest_gpu", "lev_layer", "kernel", "arms", "throughput", "next_mcore")
ARMS = ("tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev")
# What a bare GPU image (torch, triton, transformers, tokenizers, sentencepiece, safetensors) lacks.
WHEELS = ("megatron-core==0.16.1", "tiktoken", "zstandard", "psutil")
TIMEOUTS = {"pytest_gpu": 150, "kernel": 120, "arms": 240, "throughput": 240, "next_mcore": 120}
LAYER_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # max |error| / max |reference|
RESULT_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+).*?lm loss: ([\d.E+-]+)")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:] if text else ""


def _run(cmd: List[str], timeout: int, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    full_env.update(env or {})
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO), env=full_env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout} s")


class Skip(Exception):
    """A check that cannot run here; the message says why."""


# ------------------------------------------------------------------------------------------ checks


def check_env(ctx) -> Dict[str, Any]:
    import torch

    figures = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    figures["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    for mod in ("megatron.core", "transformer_engine", "triton", "apex"):
        figures[mod] = importlib.util.find_spec(mod.split(".")[0]) is not None and _importable(mod)
    ctx["have_te"] = bool(figures["transformer_engine"])
    if not figures["transformer_engine"]:
        ctx["not_run"].append("FP8 / Transformer Engine: not installed here (its wheel cannot be carried); "
                              "the TE spec and FP8 recipes are tested on CPU for configuration and refusal only")
    return figures


def _importable(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except Exception:
        return False


def check_install(ctx) -> Dict[str, Any]:
    wheel_dir = ctx["wheels"]
    if not wheel_dir or not Path(wheel_dir).is_dir():
        raise Skip(f"no wheel directory ({wheel_dir}); nothing to install")
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    missing = []
    for w in wheels:
        dist = Path(w).name.split("-")[0].replace("_", "-")
        module = {"megatron-core": "megatron.core"}.get(dist, dist.replace("-", "_"))
        if not _importable(module):
            missing.append(w)
    if not missing:
        return {"installed": [], "note": "everything already importable"}
    r = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", *missing], 180)
    if r.returncode != 0:
        raise RuntimeError(f"pip install failed: {_tail(r.stderr, 400)}")
    return {"installed": [Path(w).name for w in missing]}


def check_pytest_gpu(ctx) -> Dict[str, Any]:
    if not _cuda():
        raise Skip("no CUDA device")
    marker = "gpu" if ctx.get("have_te") else "gpu and not te"
    r = _run([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider"], TIMEOUTS["pytest_gpu"])
    summary = (r.stdout.strip().splitlines() or [""])[-1]
    figures = {"marker": marker, "summary": summary, "log_tail": _tail(r.stdout)}
    if r.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m '{marker}': {summary}")
    return figures


def compare_lev_layer(device: str = "cuda", vocab: int = 4099, hidden: int = 256, batch=(4, 512),
                      lev_kw: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The LEV layer built on ``device`` (fp32 and bf16 parameters; the paper's defaults unless ``lev_kw``)
    against the fp64 CPU layer holding the same weights: max |error| / max |reference| of the forward and
    of every gradient, in unique and table modes."""
    import torch

    from megatron_lev.lev import LEVConfig, LEVEmbedding

    V, D, kw = vocab, hidden, dict(lev_kw or {}, chunk_size=1024)
    ids = torch.randint(0, V, batch, generator=torch.Generator().manual_seed(0))
    up = torch.randn(*batch, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out: Dict[str, Any] = {}
    for mode in ("unique", "table"):
        cfg = LEVConfig(compute_mode=mode, **kw)
        for dtype in (torch.float32, torch.bfloat16):
            layer = LEVEmbedding(V, D, cfg, init_seed=1, device=device, dtype=dtype)
            ref = LEVEmbedding(V, D, LEVConfig(**dict(kw, compute_mode="unique")), initialize=False,
                               dtype=torch.float64)
            with torch.no_grad():
                for p, q in zip(ref.parameters(), layer.parameters()):
                    p.copy_(q.detach().to("cpu", torch.float64))
            y = layer(ids.to(device))
            (y.float() * up.to(device, torch.float32)).sum().backward()
            if mode == "table":
                layer.finish_table_step()
            y_ref = ref(ids)
            (y_ref * up).sum().backward()
            name = f"{mode}/{str(dtype).split('.')[-1]}"
            errs = {"forward": _rel(y, y_ref)}
            for (pname, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
                errs[pname] = _rel(p.grad, q.grad)
            out[name] = {"dtype": str(dtype).split(".")[-1], "max_rel_error": max(errs.values()), "errors": errs,
                         "params_device": str(layer.offset.device), "params_dtype": str(layer.offset.dtype)}
    return out


def _rel(a, b) -> float:
    a = a.detach().to("cpu", b.dtype)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_lev_layer(ctx) -> Dict[str, Any]:
    if not _cuda():
        raise Skip("no CUDA device")
    figures = compare_lev_layer("cuda")
    bad = [k for k, v in figures.items() if v["max_rel_error"] > LAYER_TOLERANCE[v["dtype"]]]
    if bad:
        raise RuntimeError(f"LEV layer on CUDA disagrees with the fp64 CPU layer: {bad}", figures)
    return figures


def check_kernel(ctx) -> Dict[str, Any]:
    if not _cuda():
        raise Skip("no CUDA device")
    path = Path(ctx["out"]) / "lev_kernel.json"
    r = _run([sys.executable, "bench/lev_layer.py", "--device", "cuda", "--dtype", "bfloat16", "--kernel-only",
              "--json", str(path)], TIMEOUTS["kernel"])
    if r.returncode != 0:
        raise RuntimeError(f"bench/lev_layer.py --kernel-only exit {r.returncode}: {_tail(r.stderr, 400)}")
    return {"table": json.loads(path.read_text()), "stdout_tail": _tail(r.stdout, 2500)}


def _pretrain_argv(arm: str, steps: int, extra=()) -> List[str]:
    return ["pretrain_lev.py", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "8",
            "--global-batch-size", "8", "--train-iters", str(steps), "--lr", "3e-4", "--lr-warmup-iters", "2",
            "--mock-data", "--vocab-size", "50257", "--bf16", "--log-interval", "1", "--eval-iters", "0",
            "--quiet-config", "--input-embedding", arm, *extra]


def check_arms(ctx) -> Dict[str, Any]:
    if not _cuda():
        raise Skip("no CUDA device")
    runs = [(arm, ()) for arm in ARMS] + [("lev", ("--lev-compute-mode", "table", "--use-distributed-optimizer",
                                                    "--overlap-grad-reduce"))]
    figures: Dict[str, Any] = {}
    failed = []
    for arm, extra in runs:
        name = arm + ("+table/distopt/overlap" if extra else "")
        t0 = time.time()
        r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29531",
                  *_pretrain_argv(arm, ctx["steps"], extra)], TIMEOUTS["arms"] // 2)
        rows = RESULT_RE.findall(r.stdout)
        entry = {"exit": r.returncode, "seconds": round(time.time() - t0, 1), "iterations": len(rows)}
        if rows:
            ms = sorted(float(x[1]) for x in rows[1:]) or [float(rows[0][1])]
            entry.update(first_loss=float(rows[0][2]), last_loss=float(rows[-1][2]), median_ms=ms[len(ms) // 2])
        if r.returncode != 0 or len(rows) != ctx["steps"]:
            entry["error"] = _tail(r.stderr or r.stdout, 600)
            failed.append(name)
        figures[name] = entry
    if failed:
        raise RuntimeError(f"arms failed: {failed}", figures)
    return figures


def check_throughput(ctx) -> Dict[str, Any]:
    if not _cuda():
        raise Skip("no CUDA device")
    out = Path(ctx["out"])
    r = _run([sys.executable, "bench/throughput.py", "--config", "gpu-400m", "--skip-preprocess",
              "--output", str(out / "throughput.md"), "--json", str(out / "throughput.json")], TIMEOUTS["throughput"])
    if r.returncode != 0:
        raise RuntimeError(f"bench/throughput.py exit {r.returncode}: {_tail(r.stderr, 400)}")
    data = json.loads((out / "throughput.json").read_text())
    return {"ratios": _ratios(data), "report": "throughput.md"}


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


def check_next_mcore(ctx) -> Dict[str, Any]:
    wheels = sorted(glob.glob(os.path.join(ctx["wheels"] or "", "next", "megatron_core-*.whl")))
    if not wheels:
        raise Skip("no newer megatron-core wheel in --wheels/next")
    if sys.version_info < (3, 12):
        raise Skip(f"newer megatron-core needs Python >= 3.12 (this is {sys.version.split()[0]})")
    target = Path(ctx["out"]) / "next_mcore_site"
    r = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), wheels[-1]],
             60)
    if r.returncode != 0:
        raise RuntimeError(f"pip install {Path(wheels[-1]).name}: {_tail(r.stderr, 300)}")
    env = {"PYTHONPATH": os.pathsep.join([str(target), str(REPO)])}
    argv = _pretrain_argv("lev", 2)
    r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29533",
              *argv], TIMEOUTS["next_mcore"], env)
    figures = {"wheel": Path(wheels[-1]).name, "exit": r.returncode, "log_tail": _tail(r.stderr or r.stdout, 1500)}
    if r.returncode != 0:
        raise RuntimeError(f"{Path(wheels[-1]).name}: a 2-step LEV run fails (see log_tail)", figures)
    return figures


FUNCS: Dict[str, Callable] = {
    "env": check_env, "install": check_install, "pytest_gpu": check_pytest_gpu, "lev_layer": check_lev_layer,
    "kernel": check_kernel, "arms": check_arms, "throughput": check_throughput, "next_mcore": check_next_mcore,
}


# ------------------------------------------------------------------------------------------ report


def run_checks(names: List[str], ctx: Dict[str, Any], log=print) -> List[Dict[str, Any]]:
    results = []
    for name in names:
        t0 = time.time()
        entry: Dict[str, Any] = {"name": name, "status": "ok", "reason": "", "figures": {}}
        try:
            entry["figures"] = FUNCS[name](ctx) or {}
        except Skip as e:
            entry.update(status="skipped", reason=str(e))
        except Exception as e:  # reported in the file, never hidden
            entry.update(status="failed", reason=f"{type(e).__name__}: {e.args[0] if e.args else e}")
            if len(e.args) > 1 and isinstance(e.args[1], dict):
                entry["figures"] = e.args[1]
        entry["seconds"] = round(time.time() - t0, 1)
        log(f"gpu_check: {name:<11} {entry['status']:<8} {entry['seconds']:7.1f} s  {entry['reason']}")
        results.append(entry)
    return results


def write_report(out: Path, report: Dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    L = ["# GPU check", "", f"Created {report['created']} with `{report['command']}`.", "",
         f"Device: {report['machine'].get('gpu') or 'none (no CUDA device: every GPU check skipped)'}; "
         f"versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
         "| check | status | seconds | reason |", "|---|---|---|---|"]
    for c in report["checks"]:
        L.append(f"| {c['name']} | {c['status']} | {c['seconds']} | {c['reason'] or ''} |")
    if report.get("not_run"):
        L += ["", "## Not run here", ""] + [f"- {x}" for x in report["not_run"]]
    for c in report["checks"]:
        figs = {k: v for k, v in c.get("figures", {}).items() if k != "log_tail"}
        if figs:
            L += ["", f"## {c['name']}", "", "```json", json.dumps(figs, indent=1, default=str)[:6000], "```"]
    (out / "gpu_check.md").write_text("\n".join(L) + "\n")


def prepare_wheels(dest: str) -> int:
    """Download (here, with PyPI) the Python 3.12 wheels the GPU image lacks into ``dest``."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "-d", dest]
    # The newest megatron-core (Python >= 3.12 only) goes to DIR/next for the next_mcore check.
    for spec, where in [(w, dest) for w in WHEELS] + [("megatron-core", os.path.join(dest, "next"))]:
        r = subprocess.run(base[:-1] + [where, spec], capture_output=True, text=True)
        print(f"{spec}: {'ok' if r.returncode == 0 else 'FAILED ' + _tail(r.stderr, 200)}")
        if r.returncode != 0:
            return 1
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run every GPU-only check of megatron-lev and write a report.")
    p.add_argument("--out", default=None, help="output folder for gpu_check.json / gpu_check.md (required to run)")
    p.add_argument("--wheels", default=str(REPO / "wheels"), help="wheels to install with --no-deps (default wheels/)")
    p.add_argument("--steps", type=int, default=20, help="training steps per arm (default 20)")
    p.add_argument("--only", default=None, help=f"comma list of checks to run ({','.join(CHECKS)})")
    p.add_argument("--skip", default="", help="comma list of checks to leave out")
    p.add_argument("--prepare-wheels", default=None, metavar="DIR",
                   help="download the wheels the GPU machine lacks into DIR, then exit")
    a = p.parse_args(argv)
    if a.prepare_wheels is None and a.out is None:
        p.error("--out DIR is required (or --prepare-wheels DIR)")
    chosen = a.only.split(",") if a.only else list(CHECKS)
    skip = [s for s in a.skip.split(",") if s]
    unknown = [c for c in chosen + skip if c not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {unknown}; choose from {','.join(CHECKS)}")
    if a.steps < 2:
        p.error(f"--steps must be >= 2 (got {a.steps})")
    a.checks = [c for c in CHECKS if c in chosen and c not in skip]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.prepare_wheels is not None:
        return prepare_wheels(a.prepare_wheels)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx: Dict[str, Any] = {"out": str(out), "wheels": a.wheels, "steps": a.steps, "not_run": []}
    t0 = time.time()
    checks = run_checks(a.checks, ctx)
    from throughput import _machine, _versions  # bench/ is this script's directory

    report = {"created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": _machine(), "versions": _versions(), "seconds": round(time.time() - t0, 1),
              "checks": checks, "not_run": ctx["not_run"]}
    write_report(out, report)
    print(f"gpu_check: report in {out / 'gpu_check.md'} ({report['seconds']} s)")
    return 1 if any(c["status"] == "failed" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
