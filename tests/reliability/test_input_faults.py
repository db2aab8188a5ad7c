"""Fault injection on inputs and outputs, in-process: truncated/corrupt compressed jsonl, unwritable
outputs and swapped tokenizer files for preprocessing; damaged .idx and a .bin changed after its
token counts for training; resume/overwrite refusals; export folder hygiene; ranks that die before
reporting. Each case: one error line naming the file and the fix, the right exit code, and nothing
written under final names. All data is made here (NullTokenizer: text is whitespace-separated ids).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import struct

import numpy as np
import pytest
import zstandard

from tools.preprocess_data import main as preprocess_main

DOCS = 60


def _lines(n=DOCS):
    return [json.dumps({"text": " ".join(str((i * 7 + j) % 500) for j in range(40))}) + "\n" for i in range(n)]


def _blob():
    return "".join(_lines()).encode()


def _zstd_frames(data, frame_bytes):
    """Several zstd frames of ``frame_bytes`` input bytes each (not aligned with lines, as pzstd writes)."""
    c = zstandard.ZstdCompressor()
    return [c.compress(data[i:i + frame_bytes]) for i in range(0, len(data), frame_bytes)]


def _run(tmp_path, capsys, src, *extra):
    prefix = tmp_path / "out" / "ds"
    code = preprocess_main(["--input", str(src), "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "1000", "--no-progress-bar", "--output-token-counts", *map(str, extra)])
    err = capsys.readouterr().err
    written = sorted(p.name for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").is_dir() else []
    return code, [ln for ln in err.splitlines() if ln.startswith("error:")], err, written


def _damaged_inputs(tmp_path):
    blob = _blob()
    frames = _zstd_frames(blob, 1500)
    single = zstandard.ZstdCompressor().compress(blob)
    gz = gzip.compress(blob)
    corrupt = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(blob))  # as the zstd CLI writes
    corrupt[len(corrupt) // 2: len(corrupt) // 2 + 8] = b"\xff" * 8
    cases = {
        "mid-frame.jsonl.zst": (single[: len(single) // 2], "ends inside a zstd frame"),
        "frame-boundary.jsonl.zst": (b"".join(frames[:3]), "is cut off"),
        "corrupt.jsonl.zst": (bytes(corrupt), "corrupt zstd data"),
        "truncated.jsonl.gz": (gz[: len(gz) // 2], "damaged gzip data"),
    }
    for name, (data, _) in cases.items():
        (tmp_path / name).write_bytes(data)
    return {tmp_path / name: what for name, (_, what) in cases.items()}


def test_truncated_or_corrupt_compressed_input_is_one_line_exit_1_and_writes_nothing(tmp_path, capsys):
    for path, what in _damaged_inputs(tmp_path).items():
        code, errors, err, written = _run(tmp_path, capsys, path)
        assert code == 1, (path.name, err)
        assert len(errors) == 1 and str(path) in errors[0] and what in errors[0], (path.name, errors)
        assert "complete lines read" in errors[0] and "--allow-truncated-input" in errors[0]
        assert "Traceback" not in err
        assert written == [], (path.name, written)  # neither final nor .partial files


def test_allow_truncated_input_keeps_the_complete_lines_and_says_so(tmp_path, capsys):
    frames = _zstd_frames(_blob(), 1500)
    src = tmp_path / "cut.jsonl.zst"
    src.write_bytes(b"".join(frames[:3]))
    complete = _blob()[:4500].count(b"\n")  # three frames of 1500 input bytes
    code, errors, err, written = _run(tmp_path, capsys, src, "--allow-truncated-input")
    assert code == 0 and errors == [], err
    assert f"docs={complete:,}" in err and f"{complete} complete lines read" in err
    assert any(ln.startswith("warning:") and str(src) in ln for ln in err.splitlines())
    assert "ds_text_document.bin" in written


def test_multi_frame_zstd_is_read_to_the_end(tmp_path, capsys):
    src = tmp_path / "frames.jsonl.zst"
    src.write_bytes(b"".join(_zstd_frames(_blob(), 1500)))
    code, errors, err, _ = _run(tmp_path, capsys, src)
    assert code == 0 and f"docs={DOCS:,}" in err, err


def test_unwritable_output_fails_before_reading_any_input(tmp_path, capsys):
    damaged = next(iter(_damaged_inputs(tmp_path)))  # would fail with exit 1 if it were read first
    (tmp_path / "afile").write_text("x")
    for prefix in (tmp_path / "afile" / "ds", "/proc/self/ds"):
        code = preprocess_main(["--input", str(damaged), "--output-prefix", str(prefix), "--tokenizer-type",
                                "NullTokenizer", "--vocab-size", "1000", "--no-progress-bar"])
        err = capsys.readouterr().err
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --output-prefix {prefix}: cannot write in"), err


def test_swapped_gpt2_files_name_the_file(tmp_path, capsys):
    from megatron_lev.tokenizer import build_tokenizer

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    merges.write_text("#version: 0.2\na b\n")
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ab"}\n')
    code = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "o" / "ds"), "--tokenizer-type",
                            "GPT2BPETokenizer", "--vocab-file", str(merges), "--merge-file", str(vocab)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert str(vocab) in err[0] and "swapped" in err[0], err
    with pytest.raises(ValueError, match="--vocab-file .*merges.txt: not a JSON vocabulary"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(merges), merge_file=str(merges))
    # in the right order, but this vocab.json lacks the 256 byte tokens: one line, not tiktoken's bare assert
    with pytest.raises(ValueError, match="--vocab-file .*vocab.json and --merge-file .*merges.txt do not make one"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))


# ------------------------------------------------------------------------------------------ datasets


@pytest.fixture()
def dataset(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(_lines()))
    code, _, err, _ = _run(tmp_path, capsys, src)
    assert code == 0, err
    return str(tmp_path / "out" / "ds_text_document")


def _idx_layout(idx):
    data = open(idx, "rb").read()
    n_seq, n_doc = struct.unpack("<QQ", data[18:34])
    return 34, n_seq, n_doc  # lengths int32[n_seq], then pointers int64[n_seq], then document indices


def test_corrupt_idx_pointers_are_one_line(dataset):
    from megatron_lev.data.datasets import DatasetValidationError, validate_dataset_prefix

    idx = dataset + ".idx"
    start, n_seq, _ = _idx_layout(idx)
    ptr_at = start + 4 * n_seq
    with open(idx, "r+b") as f:
        f.seek(ptr_at + 8 * (n_seq - 1))  # the last sequence now points far past the end
        f.write(struct.pack("<q", 1 << 40))
    with pytest.raises(DatasetValidationError) as e:
        validate_dataset_prefix(dataset, 1001)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{idx}: corrupt index") and "past the end of the .bin" in msg


def test_bin_changed_after_its_token_counts_is_scanned(dataset):
    from megatron_lev.data.datasets import DatasetValidationError, validate_dataset_prefix
    from megatron_lev.data.preprocessing import token_counts_path

    counts, bin_ = token_counts_path(dataset), dataset + ".bin"
    validate_dataset_prefix(dataset, 1001)
    mm = np.memmap(bin_, dtype=np.uint16, mode="r+")
    mm[3] = 65535  # overwritten in place: the counts file still sums to the same total
    mm.flush()
    del mm
    t = os.stat(bin_).st_mtime_ns
    os.utime(counts, ns=(t - 10**9, t - 10**9))  # the counts were written before the change
    with pytest.raises(DatasetValidationError, match="holds token id 65535 >= the model's vocabulary size 1001"):
        validate_dataset_prefix(dataset, 1001)


# ---------------------------------------------------------------------------------- checkpoints


def _ns(**kw):
    base = dict(load=None, save=None, overwrite_checkpoints=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_save_over_another_run_and_bad_load_paths_are_refused(tmp_path):
    from megatron_lev.checkpoint import CheckpointError, check_save_and_load

    run = tmp_path / "run"
    (run / "iter_0000040").mkdir(parents=True)
    (run / "iter_0000040" / "metadata.json").write_text("{}")
    (run / "iter_0000040" / "config.yaml").write_text("{}\n")
    (run / "latest_checkpointed_iteration.txt").write_text("40\n")
    with pytest.raises(CheckpointError, match=r"latest iteration 40.*--overwrite-checkpoints"):
        check_save_and_load(_ns(save=str(run)))
    with pytest.raises(CheckpointError, match="--overwrite-checkpoints"):
        check_save_and_load(_ns(save=str(run), load=str(tmp_path / "other")))
    check_save_and_load(_ns(save=str(run), load=str(run)))  # a resume
    check_save_and_load(_ns(save=str(run), overwrite_checkpoints=True))
    with pytest.raises(CheckpointError, match=f"one checkpoint's folder; pass the directory above it \\(--load {run}\\)"):
        check_save_and_load(_ns(load=str(run / "iter_0000040")))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        check_save_and_load(_ns(load=str(junk)))
    check_save_and_load(_ns(load=str(junk), save=str(junk)))  # nothing to lose there: from scratch
    with pytest.raises(CheckpointError, match="not a directory"):
        check_save_and_load(_ns(load=str(junk / "notes.txt")))
    # First runs with --save X --load X: missing, empty, or only an unfinished first save -> fresh start.
    first = tmp_path / "first"
    check_save_and_load(_ns(load=str(first), save=str(first)))
    first.mkdir()
    check_save_and_load(_ns(load=str(first), save=str(first)))
    (first / "iter_0000002").mkdir()
    check_save_and_load(_ns(load=str(first), save=str(first)))


def _two_saves(root):
    """``root`` as a run saving at 2 and 4 leaves it: two complete, readable checkpoints, tracker 4."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    for it in (2, 4):
        d = root / f"iter_{it:07d}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled": a one-process save, as meant
            dcp.save({"w": torch.full((4,), float(it))}, checkpoint_id=str(d), no_dist=True)
        torch.save({"iteration": it}, d / "common.pt")
        (d / "metadata.json").write_text("{}")
        (d / "config.yaml").write_text("{}\n")
    (root / "latest_checkpointed_iteration.txt").write_text("4\n")


def test_a_missing_empty_bad_or_stale_tracker_never_leads_to_writing_over_complete_checkpoints(tmp_path):
    import shutil

    from megatron_lev.checkpoint import CheckpointError, check_save_and_load

    good = tmp_path / "good"
    _two_saves(good)
    ck, tracker, it2, it4 = tmp_path / "ck", tmp_path / "ck" / "latest_checkpointed_iteration.txt", \
        tmp_path / "ck" / "iter_0000002", tmp_path / "ck" / "iter_0000004"

    def case(change, **kw):
        """check_save_and_load on a fresh copy of ``good`` after ``change()``; the refusal's text or None."""
        shutil.rmtree(ck, ignore_errors=True)
        shutil.copytree(good, ck)
        change()
        try:
            check_save_and_load(_ns(**dict(dict(load=str(ck), save=str(ck)), **kw)))
        except CheckpointError as e:
            assert "\n" not in str(e), str(e)
            return str(e)
        return None

    newest = f"{it4} is a complete checkpoint (the newest there)"
    resume = f"resume from it with --load {ck} --ckpt-step 4"
    # Missing: resuming, and a run that only saves there.
    msg = case(lambda: tracker.unlink())
    assert msg is not None and msg.startswith(f"--load {ck}: no latest_checkpointed_iteration.txt") and newest in msg \
        and resume in msg, msg
    msg = case(lambda: tracker.unlink(), load=None)
    assert msg is not None and msg.startswith(f"--save {ck}: no latest") and newest in msg and resume in msg, msg
    msg = case(lambda: tracker.unlink(), load=str(tmp_path / "elsewhere"))
    assert msg is not None and newest in msg, msg
    # Empty, blank, negative (reported as a bad tracker, not as a missing iter_-000003), not a number.
    for text, what in (("", "empty"), ("\n  \n", "empty"), ("-3\n", "holds '-3', not an iteration number"),
                       ("four\n", "holds 'four', not an iteration number")):
        msg = case(lambda: tracker.write_text(text))
        assert msg == (f"{tracker}: {what} (a bad tracker; nothing was loaded); the newest complete checkpoint "
                       f"there is {it4}: resume from it with --ckpt-step 4"), msg
    # Stale: naming the older iteration, or an iteration that is not there (or no longer complete).
    msg = case(lambda: tracker.write_text("2\n"))
    assert msg == (f"--save {ck}: {tracker} names iteration 2 (stale), but {it4} is a newer complete checkpoint "
                   "that this run would write over; resume from it with --ckpt-step 4, or pass "
                   "--overwrite-checkpoints to replace it"), msg
    msg = case(lambda: tracker.write_text("6\n"))
    assert msg is not None and msg.startswith(f"{ck / 'iter_0000006'}: missing") and \
        msg.endswith(f"the newest complete older checkpoint is {it4}: resume from it with --ckpt-step 4"), msg
    msg = case(lambda: (it4 / "config.yaml").unlink())
    assert msg is not None and msg.startswith(f"{it4 / 'config.yaml'}: missing") and \
        msg.endswith(f"the newest complete older checkpoint is {it2}: resume from it with --ckpt-step 2"), msg
    # An older --ckpt-step or --finetune into the same folder would write over iteration 4 too.
    msg = case(lambda: None, ckpt_step=2)
    assert msg is not None and msg.startswith(f"--save {ck}: --ckpt-step 2 loads iteration 2, but {it4}"), msg
    msg = case(lambda: None, finetune=True)
    assert msg is not None and msg.startswith(f"--save {ck}: --finetune starts at iteration 0, but {it4}"), msg
    # The newest intact one is named; a damaged newer one is no reason to refuse going back.
    msg = case(lambda: (tracker.unlink(), (it4 / ".metadata").unlink()))
    assert msg is not None and f"{it2} is a complete checkpoint" in msg and "--ckpt-step 2" in msg, msg
    assert case(lambda: (it4 / ".metadata").unlink(), ckpt_step=2) is None
    # Accepted: the newest, asked for; the same with the tracker gone; explicit overwrites; a resume.
    assert case(lambda: None) is None
    assert case(lambda: None, ckpt_step=4) is None
    assert case(lambda: tracker.unlink(), ckpt_step=4) is None
    assert case(lambda: tracker.unlink(), overwrite_checkpoints=True) is None
    assert case(lambda: tracker.write_text("2\n"), overwrite_checkpoints=True) is None
    assert case(lambda: None, ckpt_step=2, overwrite_checkpoints=True) is None
    # Only unfinished saves (no metadata.json/config.yaml) and no tracker: a first run, from scratch.
    assert case(lambda: (tracker.unlink(), (it2 / "metadata.json").unlink(), (it4 / "config.yaml").unlink())) is None


def test_training_start_up_applies_the_refusal(tmp_path):
    from megatron_lev.training.loop import _setup_configs, _StartupError

    run = tmp_path / "run"
    run.mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("40\n")
    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64",
            "--save", str(run)]
    with pytest.raises(_StartupError, match="holds another run's checkpoints"):
        _setup_configs(argv)


def test_scheduler_and_tp_mismatch_messages():
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_lev.checkpoint.sharded import _structure_mismatch, scheduler_mismatch_message

    def sched(lr, wd_steps):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=0.0, lr_warmup_steps=0,
                                       lr_decay_steps=10, lr_decay_style="constant", start_wd=0.1, end_wd=0.1,
                                       wd_incr_steps=wd_steps, wd_incr_style="constant",
                                       use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)

    for (lr, steps), flag in (((2e-3, 40), "--lr changed"), ((1e-3, 80), "--train-iters")):
        with pytest.raises(AssertionError) as e:
            sched(lr, steps).load_state_dict(sched(1e-3, 40).state_dict())
        msg = scheduler_mismatch_message(e.value, "ck/iter_0000002")
        assert msg.startswith("ck/iter_0000002: ") and flag in msg and "\n" not in msg, msg
        assert "--override-opt-param-scheduler" in msg and "--use-checkpoint-opt-param-scheduler" in msg
        if flag == "--train-iters":  # the scheduler counts samples: the message says so
            assert "total number of weight decay samples 40 in the checkpoint, 80 now" in msg, msg
    msg = _structure_mismatch("padded_vocab_size", 1024, 1280, {"tp": 1, "pp": 1}, {"tp": 2, "pp": 1}, "ck")
    assert "saved at TP=1, this run has TP=2" in msg and "tools/convert_checkpoint.py reshard" in msg
    assert "--target-tp 2" in msg
    # A structural flag this run does not give, or gives without a value: said as on the command line.
    msg = _structure_mismatch("mtp_num_layers", 1, None, {"tp": 1}, {"tp": 1}, "ck")
    assert msg == "ck was saved with --mtp-num-layers 1 but this run has no --mtp-num-layers; give the checkpoint's setting"
    msg = _structure_mismatch("swiglu", True, False, {"tp": 1}, {"tp": 1}, "ck")
    assert msg == "ck was saved with --swiglu but this run has no --swiglu; give the checkpoint's setting"


def test_a_checkpoint_without_scheduler_state_advances_the_schedule_to_its_samples():
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_lev.checkpoint.sharded import restore_schedule

    def sched():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=16,
                                       lr_decay_steps=64, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
                                       wd_incr_steps=64, wd_incr_style="constant",
                                       use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)

    ref = sched()
    for _ in range(3):  # three iterations of 8 samples
        ref.step(increment=8)
    lines = []
    saved, absent = sched(), sched()
    restore_schedule(saved, {"opt_param_scheduler": ref.state_dict(), "consumed_train_samples": 24}, "ck", lines.append)
    restore_schedule(absent, {"consumed_train_samples": 24, "iteration": 3}, "ck", lines.append)
    lr = lambda s: s.optimizer.param_groups[0]["lr"]  # noqa: E731
    assert lr(saved) == lr(absent) == lr(ref) and lr(ref) not in (0.0, 1e-3), lr(ref)
    assert lines == ["WARNING: ck holds no learning-rate scheduler state: the schedule is advanced to its 24 "
                     "consumed samples (iteration 3)"], lines


def test_a_failed_save_says_no_space_or_the_wrapped_error_not_checkpoint_exception(tmp_path, monkeypatch):
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_lev.checkpoint import sharded

    def wrapped(e):  # as torch's writers report a rank's failure: (exception, traceback) per rank
        return CheckpointException("write", {0: (e, [])})

    denied = wrapped(PermissionError(errno.EACCES, "Permission denied", "ck/iter_0000004/__0_0.distcp"))
    assert sharded._failure_reason(denied).startswith("PermissionError: [Errno 13] Permission denied"), \
        sharded._failure_reason(denied)
    # ENOSPC inside the wrapping, without its text; and a full disk torch reports without an errno.
    quiet = OSError(errno.ENOSPC, "")
    assert sharded._no_space(CheckpointException("write", {0: (quiet, [])}))
    stream = wrapped(RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"))
    assert sharded._local_outcome(stream, str(tmp_path)) == sharded._FAILED  # room there: another failure
    monkeypatch.setattr(sharded, "_disk_is_full", lambda root: root == str(tmp_path))
    assert sharded._local_outcome(stream, str(tmp_path)) == sharded._NO_SPACE


# ------------------------------------------------------------------------------------------ export


def test_export_files_get_the_usual_mode_and_overwrite_clears_an_old_lev_folder(tmp_path):
    import torch

    from megatron_lev.conversion.files import clear_export_dir
    from megatron_lev.conversion.hf import ShardedSafetensorsWriter

    old = os.umask(0o022)
    try:
        w = ShardedSafetensorsWriter(str(tmp_path))
        w.add("w", torch.zeros(3))
        (path,) = w.close()
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644
    (tmp_path / "lev").mkdir()
    (tmp_path / "lev" / "lev_embedding.safetensors").write_bytes(b"old")
    (tmp_path / "README.md").write_text("kept")
    assert clear_export_dir(str(tmp_path)) == ["lev", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


# --------------------------------------------------------------------------------- spawned ranks


def _exit_at_once(code):
    os._exit(code)


def test_ranks_that_die_before_reporting_fail_at_once_with_their_exit_codes():
    from megatron_lev.testing import DistributedFailure, run_distributed

    with pytest.raises(DistributedFailure) as e:
        run_distributed(_exit_at_once, 2, args=(7,), timeout=90)
    msg = str(e.value)
    assert "died without reporting" in msg and "[7" in msg and "timed out" not in msg, msg


# -------------------------------------------------------------------------------- tokenizer fingerprints


def _tiktoken_file(path, extra_merge: bytes):
    from megatron_lev.tokenizer import write_tiktoken_file

    ranks = {bytes([i]): i for i in range(256)}
    ranks[extra_merge] = 256
    write_tiktoken_file(ranks, str(path))
    return str(path)


def test_dataset_records_its_tokenizer_and_another_one_is_refused_in_one_line(dataset, capsys):
    from megatron_lev.data.datasets import DatasetValidationError, validate_dataset_prefix
    from megatron_lev.tokenizer import build_tokenizer, tokenizer_fingerprint

    side = json.load(open(dataset + ".tokenizer.json"))
    same = tokenizer_fingerprint(build_tokenizer("NullTokenizer", vocab_size=1000))
    assert side == same and side["type"] == "NullTokenizer" and side["vocab_size"] == 1001
    validate_dataset_prefix(dataset, 1024, tokenizer_fp=same)
    other = tokenizer_fingerprint(build_tokenizer("NullTokenizer", vocab_size=999))  # pads to the same 1024
    with pytest.raises(DatasetValidationError) as e:
        validate_dataset_prefix(dataset, 1024, tokenizer_fp=other)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{dataset}.bin was preprocessed with NullTokenizer (1001 ids")
    assert "this run's tokenizer is NullTokenizer (1000 ids" in msg and "--allow-tokenizer-mismatch" in msg
    warnings = []
    validate_dataset_prefix(dataset, 1024, tokenizer_fp=other, allow_tokenizer_mismatch=True, warn=warnings.append)
    assert len(warnings) == 1 and "allowed by --allow-tokenizer-mismatch" in warnings[0]
    # A dataset written before fingerprints: one warning per prefix, not a failure.
    os.remove(dataset + ".tokenizer.json")
    warnings = []
    for _ in range(2):
        validate_dataset_prefix(dataset, 1024, tokenizer_fp=other, warn=warnings.append)
    assert len(warnings) == 1 and "tokenizer cannot be checked" in warnings[0], warnings


def test_training_on_a_dataset_of_another_tokenizer_is_refused(dataset):
    from megatron_lev.training.data import build_datasets
    from megatron_lev.training.loop import _setup_configs

    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--split", "1,0,0",
            "--data-path", dataset, "--tokenizer-type", "NullTokenizer"]
    from megatron_lev.data.datasets import DatasetValidationError

    rc, tok, _, _ = _setup_configs(argv + ["--vocab-size", "999"])
    with pytest.raises(DatasetValidationError, match="was preprocessed with NullTokenizer .*--allow-tokenizer-mismatch"):
        build_datasets(rc, tok)
    rc, tok, _, _ = _setup_configs(argv + ["--vocab-size", "999", "--allow-tokenizer-mismatch"])
    assert build_datasets(rc, tok)[0] is not None


def _fake_checkpoint(root, fp, tokenizer_type="NullTokenizer"):
    import yaml

    it = root / "iter_0000002"
    it.mkdir(parents=True)
    (it / "metadata.json").write_text("{}")
    from megatron_lev.arguments import parse_run_config, resolved_config

    # A whole config.yaml, as a run writes it (evaluation reads it typed).
    rc = parse_run_config("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 32 --micro-batch-size 1 "
                          "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 1000 --tokenizer-type NullTokenizer".split(),
                          world_size=1)
    cfg = dict(resolved_config(rc.to_saved_args()), padded_vocab_size=1024, tokenizer_type=tokenizer_type,
               tokenizer_fingerprint=fp)
    (it / "config.yaml").write_text(yaml.safe_dump(cfg))
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    return it


def test_evaluation_with_another_tokenizer_is_refused_before_loading(tmp_path, capsys, dataset, monkeypatch):
    from megatron_lev.evaluation import cli
    from megatron_lev.tokenizer import build_tokenizer, tokenizer_fingerprint

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "init_distributed", no_model)
    it = _fake_checkpoint(tmp_path / "ck", tokenizer_fingerprint(build_tokenizer("NullTokenizer", vocab_size=1000)))
    tik = _tiktoken_file(tmp_path / "other.tiktoken", b"ab")
    base = ["--load", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "out")]
    code = cli.main(base + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tik])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {it} was saved with NullTokenizer (1001 ids")
    assert "this run's tokenizer is TikTokenizer (" in err[0] and "other.tiktoken" in err[0]
    assert "--allow-tokenizer-mismatch" in err[0]
    # An indexed set of another tokenizer than the checkpoint's own.
    _fake_checkpoint(tmp_path / "ck2", tokenizer_fingerprint(build_tokenizer("TikTokenizer", tokenizer_model=tik,
                                                                             tiktoken_pattern="o200k")),
                     tokenizer_type="TikTokenizer")
    code = cli.main(["--load", str(tmp_path / "ck2"), "--output-dir", str(tmp_path / "out"), "--tokenizer-type",
                     "TikTokenizer", "--tokenizer-model", tik, "--valid-data", dataset])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {dataset}.bin was preprocessed with NullTokenizer"), err
    # Deliberate: the flag lets it through to the next check (this checkpoint has no shards at all).
    code = cli.main(base + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tik, "--allow-tokenizer-mismatch"])
    out = capsys.readouterr()
    assert "allowed by --allow-tokenizer-mismatch" in out.out
    assert code == 2 and out.err.startswith(f"error: {it / '.metadata'}: missing;"), out.err


def test_evaluation_allowed_another_tokenizer_refuses_ids_beyond_its_vocabulary(tmp_path, capsys, dataset,
                                                                                monkeypatch):
    """--allow-tokenizer-mismatch lets another tokenizer through, but not ids it cannot decode or the model
    cannot embed: one line naming the .bin, as training says it (before, the decoder's IndexError)."""
    import yaml

    from megatron_lev.evaluation import cli
    from megatron_lev.tokenizer import build_tokenizer, tokenizer_fingerprint

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "init_distributed", no_model)
    it = _fake_checkpoint(tmp_path / "ck", tokenizer_fingerprint(build_tokenizer("NullTokenizer", vocab_size=1000)))
    base = ["--load", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "out"), "--valid-data", dataset,
            "--allow-tokenizer-mismatch"]
    from tokenizers import Tokenizer, models

    other = str(tmp_path / "tokenizer.json")  # 4 ids; the set's ids reach 452
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2, "[UNK]": 3}, unk_token="[UNK]")).save(other)
    code = cli.main(base + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", other])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: {dataset}.bin: holds token id 452 >= the tokenizer's vocabulary size 4 "
                                 "(preprocessed with another tokenizer?)"], err
    # The checkpoint's own tokenizer decodes them all, but its model has fewer ids.
    cfg = yaml.safe_load((it / "config.yaml").read_text())
    (it / "config.yaml").write_text(yaml.safe_dump(dict(cfg, padded_vocab_size=400)))
    code = cli.main(base)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "holds token id 452 >= the checkpoint's vocabulary size 400" in err[0], err


def test_checkpoint_tokenizer_check_old_checkpoints_and_the_override():
    from megatron_lev.checkpoint import CheckpointError, check_checkpoint_tokenizer
    from megatron_lev.tokenizer import build_tokenizer, tokenizer_fingerprint

    a = tokenizer_fingerprint(build_tokenizer("NullTokenizer", vocab_size=1000))
    b = tokenizer_fingerprint(build_tokenizer("NullTokenizer", vocab_size=999))
    check_checkpoint_tokenizer({"tokenizer_fingerprint": a}, a, "NullTokenizer", "ck")
    with pytest.raises(CheckpointError, match=r"^ck was saved with NullTokenizer \(1001 ids.*NullTokenizer \(1000 ids"):
        check_checkpoint_tokenizer({"tokenizer_fingerprint": a}, b, "NullTokenizer", "ck")
    logs = []
    check_checkpoint_tokenizer({"tokenizer_fingerprint": a}, b, "NullTokenizer", "ck", allow_mismatch=True,
                               log=logs.append)
    assert len(logs) == 1 and "allowed by --allow-tokenizer-mismatch" in logs[0]
    # Saved before fingerprints: the type is still compared; the same type warns.
    with pytest.raises(CheckpointError, match="--tokenizer-type GPT2BPETokenizer but this run's tokenizer is Null"):
        check_checkpoint_tokenizer({"tokenizer_type": "GPT2BPETokenizer"}, b, "NullTokenizer", "ck")
    logs = []
    check_checkpoint_tokenizer({"tokenizer_type": "NullTokenizer"}, b, "NullTokenizer", "ck", log=logs.append)
    assert len(logs) == 1 and "without a tokenizer fingerprint" in logs[0]


# ---------------------------------------------------------------------------------- empty outputs


def test_empty_outputs_are_refused_with_the_counts_unless_asked(tmp_path, capsys):
    empty, blank, other_key = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl", tmp_path / "body.jsonl"
    empty.write_text("")
    blank.write_text("\n\n")
    other_key.write_text("".join(_lines(4)))
    for src, extra, counts in ((empty, (), "0 lines read; skipped: none"), (blank, (), "skipped: blank=2"),
                               (other_key, ("--json-keys", "body"), "4 lines read; skipped: missing_key=4")):
        code, errors, err, written = _run(tmp_path, capsys, src, *extra)
        assert code == 1 and len(errors) == 1, (src.name, err)
        assert errors[0].startswith("error: no documents from 1 input file(s)") and counts in errors[0], errors
        assert "--allow-empty-output" in errors[0] and "Traceback" not in err
        assert written == [], (src.name, written)
    code, errors, err, written = _run(tmp_path, capsys, empty, "--allow-empty-output")
    assert code == 0 and errors == [] and "ds_text_document.bin" in written, err


def test_a_directory_as_input_is_named_as_one(tmp_path, capsys):
    code, errors, err, _ = _run(tmp_path, capsys, tmp_path)
    assert code == 2 and len(errors) == 1, err
    assert errors[0] == f"error: {tmp_path}: a directory, not an input file; give its files (e.g. '{tmp_path}/*.jsonl*')"


def test_disk_full_while_preprocessing_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    from megatron_lev.data import preprocessing

    src = tmp_path / "in.jsonl"
    src.write_text("".join(_lines()))
    real = preprocessing._Output.write

    def full(self, tokens, lengths):
        real(self, tokens, lengths)  # some bytes reach the .partial file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(preprocessing._Output, "write", full)
    code, errors, err, written = _run(tmp_path, capsys, src)
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: --output-prefix {tmp_path / 'out' / 'ds'}: no space left on device in "
                                f"{tmp_path / 'out'} after "), errors
    assert "GiB free there); the partial files were removed" in errors[0]
    assert written == [], written


def test_disk_full_whose_buffered_bin_fails_again_on_close_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    # As on a real full disk: the .bin's buffered writer fails on a write and again when closed (its flush).
    import errno
    import io

    from megatron_lev.data import preprocessing

    class FullDisk(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = preprocessing._Output.open

    def open_full(self, indexed_dataset, dtype):
        real(self, indexed_dataset, dtype)  # the .bin.partial exists on disk
        self.builder.data_file.close()
        self.builder.data_file = io.BufferedWriter(FullDisk(), buffer_size=1000)

    monkeypatch.setattr(preprocessing._Output, "open", open_full)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(_lines()))
    code, errors, err, written = _run(tmp_path, capsys, src)
    assert code == 1 and len(errors) == 1 and "Traceback" not in err and "During handling" not in err, err
    out = tmp_path / "out"
    assert errors[0].startswith(f"error: --output-prefix {out / 'ds'}: no space left on device in {out} after "), errors
    assert f"while writing {out / 'ds_text_document.bin'} (" in errors[0] and "GiB free there)" in errors[0], errors
    assert written == [], written  # no .bin.partial left behind


# ------------------------------------------------------------------------------------ smaller cases


def test_vocab_size_beside_a_tokenizer_with_files_sizes_the_model_in_training_and_is_refused_in_preprocessing(
        tmp_path, capsys):
    from megatron_lev.arguments import parse_run_config
    from megatron_lev.lev.config import ConfigError
    from megatron_lev.tokenizer import build_tokenizer
    from megatron_lev.training.loop import _vocab_size_notice

    tik = _tiktoken_file(tmp_path / "t.tiktoken", b"ab")
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tik, "--tiktoken-pattern", "gpt2"]
    with pytest.raises(SystemExit) as e:  # preprocessing builds no model: --vocab-size has nothing to size
        preprocess_main(["--input", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "o"), *flags,
                         "--vocab-size", "1000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == ("error: --vocab-size 1000 applies to NullTokenizer (and TikTokenizer with --tiktoken-pattern "
                      "v1/v2) only; TikTokenizer takes its vocabulary from its files: drop --vocab-size")
    # Training (Megatron-LM's Llama-3 scripts): the model's vocabulary, padded as usual, when it holds the ids
    train = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
             "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data", *flags]
    tokenizer = build_tokenizer("TikTokenizer", tokenizer_model=tik, tiktoken_pattern="gpt2")
    rc = parse_run_config(train + ["--vocab-size", "1000"], world_size=1).with_tokenizer(tokenizer)
    assert rc.model.padded_vocab_size == 1024 and tokenizer.vocab_size < 1000
    assert _vocab_size_notice(rc) == (f" > --vocab-size 1000 beside the TikTokenizer ({tokenizer.vocab_size} ids): "
                                      "the model's vocabulary is 1000, 1024 rows once padded")
    plain = parse_run_config(train, world_size=1).with_tokenizer(tokenizer)
    assert plain.model.padded_vocab_size == 384 and _vocab_size_notice(plain) is None
    with pytest.raises(ConfigError, match=rf"^--vocab-size 100 is smaller than the TikTokenizer's "
                                          rf"{tokenizer.vocab_size} ids: give at least {tokenizer.vocab_size}, or "
                                          r"drop --vocab-size$"):
        parse_run_config(train + ["--vocab-size", "100"], world_size=1).with_tokenizer(tokenizer)


def test_padded_vocabulary_mismatch_does_not_name_an_internal_flag():
    from megatron_lev.checkpoint.sharded import _structure_mismatch

    msg = _structure_mismatch("padded_vocab_size", 50304, 50432, {"tp": 1}, {"tp": 1, "pp": 1}, "ck")
    assert "--padded-vocab-size" not in msg and "padded vocabulary 50304 in the checkpoint, 50432 in this run" in msg
    assert "--make-vocab-size-divisible-by" in msg


def test_no_evaluation_builds_no_validation_or_test_split(dataset):
    from megatron_lev.data.datasets import DatasetValidationError
    from megatron_lev.training.data import build_datasets
    from megatron_lev.training.loop import _setup_configs

    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--data-path", dataset,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]  # the default --split 969,30,1
    rc, tok, _, _ = _setup_configs(argv + ["--eval-iters", "0"])
    train, valid, test = build_datasets(rc, tok)
    assert train is not None and valid is None and test is None
    rc, tok, _, _ = _setup_configs(argv + ["--eval-iters", "1"])  # the test part of 60 documents is empty
    with pytest.raises(DatasetValidationError, match="the test part of --split 969,30,1 gets 0 of its 60 documents"):
        build_datasets(rc, tok)


def test_evaluating_a_hugging_face_model_on_another_tokenizer_s_set_is_refused(tmp_path, capsys, dataset, monkeypatch):
    from tokenizers import Tokenizer, models

    from megatron_lev.evaluation import cli
    from megatron_lev.tokenizer import build_tokenizer, tokenizer_fingerprint
    from megatron_lev.tokenizer.fingerprint import MODEL_DIR_SIDECAR, write_sidecar

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "HFScorer", no_model)
    hf = tmp_path / "hf"
    hf.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2}, unk_token="a")).save(str(hf / "tokenizer.json"))
    base = ["--hf-model", str(hf), "--valid-data", dataset, "--output-dir", str(tmp_path / "out")]
    # The model's own tokenizer (no --tokenizer-type) against a set made with NullTokenizer: refused first.
    code = cli.main(base)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {dataset}.bin was preprocessed with NullTokenizer (1001 ids"), err
    assert "this run's tokenizer is HuggingFaceTokenizer (3 ids, tokenizer.json" in err[0], err
    assert err[0].endswith(f"--allow-tokenizer-mismatch if this is deliberate (the tokenizer of --hf-model {hf})"), err
    # The fingerprint an export recorded is what counts (its re-saved files hash differently).
    write_sidecar(str(hf / MODEL_DIR_SIDECAR), tokenizer_fingerprint(build_tokenizer("NullTokenizer", vocab_size=1000)))
    with pytest.raises(AssertionError, match="the model was loaded"):
        cli.main(base)
    # Nothing to fingerprint: one warning, not a silent pass.
    for name in ("tokenizer.json", MODEL_DIR_SIDECAR):
        os.remove(hf / name)
    with pytest.raises(AssertionError, match="the model was loaded"):
        cli.main(base)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"WARNING: --hf-model {hf}: no tokenizer file to fingerprint"), out
