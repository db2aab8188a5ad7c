#!/usr/bin/env python
"""What a training step of ``pretrain_lev.py`` issues, counted on the CPU: the aten operators of each part
of the step (forward, backward, optimizer, the rest), so that the launches of an eager step on a GPU can be
counted and cut without a GPU.

    python bench/step_ops.py                         # gpu-400m's 24 layers, small widths; tied and lev
    python bench/step_ops.py --arms tied --json out.json
    python bench/step_ops.py --layers 2 --steps 3    # a smoke run

The run is ``pretrain_lev.py`` itself, in this process (one rank, gloo), at gpu-400m's layer count and
production flags (local spec, bf16, distributed optimizer, overlapped grad reduce) with small hidden sizes,
and a ``TorchDispatchMode`` that sees every aten operator the step dispatches below autograd. Parts: the
training loop's named ranges (``training.profiling.span``); inside ``forward_backward`` an operator runs in
the backward when autograd is executing a node. ``launching`` leaves out the operators that never launch a
kernel on a GPU (views, ``empty*``, ``detach``) and the host reads; ``host reads`` are ``_local_scalar_dense``
(``.item()``, ``float(t)``: a host sync each of a device tensor; torch's AdamW reads its step counts, CPU
tensors, this way, two per parameter, which costs no sync). What the CPU decomposes and CUDA does not is
counted as CUDA runs it: torch's ``rms_norm`` (on CUDA one fused kernel forward and one backward, about 8
and 16 launching operators here; ``rms_norm_as_on_cuda``). Counted on one steady step (``--steps``, the
last; the first steps compile and allocate lazily), a step that does not log unless ``--log-interval 1``. torch's AdamW runs as
on CUDA: ``--adam-impl fused`` (auto's choice there); with ``--adam-impl foreach`` its foreach implementation
(on CPU tensors torch would take its per-tensor loop). RoPE is megatron's fused one (``--rope-fusion``, its
CUDA default; without Transformer Engine ``models.rope``, eager here, compiled on CUDA).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

PARTS = ("forward", "backward", "optimizer", "other")
# Aten operators that allocate or relabel memory, or compute on dtypes, and launch no kernel on a GPU.
NO_LAUNCH = frozenset({"promote_types", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
                       "lift_fresh", "resize_", "set_", "_reshape_alias", "_unsafe_view", "view", "as_strided",
                       "_record_function_enter_new", "_record_function_exit"})
HOST_READ = "_local_scalar_dense"


def launches(name: str, func) -> bool:
    """Whether the aten operator ``func`` (short ``name``) launches work on a GPU."""
    return name not in NO_LAUNCH and not getattr(func, "is_view", False)


class StepOps(TorchDispatchMode):
    """Counts aten operators by (step, part, operator). ``part`` follows the loop's spans (set by
    :func:`counting_spans`); inside ``forward_backward`` the autograd engine's current node tells the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.step = 0
        self.spans: List[str] = []
        self.counts: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def part(self) -> str:
        if "forward_backward" in self.spans:
            return "backward" if torch._C._current_autograd_node() is not None else "forward"
        if "optimizer" in self.spans:
            return "optimizer"
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func._schema.name.split("::")[-1]
            self.counts[self.step][(self.part(), name, launches(name, func))] += 1
        return func(*args, **(kwargs or {}))

    def record(self, name: str) -> None:
        """One launching operator that the CPU runs as several (counted while :meth:`pause` hides those)."""
        self.counts[self.step][(self.part(), name, True)] += 1

    @contextlib.contextmanager
    def pause(self):
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was

    def summary(self, step: int) -> Dict[str, Any]:
        """The step's counts: per part all operators, the launching ones and host reads; the most frequent."""
        c = self.counts[step]
        out: Dict[str, Any] = {}
        for part in PARTS:
            mine = {k: n for k, n in c.items() if k[0] == part}
            out[part] = {"ops": sum(mine.values()),
                         "launching": sum(n for k, n in mine.items() if k[2] and k[1] != HOST_READ),
                         "host_reads": sum(n for k, n in mine.items() if k[1] == HOST_READ)}
        for key in ("ops", "launching", "host_reads"):
            out.setdefault("total", {})[key] = sum(out[p][key] for p in PARTS)
        top = collections.Counter()
        for (part, name, launching), n in c.items():
            if launching and name != HOST_READ:
                top[f"{part}:{name}"] += n
        out["top_launching"] = dict(top.most_common())
        return out


@contextlib.contextmanager
def optimizer_as_on_cuda():
    """torch's optimizers pick the implementation they pick for CUDA tensors (``foreach``; on CPU tensors
    they default to the per-tensor loop, one launch per parameter and operator): the count is the GPU's."""
    from torch.optim import optimizer

    real = optimizer._get_foreach_kernels_supported_devices
    optimizer._get_foreach_kernels_supported_devices = lambda: [*real(), "cpu"]
    try:
        yield
    finally:
        optimizer._get_foreach_kernels_supported_devices = real


@contextlib.contextmanager
def rms_norm_as_on_cuda(counter: StepOps):
    """torch's ``rms_norm`` counted as CUDA runs it: one kernel forward (``_fused_rms_norm``) and one backward
    (``_fused_rms_norm_backward``), where the CPU decomposes it into about 8 and 16 operators. The values are
    torch's own (the backward recomputes the norm and takes its gradient, the same arithmetic)."""
    import torch.nn.functional as F

    real = F.rms_norm

    class AsOnCuda(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, shape, eps):
            ctx.save_for_backward(x, weight)
            ctx.shape, ctx.eps = shape, eps
            counter.record("_fused_rms_norm")
            with counter.pause():
                return real(x, shape, weight, eps)

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            counter.record("_fused_rms_norm_backward")
            with counter.pause(), torch.enable_grad():
                inputs = [x.detach().requires_grad_(ctx.needs_input_grad[0])]
                if weight is not None:
                    inputs.append(weight.detach().requires_grad_(ctx.needs_input_grad[1]))
                out = real(inputs[0], ctx.shape, inputs[1] if weight is not None else None, ctx.eps)
                wanted = [t for t in inputs if t.requires_grad]
                got = iter(torch.autograd.grad(out, wanted, grad))
                grads = [next(got) if t.requires_grad else None for t in inputs]
            return grads[0], (grads[1] if weight is not None else None), None, None

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        return AsOnCuda.apply(input, weight, tuple(normalized_shape), eps)

    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = real


@contextlib.contextmanager
def counting_spans(counter: StepOps):
    """The loop's spans and steps seen by ``counter`` (``training.profiling.span`` and ``loop._train_step``
    wrapped for the duration)."""
    from megatron_lev.training import loop, profiling

    real_span, real_step = profiling.span, loop._train_step

    @contextlib.contextmanager
    def span(name: str):
        counter.spans.append(name)
        try:
            with real_span(name):
                yield
        finally:
            counter.spans.pop()

    def step(*a, **kw):
        counter.step += 1
        return real_step(*a, **kw)

    profiling.span, loop._train_step = span, step
    try:
        yield counter
    finally:
        profiling.span, loop._train_step = real_span, real_step


def pretrain_argv(arm: str, *, layers: int, hidden: int, heads: int, seq: int, micro_batch: int, vocab: int,
                  steps: int, log_interval: int, extra: List[str]) -> List[str]:
    from reproduce import TRANSFORMER  # the Llama-style transformer every bench run shares

    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(micro_batch),
            "--global-batch-size", str(micro_batch), "--mock-data", "--vocab-size", str(vocab),
            "--train-iters", str(steps), "--lr", "3e-4", "--lr-warmup-iters", "1", *TRANSFORMER, "--bf16",
            "--transformer-impl", "local", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--log-interval", str(log_interval), "--eval-iters", "0", "--quiet-config", "--input-embedding", arm,
            # What --adam-impl auto and the RoPE fusion's default take on CUDA.
            "--adam-impl", "fused", "--rope-fusion"]
    if arm == "lev":
        argv += ["--lev-init-sample-size", "4096"]
    return argv + list(extra)


def count(argv: List[str], step: int) -> Dict[str, Any]:
    """Run pretrain_lev.py with ``argv`` in this process; the counts of its iteration ``step``."""
    from megatron_lev.training import pretrain

    counter = StepOps()
    with optimizer_as_on_cuda(), rms_norm_as_on_cuda(counter), counting_spans(counter), counter:
        code = pretrain(argv)
    if code != 0:
        raise SystemExit(f"pretrain_lev.py {' '.join(argv)} exited with {code}")
    return counter.summary(step)


def format_table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    lines = ["| arm | part | aten ops | launching | host reads |", "|---|---|---|---|---|"]
    for arm, res in results.items():
        for part in PARTS + ("total",):
            r = res[part]
            lines.append(f"| {arm} | {part} | {r['ops']} | {r['launching']} | {r['host_reads']} |")
    return lines


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="tied,lev")
    p.add_argument("--layers", type=int, default=24, help="gpu-400m's 24 by default")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--steps", type=int, default=3, help="iterations run; the last is counted")
    p.add_argument("--log-interval", type=int, default=100, help="1: the counted step logs (reads its scalars)")
    p.add_argument("--top", type=int, default=25, help="the most frequent launching operators printed per arm")
    p.add_argument("--json", default=None, help="write the counts here")
    p.add_argument("--output", default=None, help="write the table (markdown) here")
    a, extra = p.parse_known_args(argv)
    if a.steps < 1:
        p.error("--steps must be at least 1")
    torch.set_num_threads(1)
    results = {}
    for arm in [x for x in a.arms.split(",") if x]:
        args = pretrain_argv(arm, layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq,
                             micro_batch=a.micro_batch, vocab=a.vocab, steps=a.steps, log_interval=a.log_interval,
                             extra=extra)
        results[arm] = count(args, a.steps)
        results[arm]["argv"] = " ".join(args)
    print("\n".join(format_table(results)))
    for arm, res in results.items():
        print(f"\n{arm}: most frequent launching operators of the step")
        for k, n in list(res["top_launching"].items())[:a.top]:
            print(f"  {n:6d}  {k}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    if a.output:
        cmd = "python bench/step_ops.py" + "".join(f" {x}" for x in (sys.argv[1:] if argv is None else argv))
        lines = [f"`{cmd}` (torch {torch.__version__}); aten operators of iteration {a.steps} of "
                 f"`pretrain_lev.py {next(iter(results.values()))['argv']}` (the arm varies).", "",
                 *format_table(results), ""]
        for arm, res in results.items():
            lines += [f"{arm}, launching operators by part: " + ", ".join(
                f"{k} {n}" for k, n in res["top_launching"].items()), ""]
        Path(a.output).write_text("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
