#!/usr/bin/env python
"""The output head's step with and without its logits: megatron-core's path (the vocab-parallel
ColumnParallelLinear head, then ``vocab_parallel_cross_entropy``) against the linear cross-entropy
(``--cross-entropy-fusion-impl linear``, ``megatron_lev.parallel.linear_cross_entropy``), in one run.

    python bench/linear_cross_entropy.py                          # V = 50k and 200k, TP = 1 and 2, CPU
    python bench/linear_cross_entropy.py --tokens 4096 --hidden 512 --dtype fp32 --repeats 5
    python bench/linear_cross_entropy.py --device cuda --tokens 16384 --hidden 2048 --tp 1

A step is the head's forward and backward on given final hidden states [tokens, 1, hidden] with a loss
mask (the loss summed over the unmasked tokens and divided by their count, as the training loop's loss
function), the gradients of the hidden states and of the head's weight included. The two paths' loss
and gradients are compared once (relative difference of the norms). Each (V, TP) layout
runs on TP ranks of its own (gloo on the CPU, one rank's share of the cores each), the two paths
alternately, ``--repeats`` times after one warm-up each for the time and as many again for the peak;
the figures are medians, per rank (the largest over the ranks).

Peak memory is the step's peak above the resident state before it (the weight shard, the hidden
states, the targets): on the CPU the resident-set high-water mark (Linux ``/proc/self/clear_refs`` then
``VmHWM``), independent of torch's allocator. Every tensor of 256 KiB or more is counted while it lives:
before each peak step the ranks fix glibc's mmap threshold there and return the heap's free pages (by
default the threshold grows up to 32 MiB, and freed blocks below it are reused from the heap without
the resident set moving); the timed steps run under glibc's default. On CUDA: torch's allocator peak. The machine's
load averages are printed before and after, since the CPU timings share the machine with whatever else
runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from lev_layer import PeakMemory  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _step_megatron(head, x, y, mask):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, _ = head(x)
    loss = vocab_parallel_cross_entropy(logits, y)
    del logits
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach()


def _step_chunked(head, x, y, mask, chunk_size, vocab_block):
    from megatron_lev.parallel.linear_cross_entropy import linear_cross_entropy

    loss = linear_cross_entropy(x, head.weight, y, tp_group=head.tp_group, chunk_size=chunk_size,
                                vocab_block=vocab_block)
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _timed(step, device: str, group, exact_memory: bool) -> tuple:
    """(peak MiB above the start, seconds, whether the peak counts every block of 256 KiB or more) of one
    step; the time is the slowest rank's."""
    exact = device != "cpu" or (exact_memory and _exact_resident_set())
    torch.distributed.barrier(group=group)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX, group=group)
    return mem.mib, float(elapsed), exact


def _exact_resident_set() -> bool:
    """Make the resident set count every block of 256 KiB or more while it lives. glibc serves blocks below
    its mmap threshold (which grows up to 32 MiB as large blocks are freed) from its heap, where a freed
    block stays resident and is reused without the resident set moving: the threshold is fixed at 256 KiB
    and the heap's free pages are returned (``malloc_trim``), so that a block the heap hands out again
    is faulted in, and counted, anew. Called before each measured step; False where the C library has no
    ``mallopt``/``malloc_trim`` (not glibc): there the peak can miss blocks the heap reused."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        if libc.mallopt(-3, 256 * 1024) != 1:  # -3: M_MMAP_THRESHOLD; 1 is success
            return False
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def rank_measure(vocab: int, tokens: int, hidden: int, dtype_name: str, repeats: int, device: str,
                 chunk_size, vocab_block, threads) -> dict:
    """One rank's medians for both paths (run on the ranks of one TP layout)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from megatron_lev.parallel.linear_cross_entropy import tiling

    if threads:
        torch.set_num_threads(threads)
    dtype = DTYPES[dtype_name]
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=tp, tensor_model_parallel_size=tp,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
                               perform_initialization=False)
    head = ColumnParallelLinear(hidden, vocab, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                gather_output=False, tp_group=group).to(dev)
    g = torch.Generator().manual_seed(1234 + rank)
    with torch.no_grad():
        head.weight.copy_((torch.randn(head.weight.shape, generator=g) * hidden ** -0.5).to(dtype))
    g = torch.Generator().manual_seed(7)  # the same tokens and targets on every rank
    x = torch.randn(tokens, 1, hidden, generator=g).to(dtype).to(dev).requires_grad_(True)
    y = torch.randint(0, vocab, (tokens, 1), generator=g).to(dev)
    mask = (torch.rand(tokens, 1, generator=g) > 0.1).float().to(dev)

    steps = {"megatron": lambda: _step_megatron(head, x, y, mask),
             "chunked": lambda: _step_chunked(head, x, y, mask, chunk_size, vocab_block)}
    figures = {name: {"mib": [], "s": []} for name in steps}
    exact = True

    def clear():
        x.grad = None
        head.weight.grad = None

    # Warm-up (allocator, first touch of the code paths), and the two paths' agreement on these sizes.
    outputs = {}
    for name, step in steps.items():
        loss = step()
        outputs[name] = (loss, x.grad.clone(), head.weight.grad.clone())
        clear()
    agreement = {what: _rel(got, ref) for what, got, ref in zip(("loss", "grad_input", "grad_weight"),
                                                                 outputs["chunked"], outputs["megatron"])}
    del outputs
    # Times first, under glibc's own allocation policy; then peaks, with every block of 256 KiB or more
    # counted (``_exact_resident_set``), which costs page faults the timed steps do not pay.
    for kind in ("s", "mib"):
        for _ in range(repeats):
            for name, step in steps.items():
                mib, s, step_exact = _timed(step, device, group, exact_memory=kind == "mib")
                figures[name][kind].append(s if kind == "s" else mib)
                exact = exact and (kind == "s" or step_exact)
                clear()
    tiles = tiling(tokens, head.weight.shape[0], dev, chunk_size, vocab_block)
    return {"tiles": tuple(tiles), "threads": torch.get_num_threads(), "agreement": agreement, "exact_peak": exact,
            **{name: {k: statistics.median(v) for k, v in f.items()} for name, f in figures.items()}}


def measure(vocab: int, tp: int, a) -> dict:
    """Both paths at one (V, TP): the largest per-rank figures over the ranks."""
    from megatron_lev.distributed import spawn_ranks

    per_rank = spawn_ranks(rank_measure, tp, tp=tp, seed=1234, quiet=True, timeout=3600.0,
                           collective_timeout=1800.0,
                           args=(vocab, a.tokens, a.hidden, a.dtype, a.repeats, a.device, a.chunk_size, a.vocab_block,
                                 a.threads))
    out = {name: {k: max(r[name][k] for r in per_rank) for k in ("mib", "s")} for name in ("megatron", "chunked")}
    out.update(tiles=per_rank[0]["tiles"], threads=per_rank[0]["threads"],
               exact_peak=all(r["exact_peak"] for r in per_rank),
               agreement={k: max(r["agreement"][k] for r in per_rank) for k in per_rank[0]["agreement"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[50000, 200000])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (sequence x micro-batch)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: the library's)")
    p.add_argument("--vocab-block", type=int, default=None, help="vocabulary rows per tile (default: the library's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads a rank (default: the cores shared out over the TP ranks)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    for v in a.vocab:
        for tp in a.tp:
            if v % tp:
                p.error(f"--vocab {v} is not divisible by --tp {tp}")
    load_before = os.getloadavg()
    print(f"head + loss step (forward + backward), {a.tokens} tokens, hidden {a.hidden}, {a.dtype}, {a.device}, "
          f"medians of {a.repeats}; {os.cpu_count()} cores, load average {tuple(round(x, 1) for x in load_before)}")
    print("peak = the step's peak above the resident state (" + (
        "torch's CUDA allocator peak" if a.device == "cuda" else
        "resident-set high-water mark, /proc/self/clear_refs + VmHWM") + "), per rank")
    results = {}
    for v in a.vocab:
        for tp in a.tp:
            r = measure(v, tp, a)
            results[(v, tp)] = r
            m, c = r["megatron"], r["chunked"]
            print(f"V={v} TP={tp} ({r['threads']} threads a rank; tiles {r['tiles'][0]} tokens x "
                  f"{r['tiles'][1]} rows): megatron {m['mib']:.0f} MiB {m['s']:.2f} s | chunked {c['mib']:.0f} MiB "
                  f"{c['s']:.2f} s | memory ratio {m['mib'] / max(c['mib'], 1e-9):.2f}, time ratio "
                  f"{c['s'] / m['s']:.2f} | relative difference: " +
                  ", ".join(f"{k} {v:.1e}" for k, v in r["agreement"].items()), flush=True)
    if not all(r["exact_peak"] for r in results.values()):
        print("peak memory NOT exact: this C library has no glibc mallopt/malloc_trim, so blocks its heap "
              "reused are missing from the peaks above (a lower bound)")
    print(f"load average after: {tuple(round(x, 1) for x in os.getloadavg())}")
    key = (max(a.vocab), min(a.tp))
    r = results[key]
    print(f"peak memory ratio (megatron / chunked) at V={key[0]}, TP={key[1]}: "
          f"{r['megatron']['mib'] / max(r['chunked']['mib'], 1e-9):.2f}")
    print(f"step time ratio (chunked / megatron) at V={key[0]}, TP={key[1]}: "
          f"{r['chunked']['s'] / r['megatron']['s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
