#!/usr/bin/env python
"""tokens/s of tools/preprocess_data.py on the shared train corpus with GPT-2 BPE, 1 and 2 workers.

Times whole processes (start-up included, as the reference figures are), checks that both runs
write exactly 21,619,185 tokens and byte-identical .bin/.idx, and prints the ratio to Megatron-LM's
tools/preprocess_data.py. With --megatron-lm PATH (a Megatron-LM checkout, tag core_v0.16.1) that tool is
timed here on the same data (decompressed to plain .jsonl, which is all it reads, with
--legacy-tokenizer); otherwise the reference is the figure from ../shared/notes/preprocessing-anchor.md,
labelled as not re-measured.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")
EXPECTED_TOKENS = 21_619_185
# ../shared/notes/preprocessing-anchor.md: Megatron-LM tools/preprocess_data.py, same file/tokenizer/machine kind
ANCHOR = {1: 240_000, 2: 490_000}


def run(cmd, env=None):
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}")
    return wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", default=os.path.join(SHARED, "corpus", "train.jsonl.zst"))
    p.add_argument("--tokenizer-dir", default=os.path.join(SHARED, "tokenizers", "gpt2"))
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=1, help="runs per setting; the best is kept")
    p.add_argument("--megatron-lm", default=None, help="Megatron-LM checkout to time beside this tool")
    p.add_argument("--keep", default=None, help="keep outputs in this directory")
    a = p.parse_args()
    vocab, merges = os.path.join(a.tokenizer_dir, "vocab.json"), os.path.join(a.tokenizer_dir, "merges.txt")
    for f in (a.input, vocab, merges):
        if not os.path.exists(f):
            sys.exit(f"missing {f}")
    out = a.keep or tempfile.mkdtemp(prefix="bench_pp_")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    ours, load = {}, {}
    for w in a.workers:
        best = None
        for _ in range(a.repeats):
            load1 = os.getloadavg()[0]  # others' jobs on this machine skew wall times; reported with each figure
            wall = run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", a.input,
                        "--output-prefix", os.path.join(out, f"w{w}"), "--tokenizer-type", "GPT2BPETokenizer",
                        "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", str(w),
                        "--overwrite", "--no-progress-bar", "--log-interval", "0"], env)
            if best is None or wall < best:
                best, load[w] = wall, load1
        ours[w] = best

    sys.path.insert(0, REPO)
    from megatron_lev.data.indexed import read_index_info

    tokens = {w: read_index_info(os.path.join(out, f"w{w}_text_document.idx")).num_tokens for w in ours}
    files = [open(os.path.join(out, f"w{w}_text_document{e}"), "rb").read() for w in ours for e in (".bin", ".idx")]
    identical = all(files[i] == files[i % 2] for i in range(len(files)))

    ref, ref_label = dict(ANCHOR), "Megatron-LM (anchor notes, not re-measured)"
    if a.megatron_lm:
        import zstandard

        plain = os.path.join(out, "train.jsonl")
        with open(a.input, "rb") as fi, open(plain, "wb") as fo:
            zstandard.ZstdDecompressor().copy_stream(fi, fo)
        ref_label = "Megatron-LM (measured here)"
        for w in ours:
            wall = run([sys.executable, os.path.join(a.megatron_lm, "tools", "preprocess_data.py"), "--input", plain,
                        "--output-prefix", os.path.join(out, f"mlm{w}"), "--tokenizer-type", "GPT2BPETokenizer",
                        "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", str(w),
                        "--legacy-tokenizer"], dict(env, PYTHONPATH=a.megatron_lm))
            ref[w] = EXPECTED_TOKENS / wall
            mlm = os.path.join(out, f"mlm{w}_text_document")
            same = all(open(mlm + e, "rb").read() == open(os.path.join(out, f"w{w}_text_document{e}"), "rb").read()
                       for e in (".bin", ".idx"))
            print(f"Megatron-LM {w} worker(s): {wall:.1f} s; output byte-identical to ours: {same}")

    print(f"input {os.path.relpath(a.input, REPO)} (relative to the repository); GPT-2 BPE; --append-eod; whole-process wall time incl. start-up")
    print(f"{'workers':>7} {'wall s':>7} {'tokens':>12} {'tokens/s':>11} {'ref tok/s':>10} {'ratio':>6} {'load1':>6}")
    for w, wall in ours.items():
        tps = tokens[w] / wall
        print(f"{w:>7} {wall:>7.2f} {tokens[w]:>12,} {tps:>11,.0f} {ref.get(w, float('nan')):>10,.0f} "
              f"{tps / ref.get(w, float('nan')):>6.1f}x {load[w]:>6.2f}")
    print(f"reference: {ref_label}; target >= 6x; load1 = 1-minute load average before the run ({os.cpu_count()} CPUs)")
    print(f"token count {'OK' if all(t == EXPECTED_TOKENS for t in tokens.values()) else 'WRONG'} "
          f"(expected {EXPECTED_TOKENS:,}); outputs byte-identical across worker counts: {identical}")
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if identical and all(t == EXPECTED_TOKENS for t in tokens.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
