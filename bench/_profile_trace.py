"""Where a training step's time goes, from a torch.profiler trace (``pretrain_lev.py --profile
--use-pytorch-profiler``): LEV's Triton kernels, LEV's GEMMs, the rest; and host syncs per step.

    summarize(trace) -> figures      # trace: the chrome-trace dict, or the path of a *.pt.trace.json

The timeline is the GPU kernels where the trace has any; on a CPU run (the check's stand-in) it is the
leaf CPU operators (those that call no other), so the same code reads both. Every work item is put in
one category:

- ``lev_triton``: LEV's fused product, by the names of ``megatron_lev/kernels/lev_triton.py``'s
  kernels (``LEV_KERNELS``);
- ``lev_gemm``: a matrix product whose operands are all fp32: in a bf16 model those are LEV's (its
  projections run in true fp32; the transformer's and the output head's GEMMs are bf16). Found from
  the innermost GEMM operator around the item (a kernel's launch, linked by its correlation id);
- ``attention``: SDPA's kernels (flash, cuDNN, memory-efficient) or anything under an SDPA operator;
- ``other``: every other kernel (the transformer's GEMMs, norms, the optimizer, ...).

Shares are of the mean step (``ProfilerStep#`` spans): each category's busy time per step, and
``idle``, the step time no item covers. Host syncs per step: the CUDA runtime calls that block the
host until the device catches up (``SYNC_CALLS``); ``scalar_reads_per_step`` counts
``aten::_local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``): a host sync each on a CUDA
tensor, and the only figure a CPU trace has. ``syncs_by_place`` and ``scalar_reads_by_place`` say where
they come from: the innermost named range around each (the training loop's ``megatron_lev.*`` spans,
``Optimizer.step#...``, an autograd node's backward) and the innermost operator, per step.

``parts_ms_per_step`` (and ``parts_items_per_step``, the kernels or leaf operators) put every work item in
one of ``PARTS`` by the ranges around it: LEV, RoPE (``megatron_lev.rope``, its backward node, TE's rotary
kernels), the cross-entropy (``megatron_lev.cross_entropy``, megatron's cross-entropy functions), the
optimizer (the loop's ``megatron_lev.optimizer`` span), attention, the rest; ``spans_ms_per_step`` by the
loop's innermost span (``forward_backward``, ``optimizer``, ...; ``backward`` for autograd's own thread).
"""

from __future__ import annotations

import collections
import glob
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

LEV_KERNELS = ("_fwd_kernel", "_bwd_kernel", "_bwd_grouped_kernel")
LOOP_SPANS = ("batch", "step", "forward_backward", "loss", "optimizer", "log")
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                      "aten::_addmm_activation", "aten::einsum"})
SDPA_PREFIX = "aten::_scaled_dot_product"
ATTENTION_WORDS = ("flash", "fmha", "cudnn_attn", "attention", "sdpa")
SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"})
CATEGORIES = ("lev_triton", "lev_gemm", "attention", "other")
_FLOAT_TYPES = ("float", "c10::BFloat16", "c10::Half", "double", "c10::Float8_e4m3fn", "c10::Float8_e5m2")


def find_trace(folder: Union[str, Path]) -> Optional[str]:
    """The newest ``*.pt.trace.json`` under ``folder`` (torch.profiler's tensorboard handler writes one)."""
    found = sorted(glob.glob(os.path.join(str(folder), "**", "*.pt.trace.json"), recursive=True), key=os.path.getmtime)
    return found[-1] if found else None


def _fp32_gemm(op: Dict[str, Any]) -> bool:
    types = [t for t in (op.get("args") or {}).get("Input type", []) if t in _FLOAT_TYPES]
    return bool(types) and all(t == "float" for t in types)


def _category(name: str, stack: Sequence[Dict[str, Any]]) -> str:
    if name.startswith(LEV_KERNELS):
        return "lev_triton"
    gemm = next((op for op in reversed(stack) if op["name"] in GEMM_OPS), None)
    if gemm is not None and _fp32_gemm(gemm):
        return "lev_gemm"
    low = name.lower()
    if any(w in low for w in ATTENTION_WORDS) or any(op["name"].startswith(SDPA_PREFIX) for op in stack):
        return "attention"
    return "other"


def _by_start(ops: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0)))


def _ends(op: Dict[str, Any]) -> float:
    return op["ts"] + op.get("dur", 0)


def _nest(ops: List[Dict[str, Any]]):
    """For one thread's operators: [(operator, its enclosing operators outermost first, is a leaf)]."""
    out, stack, parents = [], [], set()
    for op in _by_start(ops):
        while stack and _ends(stack[-1]) <= op["ts"]:
            stack.pop()
        if stack:
            parents.add(id(stack[-1]))
        out.append((op, list(stack)))
        stack.append(op)
    return [(op, anc, id(op) not in parents) for op, anc in out]


def _enclosing(ops: List[Dict[str, Any]], points: List[float]) -> List[List[Dict[str, Any]]]:
    """For one thread: the operators enclosing each time of ``points`` (ts <= t < ts + dur), outermost first."""
    ops = _by_start(ops)
    order = sorted(range(len(points)), key=lambda i: points[i])
    out: List[List[Dict[str, Any]]] = [[] for _ in points]
    stack: List[Dict[str, Any]] = []
    j = 0
    for k in order:
        t = points[k]
        while j < len(ops) and ops[j]["ts"] <= t:
            while stack and _ends(stack[-1]) <= ops[j]["ts"]:
                stack.pop()
            stack.append(ops[j])
            j += 1
        while stack and _ends(stack[-1]) <= t:
            stack.pop()
        out[k] = [op for op in stack if _ends(op) > t]
    return out


_AUTOGRAD = "autograd::engine::evaluate_function: "
# What each work item is part of, by the ranges around it (first match wins): the names of the loop's
# ranges and the project's (megatron_lev.rope, megatron_lev.cross_entropy), of megatron's and the project's
# autograd functions (their backward nodes), and words of kernel names (Transformer Engine's RoPE, LEV's).
PARTS = ("lev", "rope", "cross_entropy", "optimizer", "attention", "other")
_PART_WORDS = {"rope": ("megatron_lev.rope", "RotaryPosEmb", "rotary", "rope"),
               # torch's own loss (F.cross_entropy) goes back through NllLoss and LogSoftmax nodes
               "cross_entropy": ("megatron_lev.cross_entropy", "CrossEntropy", "cross_entropy", "_LinearCrossEntropy",
                                 "NllLoss", "nll_loss", "LogSoftmax", "log_softmax", "LogSoftMax"),
               "optimizer": ("megatron_lev.optimizer", "Optimizer.step", "adam")}
# LEV's forward range and the backward nodes of its products and table (lev/, kernels/).
_LEV_WORDS = ("megatron_lev.lev", "_SeparableProduct", "_TritonProduct", "_FusedProduct", "_TableRows")


def _part(name: str, stack: Sequence[Dict[str, Any]], category: str) -> str:
    if category in ("lev_triton", "lev_gemm"):
        return "lev"
    names = [str(e.get("name", "")) for e in stack]
    if any(n == w or n.startswith(_AUTOGRAD + w) for n in names for w in _LEV_WORDS):
        return "lev"
    for part, words in _PART_WORDS.items():
        if any(w in n for n in names + [name] for w in words):
            return part
    return "attention" if category == "attention" else "other"


def _span(stack: Sequence[Dict[str, Any]]) -> str:
    """The training loop's innermost named range around an item (``megatron_lev.forward_backward``, ...), or
    ``backward`` for autograd's own thread (outside the loop's ranges on CUDA)."""
    for e in reversed(stack):
        name = str(e.get("name", ""))
        if name.startswith("megatron_lev.") and name.split(".", 1)[1] in LOOP_SPANS:
            return name.split(".", 1)[1]
    if any(str(e.get("name", "")).startswith(_AUTOGRAD) for e in stack):
        return "backward"
    return "outside the loop's ranges"


def _place(stack: Sequence[Dict[str, Any]]) -> str:
    """``range / operator`` of an enclosing stack (outermost first): the innermost named range (a
    ``record_function`` span other than the step's, or an autograd node) and the innermost operator."""
    region, op = None, None
    for e in reversed(stack):
        name = str(e.get("name", ""))
        if op is None and e.get("cat") == "cpu_op" and not name.startswith(_AUTOGRAD):
            op = name
        if region is None and ((e.get("cat") == "user_annotation" and not name.startswith("ProfilerStep#"))
                               or name.startswith(_AUTOGRAD)):
            region = name.replace(_AUTOGRAD, "backward of ")
    return f"{region or 'outside any range'} / {op or '-'}"


def _places(ops_by_tid: Dict[Any, List[Dict[str, Any]]], events: List[Dict[str, Any]], n: int,
            inside: bool) -> List[Dict[str, Any]]:
    """Where ``events`` happen, per step, most first. ``inside``: an event is itself an operator of the lists
    (its own span is left out of its place)."""
    by_tid: Dict[Any, List[Dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    places = collections.Counter()
    for tid, evs in by_tid.items():
        for e, stack in zip(evs, _enclosing(ops_by_tid.get(tid, []), [e["ts"] for e in evs])):
            places[_place([o for o in stack if o is not e] if inside else stack)] += 1
    return [{"place": k, "per_step": v / n} for k, v in places.most_common(12)]


def _union_length(intervals: List[tuple]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(trace: Union[str, Path, Dict[str, Any]]) -> Dict[str, Any]:
    """The figures of the module doc from one trace (a path or the loaded chrome-trace dict)."""
    if not isinstance(trace, dict):
        with open(trace, encoding="utf-8") as f:
            trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    # The host's spans only: on CUDA kineto draws each ProfilerStep# again on the GPU's timeline.
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]
    if not steps:
        raise ValueError("the trace has no ProfilerStep# spans: was it recorded with a profiler schedule?")
    step_us = sum(e["dur"] for e in steps) / len(steps)
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    by_tid: Dict[Any, List[Dict[str, Any]]] = collections.defaultdict(list)  # operators and named ranges
    for op in events:
        if op.get("cat") in ("cpu_op", "user_annotation"):
            by_tid[(op.get("pid"), op.get("tid"))].append(op)

    items: List[tuple] = []  # (name, start, end, stack)
    if kernels:
        timeline = "cuda kernels"
        launch = {(e.get("args") or {}).get("correlation"): e for e in runtime}
        launches: Dict[Any, List[tuple]] = collections.defaultdict(list)  # tid -> [(kernel, launch ts)]
        for k in kernels:
            r = launch.get((k.get("args") or {}).get("correlation"))
            launches[(r.get("pid"), r.get("tid")) if r else None].append((k, r["ts"] if r else None))
        for tid, pairs in launches.items():
            stacks = _enclosing(by_tid.get(tid, []), [ts for _, ts in pairs]) if tid is not None else [[]] * len(pairs)
            for (k, _), stack in zip(pairs, stacks):
                items.append((k["name"], k["ts"], k["ts"] + k.get("dur", 0), stack))
    else:
        timeline = "cpu operators (leaves)"
        for ops in by_tid.values():
            for op, ancestors, leaf in _nest(ops):
                if leaf and op.get("cat") == "cpu_op":
                    items.append((op["name"], op["ts"], _ends(op), ancestors + [op]))
    busy = collections.Counter()
    top = collections.Counter()
    parts, spans, launches_per = collections.Counter(), collections.Counter(), collections.Counter()
    for name, a, b, stack in items:
        cat = _category(name, stack)
        busy[cat] += b - a
        top[(cat, name[:90])] += b - a
        part = _part(name, stack, cat)
        parts[part] += b - a
        launches_per[part] += 1
        spans[_span(stack)] += b - a
    n = len(steps)
    covered = _union_length([(a, b) for _, a, b, _ in items]) / n
    ms = {c: busy[c] / n / 1e3 for c in CATEGORIES}
    sync_events = [e for e in runtime if e.get("name") in SYNC_CALLS]
    scalar_events = [e for e in cpu_ops if e.get("name") == "aten::_local_scalar_dense"]
    syncs, scalar = len(sync_events), len(scalar_events)
    ranges = collections.defaultdict(list)  # tid -> its operators and named ranges, for the places
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ranges[(e.get("pid"), e.get("tid"))].append(e)
    return {
        "timeline": timeline, "steps": n, "step_ms": step_us / 1e3,
        "ms_per_step": {**ms, "idle": max(0.0, step_us - covered) / 1e3},
        "share": {**{c: ms[c] * 1e3 / step_us for c in CATEGORIES}, "idle": max(0.0, step_us - covered) / step_us},
        "host_syncs_per_step": syncs / n if runtime else None,
        "scalar_reads_per_step": scalar / n,
        "syncs_by_place": _places(ranges, sync_events, n, inside=False),
        "scalar_reads_by_place": _places(ranges, scalar_events, n, inside=True),
        "top": [{"category": c, "name": name, "ms_per_step": t / n / 1e3} for (c, name), t in top.most_common(12)],
        "parts_ms_per_step": {p: parts[p] / n / 1e3 for p in PARTS},
        "parts_items_per_step": {p: launches_per[p] / n for p in PARTS},
        "spans_ms_per_step": {k: v / n / 1e3 for k, v in spans.most_common()},
    }
