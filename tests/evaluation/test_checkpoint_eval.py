"""Evaluation of a tiny trained megatron-lev checkpoint: the scorer's perplexity equals exp(mean NLL)
of the model's own per-token loss; tools/evaluate.py gives the same numbers at TP=1 (one process),
PP=2 (two gloo ranks) and TP=2 (torchrun); result files, tables and plots are written; the same
evaluation on the Hugging Face export agrees (when the exporter is available).

Launches are grouped: one training run (session fixture), one 1-rank and one 2-rank
``run_distributed`` call, one torchrun.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_lev.testing import run_distributed
from tests.evaluation.conftest import REPO, torchrun

pytestmark = pytest.mark.slow  # a training run and four evaluation launches


def eval_flags(tiny, task_files, out_dir):
    return ["--load", tiny["dir"], "--valid-data", tiny["prefix"], "--max-tokens", "1200",
            "--zeroshot-data", tiny["zeroshot"], "--max-documents", "4",
            "--stride", "48", "--token-counts", tiny["counts"], "--tasks", "all",
            "--downstream-dir", task_files.dir, "--limit", "4", "--micro-batch-size", "4",
            "--output-dir", str(out_dir), "--no-progress"]


def _rank_direct_and_cli(tiny, flags):
    """TP=1: scorer vs the model's per-token loss; then the CLI in this process."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lev.evaluation import evaluate_perplexity
    from megatron_lev.evaluation.cli import main
    from megatron_lev.evaluation.megatron_scorer import MegatronScorer

    scorer, saved, info = MegatronScorer.from_checkpoint(tiny["dir"], micro_batch_size=3)
    model = scorer.model[0]
    ds = IndexedDataset(tiny["prefix"], multimodal=False, mmap=True)
    docs = [np.asarray(ds[i][:n], dtype=np.int64) for i, n in zip(range(4), (40, 70, 5, 33))]
    eod = tiny["eod"]
    stream = np.concatenate([[eod]] + docs)
    seq = saved.data.seq_length
    losses = []
    with torch.no_grad():
        for s in range(0, len(stream) - 1, seq):
            w = torch.as_tensor(stream[s:s + seq + 1])[None]
            pos = torch.arange(w.shape[1] - 1)[None]
            losses.append(model(w[:, :-1], pos, None, labels=w[:, 1:])[0].double())
    direct = torch.cat(losses)
    res = evaluate_perplexity(scorer, iter([(d, 0) for d in docs]), eod=eod, progress=False)
    # independent per-sequence check of the batched scorer (padding, sorting)
    seqs = [stream[:20], stream[5:70], stream[:2]]
    got = scorer.score(seqs)
    per_seq = []
    with torch.no_grad():
        for s in seqs:
            t = torch.as_tensor(s)[None]
            per_seq.append(model(t[:, :-1], torch.arange(len(s) - 1)[None], None, labels=t[:, 1:])[0].double().numpy())
    rc = main(flags)
    return {"direct_nll": direct.numpy(), "tokens": res.tokens, "nll": res.nll, "ppl": res.ppl,
            "scored": [-g.logprobs for g in got], "per_seq": per_seq, "rc": rc, "full": _full_disk_run(tiny),
            "progress": _progress_run(flags)}


def _progress_run(flags):
    """The CLI again on the valid set and two tasks, its progress shown with standard error not a terminal
    (--progress-interval 0: a line per batch): (exit code, stderr, output folder)."""
    import contextlib
    import io
    import tempfile

    from megatron_lev.evaluation.cli import main

    argv = [f for f in flags if f != "--no-progress"]
    out = tempfile.mkdtemp(prefix="eval-progress-")
    argv[argv.index("--output-dir") + 1] = out
    argv[argv.index("--tasks") + 1] = "lambada,hellaswag"
    i = argv.index("--zeroshot-data")
    del argv[i:i + 2]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv + ["--progress-interval", "0"])
    return rc, err.getvalue(), out


def _full_disk_run(tiny):
    """The CLI again, with the disk filling while it writes the per-token file: (exit code, stderr, files)."""
    import contextlib
    import errno
    import io
    import os
    import tempfile
    from unittest import mock

    from megatron_lev.evaluation.cli import main

    def full(path, **_arrays):
        with open(path, "wb") as f:
            f.write(b"PK\3\4 eight KiB")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # numpy's zip writer names no file

    out = tempfile.mkdtemp(prefix="eval-full-")
    err = io.StringIO()
    with mock.patch.object(np, "savez_compressed", full), contextlib.redirect_stderr(err):
        rc = main(["--load", tiny["dir"], "--valid-data", tiny["prefix"], "--max-tokens", "200",
                   "--output-dir", out, "--no-progress"])
    return rc, err.getvalue(), sorted(os.listdir(out)), out


def _rank_cli(flags):
    from megatron_lev.evaluation.cli import main

    return main(flags)


def _load(out_dir):
    return json.loads((out_dir / "results.json").read_text())


def _assert_same(a, b, rel=2e-5):
    for name in a["perplexity"]:
        pa, pb = a["perplexity"][name], b["perplexity"][name]
        assert pa["tokens"] == pb["tokens"] and pa["bytes"] == pb["bytes"], name
        assert pb["nll"] == pytest.approx(pa["nll"], rel=rel), name
        for x, y in zip(pa["frequency_buckets"], pb["frequency_buckets"]):
            assert x["tokens"] == y["tokens"]
            if x["tokens"]:
                assert y["nll"] == pytest.approx(x["nll"], rel=rel)
    for task in a["tasks"]:
        for m in ("acc", "acc_norm", "ppl"):
            if a["tasks"][task].get(m) is not None:
                assert b["tasks"][task][m] == pytest.approx(a["tasks"][task][m], rel=1e-4), (task, m)


@pytest.fixture(scope="module")
def tp1_run(tiny_ckpt, task_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_tp1")
    r = run_distributed(_rank_direct_and_cli, 1, args=(tiny_ckpt, eval_flags(tiny_ckpt, task_files, out)))[0]
    return r, out


def test_perplexity_equals_exp_mean_nll_of_the_model_loss(tp1_run):
    r, _ = tp1_run
    d = r["direct_nll"]
    assert r["tokens"] == len(d) == 40 + 70 + 5 + 33
    assert r["nll"] == pytest.approx(float(d.mean()), rel=1e-6)
    assert r["ppl"] == pytest.approx(math.exp(float(d.mean())), rel=1e-6)
    for got, ref in zip(r["scored"], r["per_seq"]):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_cli_results_files_and_buckets(tp1_run, tiny_ckpt):
    r, out = tp1_run
    assert r["rc"] == 0
    res = _load(out)
    meta = res["meta"]
    assert meta["checkpoint"] == tiny_ckpt["dir"] and meta["iteration"] == 6 and meta["tp"] == 1
    assert meta["config"]["input_embedding"] == "lev"
    for name in ("valid", "zeroshot"):
        p = res["perplexity"][name]
        assert p["tokens"] > 0 and p["ppl"] == pytest.approx(math.exp(p["nll"]))
        assert p["bits_per_byte"] == pytest.approx(p["nll"] * p["tokens"] / math.log(2) / p["bytes"])
        b = p["frequency_buckets"]
        assert len(b) == 5 and sum(x["tokens"] for x in b) == p["tokens"]  # the buckets partition the tokens
        assert sum(x["nll"] * x["tokens"] for x in b if x["tokens"]) == pytest.approx(p["nll"] * p["tokens"])
        per = np.load(out / f"{name}_per_token.npz")
        assert per["count_by_id"].sum() == p["tokens"]
    assert res["perplexity"]["valid"]["stride"] == 48 and res["perplexity"]["valid"]["seq_length"] == 64
    assert set(res["tasks"]) == {"lambada", "hellaswag", "piqa", "winogrande", "arc_easy", "arc_challenge"}
    assert all(t["examples"] == 4 for t in res["tasks"].values())
    for f in ("results.md", "freq_ppl.png", "tasks.png"):
        assert (out / f).stat().st_size > 100
    md = (out / "results.md").read_text()
    assert "| valid |" in md and "| hellaswag | 4 |" in md and "≥ 1e-4" in md


def test_progress_lines_name_each_evaluation_and_its_count_and_change_no_result(tp1_run):
    r, out = tp1_run
    rc, err, progress_out = r["progress"]
    assert rc == 0, err
    lines = err.splitlines()
    starts = [ln for ln in lines if ln.startswith("evaluating ")]
    assert [ln.split(":")[0] for ln in starts] == ["evaluating 1/3", "evaluating 2/3", "evaluating 3/3"], starts
    assert starts[0].startswith("evaluating 1/3: valid (perplexity of ") and starts[2].startswith("evaluating 3/3: hellaswag (")
    assert "\r" not in err  # no bar without a terminal
    windows = [int(ln.split()[1].replace(",", "")) for ln in lines if ln.startswith("valid: ")]
    assert len(windows) >= 2 and windows == sorted(set(windows)), windows  # a line per batch, counting up
    assert all(ln.endswith(" s)") and " windows (" in ln for ln in lines if ln.startswith("valid: "))
    # 4 examples each, in batches of 4 (--micro-batch-size 4); hellaswag's have 4 endings each.
    for task, counts in (("lambada", ["4/4"]), ("hellaswag", ["4/16", "8/16", "12/16", "16/16"])):
        assert [ln.split()[1] for ln in lines if ln.startswith(f"{task}: ") and " requests (" in ln] == counts, task
    # The results are those of the run without progress.
    a, b = _load(out), json.loads((Path(progress_out) / "results.json").read_text())
    strip = lambda entry: {k: v for k, v in entry.items() if k != "seconds"}  # noqa: E731
    assert strip(b["perplexity"]["valid"]) == strip(a["perplexity"]["valid"])
    assert {t: strip(v) for t, v in b["tasks"].items()} == {t: strip(a["tasks"][t]) for t in ("lambada", "hellaswag")}


def test_a_disk_that_fills_while_results_are_written_is_one_line_and_leaves_no_partial_file(tp1_run):
    rc, err, files, out = tp1_run[0]["full"]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]  # torch's load warnings aside
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: --output-dir {out}: no space left on the device while writing the results ("), lines
    assert lines[0].endswith("each result file there is whole or absent (the one under way was removed); free space "
                             "and run again"), lines
    assert files == [], files  # no truncated valid_per_token.npz, no partial name


def test_a_damaged_checkpoint_or_an_unwritable_output_dir_is_one_line_before_any_work(tiny_ckpt, tmp_path, capsys,
                                                                                      monkeypatch):
    import shutil

    from megatron_lev.evaluation import cli

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt["dir"], ck)
    it = ck / "iter_0000006"
    largest = max(it.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2:len(data) // 2 + 512] = bytes(512)  # 512 bytes zeroed, the size kept
    largest.write_bytes(bytes(data))
    flags = ["--valid-data", tiny_ckpt["prefix"], "--max-tokens", "200", "--no-progress"]
    assert cli.main(["--load", str(ck), "--output-dir", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {largest}: its bytes changed after the save (CRC32 differs"), err
    assert err[0].endswith(f"nothing was loaded); no complete older checkpoint under {ck}"), err
    assert not (tmp_path / "out").exists()

    def no_work(_args):
        raise AssertionError("the evaluation started before its --output-dir was checked")

    monkeypatch.setattr(cli, "check_inputs", no_work)
    for out in ("/proc/self/eval-out", str(largest / "out")):  # not writable: a kernel folder, under a file
        assert cli.main(["--load", tiny_ckpt["dir"], "--output-dir", out, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --output-dir {out}: cannot write in "), err
        assert err[0].endswith("; choose a writable directory"), err


def test_tp2_and_pp2_equal_tp1(tp1_run, tiny_ckpt, task_files, tmp_path):
    _, out1 = tp1_run
    ref = _load(out1)
    out_pp = tmp_path / "pp2"
    rcs = run_distributed(_rank_cli, 2, pp=2, args=(eval_flags(tiny_ckpt, task_files, out_pp)
                                                    + ["--pipeline-model-parallel-size", "2"],))
    assert rcs == [0, 0]
    _assert_same(ref, _load(out_pp))
    out_tp = tmp_path / "tp2"
    r = torchrun(2, REPO / "tools" / "evaluate.py", eval_flags(tiny_ckpt, task_files, out_tp)
                 + ["--tensor-model-parallel-size", "2"])
    assert r.stdout.count("valid:") == 1  # rank 0 prints
    tp2 = _load(out_tp)
    assert tp2["meta"]["tp"] == 2 and tp2["meta"]["world_size"] == 2
    _assert_same(ref, tp2)


def _rank_late_tracker(ck, flags, full_flags):
    """The evaluated --load is a training run's --save whose next save completes while the ranks start:
    rank 1 finds the newer iteration, rank 0 the older one. Every rank verifies and loads rank 0's."""
    import time

    import torch

    from megatron_lev.checkpoint.files import TRACKER
    from megatron_lev.evaluation.cli import main

    rank = torch.distributed.get_rank()
    if rank == 1:
        time.sleep(0.3)  # rank 0 has read the tracker by now
        with open(os.path.join(ck, TRACKER), "w") as f:
            f.write("7\n")
    late = main(["--load", ck, *flags])
    return late, _rank_full_disk(ck, full_flags)


def _rank_full_disk(ck, flags):
    """The disk fills while rank 0 writes the first set's per-token file: every rank stops with its line
    (none goes on into the next set's collectives without rank 0). (exit code, error lines)."""
    import contextlib
    import errno
    import io
    from unittest import mock

    import torch

    from megatron_lev.evaluation.cli import main

    def full(path, **_arrays):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    err = io.StringIO()
    on_rank0 = mock.patch.object(np, "savez_compressed", full)
    with on_rank0 if torch.distributed.get_rank() == 0 else contextlib.nullcontext(), contextlib.redirect_stderr(err):
        rc = main(["--load", ck, *flags])
    return rc, [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]


def test_two_ranks_evaluate_rank_0s_iteration_and_stop_together_on_a_full_disk(tiny_ckpt, tmp_path):
    from megatron_lev.checkpoint import checksums

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt["dir"], ck)
    newer = ck / "iter_0000007"
    shutil.copytree(ck / "iter_0000006", newer)
    names = sorted(checksums.read_manifest(str(newer)))
    # The same weights, a file of rank 1's share (names[1::2]) longer: intact against its own checksums,
    # damaged against iteration 6's.
    grown = max((n for n in names[1::2] if n.endswith(".distcp")), key=lambda n: (newer / n).stat().st_size)
    with open(newer / grown, "ab") as f:
        f.write(bytes(64))
    checksums.write_manifest(str(newer), checksums.hash_files(str(newer), names))
    out, full = tmp_path / "out", tmp_path / "full"
    flags = ["--valid-data", tiny_ckpt["prefix"], "--max-tokens", "200", "--no-progress"]
    (late0, full0), (late1, full1) = run_distributed(_rank_late_tracker, 2, args=(
        str(ck), flags + ["--output-dir", str(out)],
        flags + ["--zeroshot-data", tiny_ckpt["zeroshot"], "--max-documents", "2", "--output-dir", str(full)]))
    assert late0 == late1 == 0
    assert _load(out)["meta"]["iteration"] in (6, 7)  # rank 0's look, on time (6) or late (7)
    assert full0[0] == full1[0] == 2, (full0, full1)
    assert len(full0[1]) == 1 and full0[1][0].startswith(f"error: --output-dir {full}: no space left on the device"), full0
    assert full1[1] == []  # the first rank prints


def test_a_rank_that_cannot_reopen_rank_0s_iteration_sends_its_line_to_the_verification(monkeypatch):
    """A rank whose own look found another iteration than rank 0's reopens rank 0's; an I/O error there (the
    iteration removed or unreadable on its node) is its verdict for the checksum verification's all-gather,
    which stops every rank with it. Raised on that rank alone, it left the others waiting there."""
    from types import SimpleNamespace

    import megatron_lev.evaluation.cli as cli
    import megatron_lev.parallel.collectives as collectives

    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, src=0, group=None: 6)  # rank 0 found 6

    def unreadable(args, iteration=None):
        raise PermissionError(13, "Permission denied", f"{args.load}/iter_{iteration:07d}/config.yaml")

    monkeypatch.setattr(cli, "_checkpoint_tokenizer", unreadable)
    saved = SimpleNamespace(iteration=7)
    tokenizer, got, error = cli._rank0_checkpoint(SimpleNamespace(load="/ck"), "tok", saved)
    assert (tokenizer, got) == ("tok", saved)
    assert error.startswith("--load /ck: iteration 6 cannot be opened on this rank (PermissionError: ")
    assert "\n" not in error


def test_hf_export_gives_the_same_numbers(tp1_run, tiny_ckpt, task_files, tmp_path):
    import megatron_lev.conversion.hf as hf
    from megatron_lev import compat
    from megatron_lev.evaluation.cli import main

    # The in-process evaluations above left the CPU backend installed: a Hugging Face model is not built
    # under it (its rotary buffers would stay uninitialised, compat/cpu.py).
    compat.remove()
    _, out1 = tp1_run
    ref = _load(out1)
    export = tmp_path / "hf"
    hf.export_hf(tiny_ckpt["dir"], str(export), progress=False)
    out = tmp_path / "eval_hf"
    flags = eval_flags(tiny_ckpt, task_files, out)
    i = flags.index("--load")
    flags[i:i + 2] = ["--hf-model", str(export), "--device", "cpu"]
    assert main(flags) == 0
    _assert_same(ref, _load(out), rel=1e-4)
