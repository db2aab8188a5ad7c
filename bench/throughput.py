#!/usr/bin/env python
"""Training-step throughput of tied, untied and LEV (every compute mode and basis) on one transformer.

    python bench/throughput.py                       # CPU: the micro-reproduction model, writes docs/results/throughput.md
    python bench/throughput.py --quick               # smaller shape, fewer repeats (a smoke run)
    python bench/throughput.py --config gpu-400m     # on a GPU: a 400M-class model in bf16 (+ FP8 with Transformer Engine)
    python bench/throughput.py --modes unique --threads 1 --clock cpu   # a CPU shared with other jobs

One process builds every arm on the same transformer (Llama-style: RoPE, RMSNorm, SwiGLU, no biases)
and times full training steps: forward + backward of one micro-batch of real GPT-2 tokens (the
shared valid corpus) and an AdamW update. Arms are timed round-robin (arm 1, arm 2, ..., arm 1,
...) so that the load of other jobs on the machine drifts over all arms alike; the figure of an arm
is its median step. The LEV layer's share is its own forward+backward (the input-embedding module
with the same ids and an upstream gradient, timed in the same rounds) over the LEV step. Peak memory
is the step's peak above the resident model (CPU: peak RSS via ``clear_refs``, with large
allocations returned to the OS; CUDA: ``max_memory_allocated``).

Also runs ``bench/preprocess.py`` (tokens/s of tools/preprocess_data.py at 1 and 2 workers) unless
``--skip-preprocess``, and writes everything with the machine, versions, load averages and the command
to ``--output`` (default docs/results/throughput.md) and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

PAPER_JAX_LOSS = "23-51%"
CPU_TARGET = 1.05
# wall: elapsed time. cpu: the process's CPU time, what a step costs whatever the other jobs on a
# shared machine do (use with --threads 1: idle OpenMP threads spin and would be counted).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
GPU_TARGET = 1.01
GPT2_VOCAB = 50257  # the ids of the shared corpus; pretrain_lev.py pads the vocabulary to a multiple of 128
SLOW_FACTOR = 4.0  # an arm whose best step after 2 rounds exceeds this x tied's best gets no further rounds

CONFIGS: Dict[str, Dict[str, Any]] = {
    # The micro-reproduction's transformer (bench/reproduce.py --config cpu).
    "cpu": dict(layers=4, hidden=256, heads=4, seq=256, micro_batch=8),
    "quick": dict(layers=2, hidden=128, heads=4, seq=128, micro_batch=4),
    # A 400M-class Llama-style model (24 x 1024, 16 heads, seq 2048) for a GPU.
    "gpu-400m": dict(layers=24, hidden=1024, heads=16, seq=2048, micro_batch=4),
    # examples/pile/configs/400m.yaml on one GPU: its transformer (20 x 1280, FFN 3456), sequence, micro-batch
    # and o200k-class vocabulary (200,064 rows), one micro-batch a step.
    "pile-400m": dict(layers=20, hidden=1280, heads=20, ffn=3456, seq=512, micro_batch=8, vocab=200064),
}


def _load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("torch", "megatron.core", "numba", "numpy", "transformer_engine"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = str(getattr(m, "__version__", "?"))
        except Exception:
            out[mod] = "not installed"
    return out


def _machine() -> Dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu,
            "platform": platform.platform()}


def arm_list(device: str, modes=("token", "unique", "table")) -> List[Dict[str, Any]]:
    """The arms timed: tied, untied, and LEV for each compute mode x basis of this device."""
    from megatron_lev.kernels import register_default_kernels
    from megatron_lev.lev.config import LEVConfig

    register_default_kernels()  # as the LEV layer does when it is built

    default = LEVConfig()
    default_basis = default.resolved_basis(device)
    from megatron_lev.lev.functional import has_fused_product

    bases = ["dense", "fused"] if device == "cpu" else ["dense", "sparse"]
    if device == "cuda" and has_fused_product("cuda", "triton"):
        bases.append("triton")
    arms = [{"name": "tied", "arm": "tied"}, {"name": "untied", "arm": "untied"}]
    for mode in modes:
        for basis in bases:
            arms.append({"name": f"lev {mode}/{basis}", "arm": "lev", "mode": mode, "basis": basis,
                         "default": mode == default.compute_mode and basis == default_basis})
    return arms


def pretrain_flags(arm: Dict[str, Any], shape: Dict[str, Any], dtype_name: str, fp8: Optional[str] = None,
                   fp8_recipe: str = "delayed") -> List[str]:
    """The ``pretrain_lev.py`` flags of ``arm`` at ``shape``: the bench builds its model from them through
    pretrain_lev.py's own parsing and validation (``megatron_lev.training.model_configs``), so the MLP
    width, the vocabulary padding and every default are those of the model that trains."""
    from reproduce import TRANSFORMER  # the Llama-style transformer every bench run shares

    seq, mb = str(shape["seq"]), str(shape["micro_batch"])
    flags = ["--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
             "--num-attention-heads", str(shape["heads"]), "--seq-length", seq, "--max-position-embeddings", seq,
             "--micro-batch-size", mb, "--global-batch-size", mb, "--mock-data",
             # a shape's own vocabulary is its rows: the mock tokenizer's ids plus its EOD
             "--vocab-size", str(shape["vocab"] - 1 if "vocab" in shape else GPT2_VOCAB),
             "--train-iters", "1", "--lr", "1e-4", *TRANSFORMER, "--input-embedding", arm["arm"]]
    if "ffn" in shape:
        flags += ["--ffn-hidden-size", str(shape["ffn"])]
    if arm["arm"] == "lev":
        flags += ["--lev-compute-mode", arm.get("mode", "unique"), "--lev-basis", arm.get("basis", "auto")]
    if dtype_name == "bfloat16":
        flags.append("--bf16")
    if fp8:
        flags += ["--fp8-format", fp8, "--fp8-recipe", fp8_recipe]
    return flags


def bench_configs(arm: Dict[str, Any], shape: Dict[str, Any], dtype_name: str, fp8: Optional[str] = None,
                  fp8_recipe: str = "delayed"):
    """(TransformerConfig, LevModelConfig) of ``arm`` at ``shape``, as pretrain_lev.py builds them."""
    from megatron_lev.training import model_configs

    return model_configs(pretrain_flags(arm, shape, dtype_name, fp8, fp8_recipe))


def _build(arm: Dict[str, Any], shape: Dict[str, Any], device: str, dtype_name: str, fp8: Optional[str],
           fp8_recipe: str = "delayed"):
    import torch

    from megatron_lev.models import parameter_breakdown
    from megatron_lev.models.factory import build_model_chunks
    from megatron_lev.training.flops import flops_per_iteration

    gcfg, mcfg = bench_configs(arm, shape, dtype_name, fp8, fp8_recipe)
    torch.manual_seed(1234)
    (model,) = build_model_chunks(gcfg, mcfg)
    tokens = shape["micro_batch"] * shape["seq"]
    flops = flops_per_iteration(gcfg, mcfg, global_batch_size=shape["micro_batch"], seq_length=shape["seq"],
                                data_parallel_size=1)
    return model.to(device), gcfg, parameter_breakdown(mcfg, gcfg), flops / tokens


class _Runner:
    """One arm: model, optimizer, a timed training step and a timed input-layer forward+backward."""

    def __init__(self, arm, shape, ids, device, dtype_name, fp8=None, fp8_recipe="delayed"):
        import torch

        from megatron_lev.models import lev_modules

        self.arm, self.device = arm, device
        dtype = getattr(torch, dtype_name)
        self.model, self.config, self.breakdown, self.flops_per_token = _build(arm, shape, device, dtype_name, fp8,
                                                                                   fp8_recipe)
        self.model.train()
        self.table = [m for m in lev_modules(self.model) if m.lev_config.compute_mode == "table"]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.ids = ids
        self.labels = torch.roll(ids, -1, 1)
        self.pos = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand(ids.shape[0], -1)
        self.up = torch.randn(ids.shape[1], ids.shape[0], shape["hidden"], device=device, dtype=dtype)
        self.step_s: List[float] = []
        self.layer_s: List[float] = []
        self.losses: List[float] = []
        self.peak_mib = float("nan")
        self.stopped_early = False
        self.params = sum(p.numel() for p in self.model.parameters())

    def _sync(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for m in self.table:
            m.begin_table_step()
        loss = self.model(self.ids, self.pos, attention_mask=None, labels=self.labels).float().mean()
        loss.backward()
        for m in self.table:
            m.finish_table_step()
        self.opt.step()
        self.losses.append(float(loss.detach()))

    def layer(self) -> None:
        emb = self.model.embedding
        for m in self.table:
            m.begin_table_step()
        out = emb(input_ids=self.ids, position_ids=self.pos)
        out.backward(self.up)
        for m in self.table:
            m.finish_table_step()
        self.model.zero_grad(set_to_none=True)

    def timed(self, fn, into: List[float], clock=time.perf_counter) -> None:
        self._sync()
        t0 = clock()
        fn()
        self._sync()
        into.append(clock() - t0)


def measure(shape: Dict[str, Any], arms: List[Dict[str, Any]], *, device: str, dtype_name: str, repeats: int,
            warmup: int, shared: Path, fp8: Optional[str] = None, log=print, clock: str = "wall",
            fp8_recipe: str = "delayed") -> Dict[str, Any]:
    import torch
    from lev_layer import PeakMemory, _ids

    ids, source = _ids(GPT2_VOCAB, shape["micro_batch"], shape["seq"], shared)
    ids = ids.to(device)
    runners = []
    for a in arms:
        t0 = time.perf_counter()
        runners.append(_Runner(a, shape, ids, device, dtype_name, fp8, fp8_recipe))
        log(f"  built {a['name']} ({runners[-1].params:,} parameters, {time.perf_counter() - t0:.1f} s)")
    for r in runners:  # warm-up (numba compilation, allocator, first-touch) and peak memory
        for _ in range(warmup):
            r.step()
            r.layer()
        with PeakMemory(device) as mem:
            r.step()
        r.peak_mib = mem.mib
    load_start = _load()
    active = list(runners)
    for i in range(repeats):
        for r in active:
            r.timed(r.step, r.step_s, CLOCKS[clock])
            r.timed(r.layer, r.layer_s, CLOCKS[clock])
        log(f"  round {i + 1}/{repeats}: " + ", ".join(f"{r.arm['name']} {1e3 * r.step_s[-1]:.0f}" for r in active)
            + f" ms (load {os.getloadavg()[0]:.1f})")
        if i == 1:  # arms slower than SLOW_FACTOR x tied even at their best are not worth more rounds
            best_tied = min(runners[0].step_s)
            for r in list(active):
                if min(r.step_s) > SLOW_FACTOR * best_tied:
                    r.stopped_early = True
                    active.remove(r)
    load_end = _load()
    tokens = shape["micro_batch"] * shape["seq"]
    out: Dict[str, Any] = {"shape": shape, "device": device, "dtype": dtype_name, "fp8": fp8, "ids": source,
                           "unique_ids": int(torch.unique(ids).numel()), "tokens_per_step": tokens,
                           "ffn_hidden_size": runners[0].config.ffn_hidden_size,
                           "pretrain_flags": " ".join(pretrain_flags(arms[0], shape, dtype_name, fp8)),
                           "repeats": repeats, "clock": clock, "load_start": load_start, "load_end": load_end, "arms": {}}
    for r in runners:
        ms = 1e3 * statistics.median(r.step_s)
        lay = 1e3 * statistics.median(r.layer_s)
        out["arms"][r.arm["name"]] = {
            **{k: v for k, v in r.arm.items() if k != "name"}, "ms_per_iter": ms,
            "ms_min": 1e3 * min(r.step_s), "ms_max": 1e3 * max(r.step_s), "tokens_per_s": tokens / ms * 1e3,
            "tokens_per_s_best": tokens / min(r.step_s), "rounds": len(r.step_s), "stopped_early": r.stopped_early,
            "input_layer_ms": lay, "input_layer_share": lay / ms, "peak_step_mib": r.peak_mib,
            "parameters": r.params, "input_side_parameters": r.breakdown["input_side"],
            "flops_per_token": r.flops_per_token, "tflops": r.flops_per_token * tokens / ms * 1e-9,
            "steps_ms": [round(1e3 * s, 2) for s in r.step_s]}
    tied = out["arms"]["tied"]
    for a in out["arms"].values():
        a["vs_tied"] = a["ms_per_iter"] / tied["ms_per_iter"]
        a["vs_tied_best"] = a["ms_min"] / tied["ms_min"]
    lev = {n: a for n, a in out["arms"].items() if a["arm"] == "lev"}
    if lev:
        fastest = min(lev, key=lambda n: lev[n]["ms_per_iter"])
        default = next((n for n, a in lev.items() if a.get("default")), None)
        out["lev_fastest"], out["lev_default"] = fastest, default
    return out


def run_preprocess(log=print) -> Dict[str, Any]:
    cmd = [sys.executable, str(REPO / "bench" / "preprocess.py")]
    load0 = _load()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    log(r.stdout.rstrip())
    return {"command": "python bench/preprocess.py", "returncode": r.returncode, "output": r.stdout.strip(),
            "load_start": load0, "load_end": _load(), "seconds": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------------------------
# report


def _fmt_section(res: Dict[str, Any], target: float, title: str) -> List[str]:
    s = res["shape"]
    out = [f"## {title}", "",
           f"Transformer: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, MLP width "
           f"{res.get('ffn_hidden_size', '?')}, RoPE, RMSNorm, SwiGLU, no biases, built as pretrain_lev.py builds "
           f"it from `{res.get('pretrain_flags', '?')}`; GPT-2 vocabulary (50,257, padded to the model's vocabulary); micro-batch "
           f"{s['micro_batch']} x {s['seq']} = {res['tokens_per_step']:,} tokens ({res['unique_ids']:,} distinct ids; "
           f"{res['ids']}); {res['device']} {res['dtype']}" + (f", FP8 {res['fp8']}" if res.get("fp8") else "")
           + f"; one step = forward + backward + AdamW; median of {res['repeats']} round-robin steps"
           + (" timed in process CPU time (--clock cpu)." if res.get("clock") == "cpu" else "."),
           f"Load average (1, 5, 15 min) at the start of the timed rounds: {res['load_start']}, at the end: "
           f"{res['load_end']}.", "",
           "The **median** step of each arm is the primary figure and its ratios the headline (a best step "
           "flatters whichever arm got the quietest moment); the best step, the least disturbed by other jobs, "
           "is shown beside it.", "",
           "| arm | ms/iter median | best | max | rounds | tokens/s (median) | vs tied (median) | vs tied (best) "
           "| input layer fwd+bwd ms (median) | share of step | step peak MiB | parameters | input-side |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in res["arms"].items():
        mark = " (default)" if a.get("default") else ""
        rounds = f"{a.get('rounds', res['repeats'])}" + (" (stopped: slow)" if a.get("stopped_early") else "")
        out.append(f"| {name}{mark} | {a['ms_per_iter']:.1f} | {a['ms_min']:.1f} | {a['ms_max']:.0f} | {rounds} | "
                   f"{a['tokens_per_s']:,.0f} | {a['vs_tied']:.3f} | {a.get('vs_tied_best', a['vs_tied']):.3f} | "
                   f"{a['input_layer_ms']:.1f} | "
                   f"{100 * a['input_layer_share']:.1f}% | {a['peak_step_mib']:.0f} | {a['parameters']:,} | "
                   f"{a['input_side_parameters']:,} |")
    out += ["", "Share of step = the input layer's own forward+backward (table mode: including the per-step "
            "evaluation over all V ids and the gradient pass back through G) over the arm's step, medians; "
            "step peak MiB = the step's peak above the resident model and optimizer state.", ""]
    if "lev_default" in res:
        d, f = res["lev_default"], res["lev_fastest"]
        A = res["arms"]
        dv = A[d]["vs_tied"]
        du = A[d]["ms_per_iter"] / A["untied"]["ms_per_iter"]
        out.append(f"**Headline (median steps), LEV's default ({d}): LEV/TIED = {dv:.3f}, LEV/UNTIED = {du:.3f}** "
                   f"(the untied arm has the same dense output head as LEV; untied/tied = "
                   f"{A['untied']['vs_tied']:.3f}). LEV/TIED target <= {target}: "
                   f"{'met' if dv <= target else 'NOT met'} in this run. On best steps: LEV/TIED = "
                   f"{A[d]['ms_min'] / A['tied']['ms_min']:.3f}, LEV/UNTIED = {A[d]['ms_min'] / A['untied']['ms_min']:.3f}. "
                   f"The paper's JAX implementation lost {PAPER_JAX_LOSS} throughput.")
        if f == d:
            out.append(f"The default LEV configuration ({d}) is the fastest LEV configuration measured (median steps).")
        else:
            gap = A[d]["ms_per_iter"] / A[f]["ms_per_iter"] - 1
            out.append(f"The fastest LEV configuration measured is **{f}** ({A[f]['ms_per_iter']:.1f} ms/iter median), "
                       f"{100 * gap:.1f}% faster than the default {d}; on a loaded machine differences of a few "
                       f"percent are within the noise (compare best, median and max).")
        out.append("")
        # per-mode/basis gains (the optimisation's measured effect)
        lev = {n: a for n, a in res["arms"].items() if a["arm"] == "lev"}
        rows = []
        modes = sorted({a["mode"] for a in lev.values()}, key=["token", "unique", "table"].index)
        bases = sorted({a["basis"] for a in lev.values()})
        if len(bases) == 2:
            b0, b1 = bases
            for m in modes:
                n0, n1 = f"lev {m}/{b0}", f"lev {m}/{b1}"
                if n0 in lev and n1 in lev:
                    rows.append(f"| {m} | {lev[n0]['input_layer_ms']:.1f} | {lev[n1]['input_layer_ms']:.1f} | "
                                f"{lev[n0]['ms_min']:.1f} | {lev[n1]['ms_min']:.1f} | "
                                f"{100 * (1 - lev[n1]['ms_min'] / lev[n0]['ms_min']):+.1f}% |")
            out += [f"Measured gain of each optimisation (same run): basis {b1} vs {b0} per compute mode, and "
                    "compute mode against token (every position).", "",
                    f"| mode | layer ms {b0} (median) | layer ms {b1} (median) | step ms {b0} (best) | step ms {b1} (best) "
                    f"| step gain of {b1} |",
                    "|---|---|---|---|---|---|"] + rows + [""]
            tok = {b: lev.get(f"lev token/{b}") for b in bases}
            lines = []
            for m in modes:
                if m == "token":
                    continue
                for b in bases:
                    a, t = lev.get(f"lev {m}/{b}"), tok.get(b)
                    if a and t:
                        lines.append(f"{m}/{b} vs token/{b}: step (best) {100 * (1 - a['ms_min'] / t['ms_min']):+.1f}%, "
                                     f"layer {100 * (1 - a['input_layer_ms'] / t['input_layer_ms']):+.1f}%")
            if lines:
                out += ["- " + ln for ln in lines] + [""]
    return out


def write_report(path: Path, results: Dict[str, Any]) -> None:
    m = results["machine"]
    v = results["versions"]
    lines = ["# Throughput: tied, untied and LEV", "",
             "Generated by `bench/throughput.py`; do not edit by hand.", "",
             f"- command: `{results['command']}`",
             f"- date: {results['created']}",
             f"- machine: {m['cpu']}, {m['cpus']} CPUs, torch threads {m['threads']}; GPU: {m['gpu'] or 'none'}; "
             f"{m['platform']}",
             "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
             f"- load average (1, 5, 15 min) at start: {results['load_start']}; at end: {results['load_end']}"
             + (" — **a loaded machine**: other jobs shared the CPUs, so absolute times are inflated and noisy; "
                "the arms were timed round-robin so the ratios are the comparable figures."
                if max(results["load_start"][0], results["load_end"][0]) > (m["cpus"] or 1) else ""),
             ""]
    if results.get("quick"):
        lines += ["**Quick run** (`--quick`): a smaller shape and few repeats; a smoke figure, not the "
                  "benchmark.", ""]
    for sec in results["sections"]:
        lines += _fmt_section(sec["result"], sec["target"], sec["title"])
    if not results.get("gpu_ran"):
        lines += ["## GPU", "",
                  f"**The GPU section did not run**: {results.get('gpu_note', 'no CUDA device on this machine')}. "
                  f"On a GPU, `python bench/throughput.py --config gpu-400m` times the same arms for a 400M-class "
                  f"model in bf16 (and FP8 when Transformer Engine is installed); the target there is LEV/TIED <= "
                  f"{GPU_TARGET}. No GPU figure exists yet.", ""]
    pp = results.get("preprocess")
    lines += ["## Preprocessing throughput (`bench/preprocess.py`)", ""]
    if pp is None:
        lines += ["Not run (`--skip-preprocess`).", ""]
    else:
        lines += [f"`{pp['command']}` (exit {pp['returncode']}, {pp['seconds']} s; load average at start "
                  f"{pp['load_start']}, at end {pp['load_end']}):", "", "```", pp["output"], "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, choices=sorted(CONFIGS),
                   help="shape (default: cpu on CPU, gpu-400m on a GPU)")
    p.add_argument("--quick", action="store_true", help="the 'quick' shape, 3 repeats, no preprocessing run")
    p.add_argument("--repeats", type=int, default=None, help="timed round-robin rounds (default 6, quick 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="token,unique,table")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: all CPUs)")
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="wall (default) or cpu: process CPU time, for a CPU shared with other jobs (with --threads 1)")
    p.add_argument("--shared-data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--output", default=str(REPO / "docs" / "results" / "throughput.md"))
    p.add_argument("--json", default=None, help="also write the figures here (default: OUTPUT with .json)")
    a = p.parse_args(argv)

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    elif torch.get_num_threads() < (os.cpu_count() or 1):
        torch.set_num_threads(os.cpu_count() or 1)
    cuda = torch.cuda.is_available()
    device = a.device or ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        p.error("--device cuda: no CUDA device on this machine")
    name = "quick" if a.quick else (a.config or ("gpu-400m" if device == "cuda" else "cpu"))
    repeats = a.repeats or (3 if a.quick else 6)
    from lev_layer import _init_parallel

    _init_parallel(device)
    results: Dict[str, Any] = {
        "command": "python bench/throughput.py" + ("" if argv is None and len(sys.argv) == 1 else " " +
                                                   " ".join(sys.argv[1:] if argv is None else argv)),
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": _machine(), "versions": _versions(),
        "load_start": _load(), "quick": a.quick, "sections": []}
    print(f"throughput: config {name}, device {device}, {torch.get_num_threads()} threads, load {results['load_start']}")
    modes = tuple(m for m in a.modes.split(",") if m)
    shape = CONFIGS[name]
    if device == "cpu":
        res = measure(shape, arm_list("cpu", modes), device="cpu", dtype_name="float32", repeats=repeats,
                      warmup=a.warmup, shared=Path(a.shared_data), clock=a.clock)
        results["sections"].append({"title": f"CPU ({name} configuration, fp32)", "target": CPU_TARGET, "result": res})
        results["gpu_ran"] = False
        results["gpu_note"] = ("no CUDA device on this machine" if not cuda else "--device cpu was given")
        print("GPU section did not run: " + results["gpu_note"])
    else:
        res = measure(shape, arm_list("cuda", modes), device="cuda", dtype_name="bfloat16", repeats=repeats,
                      warmup=a.warmup, shared=Path(a.shared_data))
        results["sections"].append({"title": f"GPU ({name} configuration, bf16)", "target": GPU_TARGET, "result": res})
        results["gpu_ran"] = True
        from megatron_lev.models.config import te_available

        if te_available():
            try:
                res8 = measure(shape, [x for x in arm_list("cuda", modes) if x["arm"] != "lev" or x.get("default")],
                               device="cuda", dtype_name="bfloat16", repeats=repeats, warmup=a.warmup,
                               shared=Path(a.shared_data), fp8="hybrid")
                results["sections"].append({"title": f"GPU ({name} configuration, bf16 + FP8 hybrid)",
                                            "target": GPU_TARGET, "result": res8})
            except Exception as e:  # reported, not hidden
                results["fp8_error"] = f"{type(e).__name__}: {e}"
                print(f"FP8 section failed: {results['fp8_error']}")
    if not (a.skip_preprocess or a.quick):
        results["preprocess"] = run_preprocess()
    results["load_end"] = _load()
    out = Path(a.output)
    write_report(out, results)
    jpath = Path(a.json) if a.json else out.with_suffix(".json")
    jpath.write_text(json.dumps(results, indent=2, default=str))
    print(out.read_text())
    print(f"wrote {out} and {jpath}")
    return 0


if __name__ == "__main__":
    from lev_layer import _reexec_with_returning_malloc

    _reexec_with_returning_malloc()
    sys.exit(main())
