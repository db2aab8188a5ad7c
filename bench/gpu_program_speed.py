"""GPU check program ``speed``: the training step's own pace, for one 15-minute device window (one command of
at most 10 minutes; ``BUDGET_S``).

    python bench/gpu_check.py --program speed --plan
    python bench/gpu_check.py --program speed --out OUT [--wheels wheels] [--shared-data DIR]
    python bench/gpu_check.py --program speed --out OUT --sizes tiny --budget-s 900   # every stage on the CPU

Stages:

  env       the default program's: carried wheels, versions, the LEV basis, the measured bf16 matrix rate
            (the MFU peak of the runs below: ``--peak-tflops-per-device``) and copy bandwidth.
  gpu400m   ``pretrain_lev.py`` un-profiled at gpu-400m (24 x 1024, seq 2048, micro-batch 4, 2 micro-batches,
            bf16, distributed optimizer, overlapped grad reduce, the CUDA defaults: fused AdamW, RoPE
            fusion), tied, untied and lev one after the other; each run's own per-iteration lines (ms,
            TFLOP/s, tokens/s, MFU) with their medians after the warm-up, LEV/TIED and LEV/UNTIED.
  pile400m  the same at ``examples/pile/configs/400m.yaml`` scaled to one GPU (its model and sequence, a
            global batch of 4 micro-batches of 8, an o200k-sized vocabulary of mock data).
  profile   a torch.profiler trace (no shapes recorded) of the gpu-400m lev run: kernel time per step by
            part (LEV, RoPE, cross-entropy, optimizer, attention, the rest) and by the loop's spans, host
            syncs (``bench/_profile_trace.py``).
  kernels   LEV's Triton kernels alone at the kernel stage's default shape (the default program's stage).
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import gpu_check as gc
from gpu_check import REPO, SHARED, CheckFailed, CheckTimeout, Ctx, Skip, Stage

BUDGET_S = 540.0  # one command within a 15-minute window: the machine's start and the transfers take the rest
ARMS = ("tied", "untied", "lev")
MFU_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? MFU: ([\d.]+)%")
PILE = str(REPO / "examples" / "pile" / "configs" / "400m.yaml")
# The CUDA defaults (fused AdamW, RoPE fusion) are what the runs time. At the device sizes AdamW is asked for
# as auto, which is fused on CUDA and accepted where TE or Apex imports (a carried wheel; megatron then runs
# their FusedAdam, and --adam-impl fused is refused); the CPU stand-in asks for fused to run that path.
CUDA_DEFAULTS = ("--rope-fusion",)


def cuda_defaults(ctx: Ctx) -> List[str]:
    """The CUDA defaults' flags at ``ctx``'s sizes."""
    return ["--adam-impl", ctx.size["adam_impl"], *CUDA_DEFAULTS]


def _pile(layers: int, hidden: int, heads: int, ffn: int, seq: int, mb: int, gb: int, vocab: int) -> List[str]:
    """The shipped 400m config, its shape overridden where a size asks, on mock data."""
    return ["--config", PILE, "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(heads), "--ffn-hidden-size", str(ffn), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", str(mb), "--global-batch-size", str(gb), "--mock-data", "--vocab-size", str(vocab),
            "--tensor-model-parallel-size", "1", "--log-interval", "1", "--eval-interval", "100000"]


def _without_saves(argv: List[str], work: Path) -> List[str]:
    """``argv`` with its ``--config`` file copied without ``save_interval`` (which needs a --save the timed
    runs do not write)."""
    if "--config" not in argv:
        return argv
    i = argv.index("--config") + 1
    work.mkdir(parents=True, exist_ok=True)
    copy = work / Path(argv[i]).name
    lines = Path(argv[i]).read_text().splitlines(keepends=True)
    copy.write_text("".join(x for x in lines if not x.startswith("save_interval:")))
    return argv[:i] + [str(copy)] + argv[i + 1:]


SIZES: Dict[str, Dict[str, Any]] = {
    "device": dict(
        gpu400m=dict(model=gc._model(24, 1024, 16, 2048, 4, 8, 50257), steps=12,
                     describe="gpu-400m: 24 x 1024, seq 2048, 2 micro-batches of 4"),
        pile400m=dict(model=_pile(20, 1280, 20, 3456, 512, 8, 32, 200000), steps=12,
                      describe="examples/pile/configs/400m.yaml on one GPU: 20 x 1280, seq 512, 4 micro-batches of 8, "
                               "V = 200k"),
        profile=dict(model=gc._model(24, 1024, 16, 2048, 4, 8, 50257), steps=6, window=(3, 5)),
        kernels=dict(shapes=None, reps=20, warmup=3),  # the kernel stage's default shape
        precision=["--bf16"], lev=[], adam_impl="auto",
        seconds={"env": 25.0, "gpu400m": 170.0, "pile400m": 170.0, "profile": 70.0, "kernels": 30.0},
    ),
    "tiny": dict(
        gpu400m=dict(model=gc._model(2, 32, 2, 32, 2, 4, 1000), steps=4, describe="2 x 32, seq 32"),
        pile400m=dict(model=_pile(1, 32, 2, 64, 32, 2, 4, 1000), steps=3, describe="the 400m config at 1 x 32"),
        profile=dict(model=gc._model(1, 32, 2, 32, 2, 2, 1000), steps=4, window=(2, 4)),
        kernels=dict(shapes=(("tiny", 40, 2, 3, 5, 6),), reps=2, warmup=1),
        precision=["--bf16"], lev=["--lev-heads", "2", "--lev-seed-dim", "8", "--lev-knots", "5", "--lev-rank", "4",
                                   "--lev-init-sample-size", "4096"], adam_impl="fused",
        seconds={"env": 60.0, "gpu400m": 300.0, "pile400m": 240.0, "profile": 120.0, "kernels": 120.0},
    ),
}


def _peak(ctx: Ctx) -> List[str]:
    """The measured bf16 matrix rate as the MFU peak, where the env stage measured it."""
    rate = ctx.figures("env").get("bf16_matmul_tflops")
    return ["--peak-tflops-per-device", str(rate)] if rate else []


def train_argv(ctx: Ctx, shape: str, arm: str) -> List[str]:
    size = ctx.size
    s = size[shape]
    common = [*gc._transformer(), *size["precision"], *gc.PRODUCTION, *cuda_defaults(ctx), "--seed", "1234",
              "--lr", "3e-4", "--lr-warmup-iters", "1", "--eval-iters", "0", "--quiet-config"]
    argv = ["pretrain_lev.py", *s["model"], *common, "--train-iters", str(s["steps"]), "--log-interval", "1",
            "--input-embedding", arm, *_peak(ctx)]
    return argv + (size["lev"] if arm == "lev" else [])


def _training_figures(log_text: str, metrics: Path) -> Dict[str, Any]:
    out = gc.parse_training(log_text, metrics)
    lines = gc.LINE_RE.findall(log_text)
    out["lines"] = [{"iteration": int(i), "ms": float(ms), "tflops": float(tf), "tokens_per_s": float(tok)}
                    for i, ms, tf, tok in lines]
    mfu = {int(i): float(m) for i, m in MFU_RE.findall(log_text)}
    for line in out["lines"]:
        line["mfu_percent"] = mfu.get(line["iteration"])
    steady = [x["mfu_percent"] for x in out["lines"][2:] if x["mfu_percent"] is not None]
    if steady:
        out["median_mfu_percent"] = statistics.median(steady)
    return out


def stage_training(shape: str):
    """Each arm's un-profiled run at ``shape``, one after the other (one GPU), under an equal share of the limit."""

    def run(ctx: Ctx, timeout: float) -> Dict[str, Any]:
        work = Path(ctx.work) / shape
        figures: Dict[str, Any] = {"describe": ctx.size[shape]["describe"], "peak_tflops": _peak(ctx)[1:] or None,
                                   "runs": {}}
        end = time.monotonic() + timeout
        for k, arm in enumerate(ARMS):
            left = end - time.monotonic()
            limit = left / (len(ARMS) - k)
            metrics = work / f"{arm}.metrics.jsonl"
            metrics.unlink(missing_ok=True)
            argv = [sys.executable, *_without_saves(train_argv(ctx, shape, arm), work), "--metrics-file", str(metrics)]
            rc, output = gc.run_logged(argv, limit, work / f"{arm}.log", ctx.env())
            if rc == gc.TIMEOUT_RC:
                raise CheckTimeout(limit, figures, gc.tail(output))
            if rc != 0:
                raise CheckFailed(f"{arm}: pretrain_lev.py exit {rc}: {gc.tail(output, 600)}", figures)
            figures["runs"][arm] = _training_figures(output, metrics)
        ms = {arm: r.get("median_ms") for arm, r in figures["runs"].items()}
        if all(ms.values()):
            figures.update(lev_over_tied=ms["lev"] / ms["tied"], lev_over_untied=ms["lev"] / ms["untied"])
        return figures

    return run


def stage_profile(ctx: Ctx, timeout: float) -> Dict[str, Any]:
    """The default program's profile stage at this program's sizes, with the CUDA defaults the runs time
    (shapes not recorded: pretrain_lev.py's default)."""
    return gc.stage_profile(ctx, timeout, cuda_defaults(ctx))


STAGES = (
    Stage("env", gc.stage_env, cuda=False),
    Stage("gpu400m", stage_training("gpu400m")),
    Stage("pile400m", stage_training("pile400m")),
    Stage("profile", stage_profile),
    Stage("kernels", gc.stage_kernels),
)
CHILD_FUNCS = {"env": gc.child_env, "kernels": gc.child_kernels}


def plan(budget_s: float, sizes: str = "device", assume_tflops: Optional[float] = None,
         shared_data: str = str(SHARED)) -> List[Dict[str, Any]]:
    """Each stage's share: its seconds at ``BUDGET_S``, in proportion to ``budget_s``."""
    size = SIZES[sizes]
    k = budget_s / BUDGET_S if sizes == "device" else 1.0
    what = {
        "env": "versions, the LEV basis, the bf16 matrix rate (the runs' MFU peak) and copy bandwidth",
        "gpu400m": f"pretrain_lev.py un-profiled, {size['gpu400m']['describe']}, {size['gpu400m']['steps']} steps "
                   "each of tied, untied and lev (bf16, distributed optimizer, overlapped grad reduce, fused AdamW, "
                   "RoPE fusion): the runs' own per-iteration ms, TFLOP/s, tokens/s, MFU; LEV/TIED, LEV/UNTIED",
        "pile400m": f"the same at {size['pile400m']['describe']}",
        "profile": "torch.profiler trace of the gpu-400m lev run without shapes: kernel time by part (LEV, RoPE, "
                   "cross-entropy, optimizer, attention, the rest) and loop span; host syncs",
        "kernels": "LEV's Triton kernels alone at the kernel stage's default shape, CUDA events",
    }
    return [{"name": n, "planned_s": size["seconds"][n] * k, "what": what[n]} for n in size["seconds"]]


def _md_training(f: Dict[str, Any]) -> List[str]:
    lines = [f"{f.get('describe', '')}; MFU of {f.get('peak_tflops') or 'the datasheet'} TFLOP/s.", "",
             "| arm | median ms/iter | TFLOP/s | tokens/s | MFU % |", "|---|---|---|---|---|"]
    for arm, r in f.get("runs", {}).items():
        lines.append(f"| {arm} | {r.get('median_ms', float('nan')):.1f} | {r.get('median_tflops', float('nan')):.1f} | "
                     f"{r.get('median_tokens_per_s', float('nan')):,.0f} | {r.get('median_mfu_percent', 'n/a')} |")
    if "lev_over_tied" in f:
        lines += ["", f"LEV/TIED {f['lev_over_tied']:.3f}, LEV/UNTIED {f['lev_over_untied']:.3f}."]
    return lines


def _md_profile(f: Dict[str, Any]) -> List[str]:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in f.get("parts_ms_per_step", {}).items())
    spans = ", ".join(f"{k} {v:.2f}" for k, v in f.get("spans_ms_per_step", {}).items())
    return [f"Step {f.get('step_ms', float('nan')):.1f} ms ({f.get('timeline')}); kernel ms per step by part: {parts}; "
            f"by loop span: {spans}; host syncs per step {f.get('host_syncs_per_step')}."]


MARKDOWN = {"gpu400m": _md_training, "pile400m": _md_training, "profile": _md_profile,
            "env": gc.MARKDOWN["env"], "kernels": gc.MARKDOWN["kernels"]}
