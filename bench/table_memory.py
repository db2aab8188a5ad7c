#!/usr/bin/env python
"""Peak memory of one LEV table-mode step: the table's row gradients in one fp32 buffer, against a
dense V x D gradient per micro-batch (``F.embedding`` on a leaf table, the baseline re-created here).

    python bench/table_memory.py                       # V = 50,304 (GPT-2 padded), D = 1024, 4 micro-batches
    python bench/table_memory.py --vocab 50304 --hidden 2048 --micro-batches 8 --repeats 3

One process builds the pure LEV layer (paper defaults, fp32) and runs, alternately, ``--repeats`` steps
of each variant: begin the table, forward + backward of every micro-batch (random ids), finish (the
gradient pushed back through G). The figure is the step's peak RSS above the level before it (Linux
``clear_refs``; large allocations are returned to the OS), median over the repeats, with V x D x 4 bytes
beside it. The machine's load averages are printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from lev_layer import PeakMemory  # noqa: E402

from megatron_lev.lev import LEVConfig, LEVEmbedding  # noqa: E402
from megatron_lev.lev.layer import ComputeModes, table_backward  # noqa: E402


class DenseGradModes(ComputeModes):
    """The baseline: a leaf table whose micro-batch lookups build a dense V x D gradient each."""

    def begin(self, fn, device):
        table = super().begin(fn, device)
        self.table_grad = None
        self.table = table.requires_grad_(True)
        return self.table

    def lookup(self, flat_ids):
        self._seen[flat_ids] = True
        return F.embedding(flat_ids, self.table).to(self._dtype)

    def finish(self, fn, params):
        table, seen = self.table, self._seen
        self.table = self._seen = self._anchor = None
        if table is not None:
            rows = torch.nonzero(seen, as_tuple=False).squeeze(1)
            table_backward(fn, table.grad, self.config.chunk_size, params, rows=rows)


def step(emb: LEVEmbedding, batches) -> None:
    for ids in batches:
        out = emb(ids)
        out.backward(torch.ones_like(out))
    emb.finish_table_step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = LEVConfig(compute_mode="table")
    emb = LEVEmbedding(a.vocab, a.hidden, cfg, init_statistics=False)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.micro_batch_tokens,), generator=g) for _ in range(a.micro_batches)]
    variants = {"one fp32 gradient buffer (index_add_)": emb._modes,
                "dense V x D gradient per micro-batch": DenseGradModes(a.vocab, cfg)}
    peaks = {name: [] for name in variants}
    grads = {}
    step(emb, batches)  # warm-up: allocator and first-touch
    emb.zero_grad(set_to_none=True)
    for _ in range(a.repeats):
        for name, modes in variants.items():
            emb._modes = modes
            with PeakMemory("cpu") as mem:
                step(emb, batches)
            peaks[name].append(mem.mib)
            grads[name] = [p.grad.clone() for p in emb.parameters()]
            emb.zero_grad(set_to_none=True)
    (n0, g0), (n1, g1) = grads.items()
    same = all(torch.equal(x, y) for x, y in zip(g0, g1))
    vxd = a.vocab * a.hidden * 4 / 2**20
    print(f"LEV table step, V={a.vocab}, D={a.hidden}, {a.micro_batches} micro-batches of {a.micro_batch_tokens} "
          f"ids, fp32, torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print(f"V x D x 4 bytes = {vxd:.0f} MiB")
    for name, v in peaks.items():
        print(f"  {name}: step peak {statistics.median(v):.0f} MiB (median of {len(v)}: "
              f"{', '.join(f'{x:.0f}' for x in v)})")
    saved = statistics.median(peaks[n1]) - statistics.median(peaks[n0])
    print(f"  saved: {saved:.0f} MiB = {saved / vxd:.2f} x (V x D x 4 bytes); parameter gradients "
          f"{'bit-identical' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
