"""Parallel layout and gradient communication: TP, PP, virtual stages, sequence parallelism, the
distributed optimizer and the DDP overlap flags, the process-group backend. The layout's rules are
``distributed.layout.ParallelLayout``'s (made by ``validate_args``)."""

from __future__ import annotations

from megatron_lev.config_flags import POSITIVE_INT


def add_parallel_flags(p) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=POSITIVE_INT, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=POSITIVE_INT, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=POSITIVE_INT, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=POSITIVE_INT, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=POSITIVE_INT, default=1,
                   help="context parallelism is not implemented here: only 1 is accepted")
    g.add_argument("--no-overlap-p2p-communication", action="store_true",
                   help="interleaved schedule: batched, non-overlapped p2p (default overlaps, as Megatron-LM)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=POSITIVE_INT, default=None)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--num-distributed-optimizer-instances", type=POSITIVE_INT, default=1,
                   help="copies of the distributed optimizer across the data-parallel group: only 1 here")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=POSITIVE_INT, default=10)
