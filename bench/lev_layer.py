"""LEV layer benchmark: forward+backward time and extra peak memory of each compute mode.

Measured in one run, against megatron-core's ``VocabParallelEmbedding`` on the same ids and a tied
GPT model's full training step (forward+backward of one micro-batch) of the same shape:

    python bench/lev_layer.py                      # V=50,257, D=512, batch 8 x 512 (CPU default)
    python bench/lev_layer.py --quick              # a smaller shape, for a smoke run
    python bench/lev_layer.py --batch 16 --seq 2048 --hidden 2048 --device cuda   # any shape on GPU
    python bench/lev_layer.py --device cuda --kernel-only   # only the fused-kernel table (below)
    python bench/lev_layer.py --compile-report     # registers/spills of the kernels for sm_90, sm_80 (no GPU)

Fused kernel (``--device cuda``): forward and backward time per 1,000 distinct ids of the whole layer
G (seed, coordinates, product, projection) at the paper's defaults (d_s=128, h=8, kappa=16, r=64) for
D in {1024, 2048} and N in {4k, 16k, 64k} ids, with the Triton kernel and with the eager path (sparse
basis), beside a ``VocabParallelEmbedding`` of the same V x D on the same ids, and against the
published anchor of a fused LEV kernel (about 1.1 ms forward and 3.0 ms backward for 4,096 ids at
D=2048 on an RTX 5070 Ti). On a machine without CUDA the report says that no GPU figure exists.

Compile report (``--compile-report``, any machine with triton): the forward and backward kernels
compiled ahead of time for sm_90 and sm_80 at the paper's defaults (bf16 and fp32 Delta) and r = 128,
with the layer's launch options, one line each with ptxas's registers, spill (bytes per thread) and
the shared memory per program (``megatron_lev.kernels.lev_triton.compile_report``).

Ids: real text (the shared corpus tokenised with GPT-2) when available, so the number of distinct
ids per micro-batch is realistic; otherwise a fixed-seed Zipf sample. Peak memory on CPU is the
process's peak RSS above its level before the measured call (Linux ``clear_refs``); on CUDA,
``torch.cuda.max_memory_allocated``. Ratios are against the baselines measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _ids(vocab: int, batch: int, seq: int, shared: Path) -> tuple[torch.Tensor, str]:
    corpus = shared / "corpus" / "valid.jsonl.zst"
    gpt2 = shared / "tokenizers" / "gpt2"
    if vocab == 50257 and corpus.exists() and gpt2.exists():
        from megatron_lev.jsonl import iter_json_docs
        from megatron_lev.tokenizer import build_tokenizer

        tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(gpt2 / "vocab.json"),
                              merge_file=str(gpt2 / "merges.txt"))
        ids: list[int] = []
        for doc in iter_json_docs([str(corpus)]):
            ids.extend(tok.tokenize(doc) + [tok.eod])
            if len(ids) >= batch * seq:
                break
        if len(ids) >= batch * seq:
            return torch.tensor(ids[: batch * seq]).view(batch, seq), "GPT-2 tokens of the shared valid corpus"
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = 1.0 / ranks
    ids = torch.multinomial(probs / probs.sum(), batch * seq, replacement=True, generator=g)
    perm = torch.randperm(vocab, generator=g)
    return perm[ids].view(batch, seq), "Zipf(1) sample"


class PeakMemory:
    """Peak memory above the starting level during the block, in MiB."""

    def __init__(self, device: str):
        self.device = device
        self.mib = float("nan")

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            except OSError:
                pass
            self.start = self._status("VmRSS:")
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = self._status("VmHWM:")
        self.mib = (peak - self.start) / 2**20


def _time(fn, device: str, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


KERNEL_HIDDEN = (1024, 2048)
KERNEL_IDS = (4096, 16384, 65536)
ANCHOR_MS_PER_1K = (1.1 / 4.096, 3.0 / 4.096)  # (forward, backward) per 1,000 ids, D=2048, RTX 5070 Ti


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_fwd_bwd(fn, up, device: str, repeats: int, warmup: int = 1) -> tuple[float, float]:
    """Median forward and backward seconds of ``fn()`` (synchronised around each half on CUDA)."""
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        t1 = time.perf_counter()
        out.backward(up)
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def kernel_table(vocab: int, dtype, repeats: int, tcfg_for, hidden=KERNEL_HIDDEN, n_ids=KERNEL_IDS,
                 device: str = "cuda", lev_kw: Optional[dict] = None) -> dict:
    """The fused-kernel timings (see the module doc), each row per 1,000 ids. ``lev_kw`` overrides the
    paper's defaults and ``device`` may be "cpu" with TRITON_INTERPRET=1 (the tests' small shapes)."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from megatron_lev.kernels import register_default_kernels
    from megatron_lev.lev import LEVConfig, LEVEmbedding
    from megatron_lev.lev.functional import has_fused_product

    register_default_kernels()
    if not has_fused_product(device, "triton"):
        return {"rows": [], "note": "the Triton kernel is not available (pip install triton)"}
    rows = []
    for D in hidden:
        emb = VocabParallelEmbedding(vocab, D, init_method=torch.nn.init.normal_, config=tcfg_for(D)).to(device)
        layers = {b: LEVEmbedding(vocab, D, LEVConfig(basis=b, compute_mode="token", **(lev_kw or {})),
                                  init_statistics=False, device=device, dtype=dtype) for b in ("triton", "sparse")}
        for n in n_ids:
            ids = torch.randperm(vocab, device=device)[: min(n, vocab)]
            if ids.numel() < n:  # more ids than the vocabulary: repeat (each is still evaluated, token mode)
                ids = ids.repeat(-(-n // ids.numel()))[:n]
            up = torch.randn(n, D, device=device, dtype=dtype)
            row = {"hidden": D, "ids": n}
            for name, layer in layers.items():
                f, b = _time_fwd_bwd(lambda layer=layer: layer.compute(ids), up, device, repeats)
                row[f"{name}_fwd_ms_per_1k"], row[f"{name}_bwd_ms_per_1k"] = 1e6 * f / n, 1e6 * b / n
                layer.zero_grad(set_to_none=True)
            f, b = _time_fwd_bwd(lambda: emb(ids.view(1, -1)).view(n, D), up, device, repeats)
            row["table_fwd_ms_per_1k"], row["table_bwd_ms_per_1k"] = 1e6 * f / n, 1e6 * b / n
            emb.zero_grad(set_to_none=True)
            row["speedup_vs_eager"] = ((row["sparse_fwd_ms_per_1k"] + row["sparse_bwd_ms_per_1k"])
                                       / (row["triton_fwd_ms_per_1k"] + row["triton_bwd_ms_per_1k"]))
            rows.append(row)
        del emb, layers
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (Triton interpreter)"
    return {"rows": rows, "anchor_ms_per_1k": list(ANCHOR_MS_PER_1K), "gpu": where}


def _init_parallel(device: str):
    """Megatron's (single-rank) groups for VocabParallelEmbedding; returns the setup to destroy."""
    from megatron_lev.distributed import init_distributed

    return init_distributed(backend="nccl" if device == "cuda" else "gloo", seed=1234)


def _reexec_with_returning_malloc() -> None:
    """Large CPU allocations through mmap, returned to the OS on free, so peak RSS tracks live tensors
    (glibc would otherwise keep freed memory and hide every peak after the first call)."""
    if torch.cuda.is_available() or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="layers of the tied model whose step is the yardstick")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--modes", default="token,unique,table")
    p.add_argument("--quick", action="store_true", help="V=8192, D=256, batch 4 x 256")
    p.add_argument("--shared-data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--kernel-only", action="store_true", help="only the fused-kernel table (--device cuda)")
    p.add_argument("--kernel-hidden", default=",".join(map(str, KERNEL_HIDDEN)), help="D values of the kernel table")
    p.add_argument("--kernel-ids", default=",".join(map(str, KERNEL_IDS)), help="N values of the kernel table")
    p.add_argument("--compile-report", action="store_true",
                   help="compile the Triton kernels for sm_90 and sm_80 and print registers/spills (no GPU needed)")
    args = p.parse_args(argv)
    if args.compile_report:
        return compile_report(args.json)
    if args.quick:
        args.vocab, args.hidden, args.batch, args.seq, args.layers = 8192, 256, 4, 256, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine; use --device cpu")

    _init_parallel(args.device)
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, args.dtype)

    def tcfg_for(hidden):
        return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8,
                                 use_cpu_initialization=True, params_dtype=dtype)

    if args.device == "cuda":
        kernel = kernel_table(args.vocab, dtype, args.repeats, tcfg_for,
                              hidden=[int(v) for v in args.kernel_hidden.split(",")],
                              n_ids=[int(v) for v in args.kernel_ids.split(",")])
    else:
        kernel = {"rows": [], "note": "no GPU figure exists: this run had no CUDA device (--device cpu); "
                                      "run python bench/lev_layer.py --device cuda on a GPU"}
    if args.kernel_only:
        results = {"vocab": args.vocab, "device": args.device, "dtype": args.dtype, "kernel": kernel}
        _report_kernel(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return results

    from megatron_lev.lev import LEVConfig
    from megatron_lev.models import LevModelConfig, build_gpt_model, build_transformer_config
    from megatron_lev.parallel.lev_embedding import LEVParallelEmbedding

    dev = torch.device(args.device)
    ids, ids_source = _ids(args.vocab, args.batch, args.seq, Path(args.shared_data))
    ids = ids.to(dev)
    n_unique = int(torch.unique(ids).numel())
    tcfg = tcfg_for(args.hidden)
    results: dict = {"shape": dict(vocab=args.vocab, hidden=args.hidden, batch=args.batch, seq=args.seq),
                     "ids": ids_source, "unique_ids": n_unique, "device": args.device, "dtype": args.dtype,
                     "threads": torch.get_num_threads(), "torch": torch.__version__, "modes": {},
                     "vocab": args.vocab, "kernel": kernel}

    def fwd_bwd(module, up):
        def run():
            module.zero_grad(set_to_none=True)
            out = module(ids)
            out.backward(up)
        return run

    # Baseline 1: megatron's dense embedding table, same ids.
    table = VocabParallelEmbedding(args.vocab, args.hidden, init_method=torch.nn.init.normal_,
                                   config=tcfg).to(dev)
    up_bsd = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=dtype)
    with PeakMemory(args.device) as mem:
        t_table = _time(fwd_bwd(table, up_bsd), args.device, args.repeats)
    results["vocab_parallel_embedding"] = {"ms": t_table * 1e3, "peak_extra_mib": mem.mib}
    del table

    # Baseline 2: a tied GPT model's full training step (one micro-batch, forward+backward).
    mcfg = LevModelConfig(vocab_size=args.vocab, max_sequence_length=args.seq, input_embedding="tied",
                          position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                          add_bias_linear=False)  # Llama-style, as bench/throughput.py
    gcfg = build_transformer_config(mcfg, num_layers=args.layers, hidden_size=args.hidden,
                                    num_attention_heads=max(1, args.hidden // 64), params_dtype=dtype,
                                    bf16=dtype == torch.bfloat16)
    model = build_gpt_model(config=gcfg, model_config=mcfg).to(dev)
    labels = torch.roll(ids, -1, 1)
    pos = torch.arange(args.seq, device=dev).unsqueeze(0).expand(args.batch, -1)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, pos, attention_mask=None, labels=labels).float().mean()
        loss.backward()

    t_step = _time(step, args.device, max(1, args.repeats - 1))
    results["tied_step"] = {"ms": t_step * 1e3, "layers": args.layers}
    del model

    up_sbd = up_bsd.transpose(0, 1).contiguous()
    for mode in args.modes.split(","):
        lev = LEVParallelEmbedding(config=tcfg, lev_config=LEVConfig(compute_mode=mode), vocab_size=args.vocab,
                                   init_statistics=False).to(dev)
        entry: dict = {}
        if mode == "table":
            # Per optimizer step: one evaluation over all V ids + one backward over the ids seen;
            # per micro-batch: a gather and its backward.
            with PeakMemory(args.device) as mem:
                t_begin = _time(lev.begin_table_step, args.device, 1, warmup=0)

                def micro():
                    out = lev(ids)
                    out.backward(up_sbd)

                t_micro = _time(micro, args.device, args.repeats)
                t_finish = _time(lev.finish_table_step, args.device, 1, warmup=0)
            per_step_fixed = t_begin + t_finish
            entry.update(begin_ms=t_begin * 1e3, finish_ms=t_finish * 1e3, per_microbatch_ms=t_micro * 1e3,
                         peak_extra_mib=mem.mib)
        else:
            with PeakMemory(args.device) as mem:
                t = _time(fwd_bwd(lev, up_sbd), args.device, args.repeats)
            entry.update(ms=t * 1e3, peak_extra_mib=mem.mib, vs_table_embedding=t / t_table,
                         share_of_tied_step=t / t_step)
        results["modes"][mode] = entry
        del lev

    # Memory scaling: extra peak of one unique-mode forward+backward at two numbers of distinct ids.
    # A layer that held phi would grow by h*d_s*r*4 bytes per id (256 KiB at the defaults).
    lev = LEVParallelEmbedding(config=tcfg, lev_config=LEVConfig(compute_mode="unique"), vocab_size=args.vocab,
                               init_statistics=False).to(dev)
    lc = lev.lev_config
    scaling = {}
    for n in (min(1024, args.vocab // 4), min(4096, args.vocab)):
        uniq = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(n))[:n].to(dev).view(1, n)
        up = torch.randn(n, 1, args.hidden, device=dev, dtype=dtype)
        for _ in range(2):  # the first call compiles/warms up; measure the second
            lev.zero_grad(set_to_none=True)
            with PeakMemory(args.device) as mem:
                lev(uniq).backward(up)
        scaling[n] = mem.mib
    (n1, m1), (n2, m2) = sorted(scaling.items())
    results["memory_scaling"] = {
        "ids": [n1, n2], "peak_extra_mib": [m1, m2],
        "kib_per_id": (m2 - m1) * 1024 / (n2 - n1),
        "phi_kib_per_id": lc.num_heads * lc.seed_dim * lc.rank * 4 / 1024,
    }
    del lev

    # When does "table" beat "unique"? table costs F + m * g per step, unique m * u.
    if "table" in results["modes"] and "unique" in results["modes"]:
        tab, uni = results["modes"]["table"], results["modes"]["unique"]
        fixed = tab["begin_ms"] + tab["finish_ms"]
        gain = uni["ms"] - tab["per_microbatch_ms"]
        tab["breakeven_microbatches"] = (fixed / gain) if gain > 0 else float("inf")

    _report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def compile_report(json_path: Optional[str] = None) -> dict:
    """Print ``lev_triton.compile_report()``'s lines (and write them to ``json_path``)."""
    import dataclasses

    # Compilation needs the kernels built for the compiler, not for Triton's CPU interpreter.
    os.environ.pop("TRITON_INTERPRET", None)
    from megatron_lev.kernels import lev_triton

    try:
        records = lev_triton.compile_report()
    except RuntimeError as e:
        raise SystemExit(f"bench/lev_layer.py --compile-report: {e}")
    import triton

    print(f"LEV Triton kernels compiled ahead of time (Triton {triton.__version__}; spill and stack in bytes "
          f"per thread, shared memory per program):")
    for rec in records:
        print("  " + rec.line())
    results = {"triton": triton.__version__, "compile_report": [dataclasses.asdict(r) for r in records]}
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    return results


def _report_kernel(r: dict) -> None:
    k = r["kernel"]
    if not k["rows"]:
        print(f"  fused LEV kernel (Triton): {k['note']}")
        return
    fa, ba = k["anchor_ms_per_1k"]
    print(f"  fused LEV kernel (Triton) on {k['gpu']}, {r['dtype']}, defaults d_s=128 h=8 kappa=16 r=64; "
          f"ms per 1,000 ids (forward / backward); VocabParallelEmbedding of {r['vocab']:,} x D; "
          f"anchor {fa:.2f} / {ba:.2f} (D=2048, RTX 5070 Ti)")
    print("       D      ids |   triton fwd/bwd |    eager fwd/bwd | speed-up | table fwd/bwd | vs anchor")
    for x in k["rows"]:
        anchor = (x["triton_fwd_ms_per_1k"] + x["triton_bwd_ms_per_1k"]) / (fa + ba)
        print(f"  {x['hidden']:6d} {x['ids']:8,d} | {x['triton_fwd_ms_per_1k']:7.3f} / {x['triton_bwd_ms_per_1k']:7.3f}"
              f" | {x['sparse_fwd_ms_per_1k']:7.3f} / {x['sparse_bwd_ms_per_1k']:7.3f} | {x['speedup_vs_eager']:7.1f}x"
              f" | {x['table_fwd_ms_per_1k']:6.3f} / {x['table_bwd_ms_per_1k']:6.3f} | {anchor:5.2f}x the anchor's time")


def _report(r: dict) -> None:
    s = r["shape"]
    print(f"LEV layer benchmark: V={s['vocab']:,} D={s['hidden']} batch {s['batch']} x {s['seq']} "
          f"({r['unique_ids']} distinct ids; {r['ids']}), {r['device']} {r['dtype']}, "
          f"{r['threads']} threads, torch {r['torch']}")
    e = r["vocab_parallel_embedding"]
    print(f"  VocabParallelEmbedding fwd+bwd : {e['ms']:9.1f} ms   peak +{e['peak_extra_mib']:.0f} MiB")
    print(f"  tied GPT step ({r['tied_step']['layers']} layers) fwd+bwd: {r['tied_step']['ms']:9.1f} ms")
    ms = r.get("memory_scaling")
    if ms:
        print(f"  memory: unique fwd+bwd peak +{ms['peak_extra_mib'][0]:.0f} MiB at {ms['ids'][0]} ids, "
              f"+{ms['peak_extra_mib'][1]:.0f} MiB at {ms['ids'][1]} ids -> {ms['kib_per_id']:.1f} KiB per id "
              f"(holding phi would take {ms['phi_kib_per_id']:.0f} KiB per id)")
    for mode, m in r["modes"].items():
        if mode == "table":
            print(f"  LEV table: per step begin {m['begin_ms']:.0f} ms + finish {m['finish_ms']:.0f} ms, "
                  f"per micro-batch {m['per_microbatch_ms']:.1f} ms, peak +{m['peak_extra_mib']:.0f} MiB; "
                  f"beats unique above {m.get('breakeven_microbatches', float('nan')):.1f} micro-batches/step")
        else:
            print(f"  LEV {mode:6s} fwd+bwd : {m['ms']:9.1f} ms = {m['vs_table_embedding']:6.1f}x the table, "
                  f"{100 * m['share_of_tied_step']:5.1f}% of the tied step; peak +{m['peak_extra_mib']:.0f} MiB")
    _report_kernel(r)


if __name__ == "__main__":
    _reexec_with_returning_malloc()
    main()
