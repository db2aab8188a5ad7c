"""Fault injection on training runs: the launcher's process group killed with SIGKILL in the middle
of a run and in the middle of a save (no rank and no checkpoint-writer process survives it; the next
run resumes from the last complete checkpoint), and NaN (checked by default; a NaN never becomes
the latest checkpoint, also with the check turned off; exit 3).

Tiny models on megatron-core's mock data; each torchrun launch costs ~10 s of imports, so every run
serves several checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_lev.testing import free_port
from tests.training.test_pretrain import PRETRAIN, REPO, _env, launch, metrics, run_single

# Its tests share multi-process jobs (~89 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

TAG = "MEGATRON_LEV_FAULT_TAG"
TRACKER = "latest_checkpointed_iteration.txt"


def tiny_args(iters, extra=()):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-3",
            "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--eval-iters", "0",
            "--quiet-config"] + list(extra)


def tagged_processes(tag):
    """Live processes (any parent) whose environment carries TAG=tag: everything one launch started."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != b"Z":
            found.append(int(d))
    return found


def wait_for_text(path, text, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = Path(path).read_text(errors="replace")
        if text in content:
            return content
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared (exit {proc.poll()}):\n{Path(path).read_text()[-4000:]}")


def kill_launcher_group(args, log, wait_text):
    """torchrun in its own process group; SIGKILL the group once ``wait_text`` is logged.

    Returns (log text, processes of the launch still alive 10 s after the kill); leftovers are killed.
    """
    tag = uuid.uuid4().hex
    env = dict(_env(), **{TAG: tag})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), PRETRAIN] + args
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                start_new_session=True)
    try:
        text = wait_for_text(log, wait_text, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = tagged_processes(tag)
    finally:
        for pid in tagged_processes(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return text, survivors


def test_kill9_of_launcher_mid_run_and_mid_save_leaves_no_orphans_and_resumes(tmp_path):
    ck = tmp_path / "ck"
    # A long run: a rank that outlives the launcher keeps training (and saving) for minutes.
    args = tiny_args(100000, ["--save", str(ck), "--load", str(ck), "--save-interval", "2"])

    # Mid-run: the ranks are training (iteration 5, after the save at 4). The save at 6 stalls, so a
    # kill that a loaded machine delivers an iteration late still finds 4 as the last checkpoint.
    _, survivors = kill_launcher_group(args + ["--debug-stall-during-save", "0:6"], tmp_path / "a.log",
                                       " iteration        5/")
    assert survivors == [], f"processes outlived the launcher by 10 s: {survivors}"
    assert (ck / TRACKER).read_text().strip() == "4"

    # Mid-save: resumed from 4, killed while rank 0's checkpoint writers are writing iteration 6.
    text, survivors = kill_launcher_group(args + ["--debug-stall-during-save", "0:6"], tmp_path / "b.log",
                                          "stalled")
    assert "successfully loaded checkpoint from" in text and "at iteration 4" in text
    assert survivors == [], f"processes outlived the launcher by 10 s: {survivors}"
    assert (ck / TRACKER).read_text().strip() == "4"
    assert not (ck / "iter_0000006" / "config.yaml").exists()

    # The next run resumes from the last complete checkpoint (and stops after saving at 8).
    r = launch(2, args + ["--exit-interval", "8", "--metrics-file", str(tmp_path / "c.jsonl")])
    assert "at iteration 4" in r.stdout
    assert sorted(metrics(tmp_path / "c.jsonl")) == [5, 6, 7, 8]
    assert (ck / TRACKER).read_text().strip() == "8"


def _error_lines(r):
    return [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]


def test_nan_is_checked_by_default_and_never_checkpointed(tmp_path):
    ck = tmp_path / "ck"
    # No NaN flag at all: the check is on; the last good state (2) is saved, the NaN step is not.
    r = run_single(tiny_args(6, ["--inject-nan-at-iteration", "3", "--save", str(ck), "--save-interval", "1"]))
    assert r.returncode == 3, r.stderr[-3000:]
    errors = _error_lines(r)
    assert len(errors) == 1 and "NaN/Inf in the loss at iteration 3" in errors[0], errors
    assert (ck / TRACKER).read_text().strip() == "2"

    # Check turned off: training goes on with NaN parameters, but no checkpoint holds them.
    r = run_single(tiny_args(6, ["--no-check-for-nan-in-loss-and-grad", "--inject-nan-at-iteration", "3",
                                 "--save", str(ck), "--load", str(ck), "--save-interval", "1"]))
    assert r.returncode == 3, r.stderr[-3000:]
    errors = _error_lines(r)
    assert len(errors) == 1 and "NaN/Inf in the parameters at iteration 3" in errors[0], errors
    assert "Traceback" not in r.stderr
    assert (ck / TRACKER).read_text().strip() == "2"
    assert not (ck / "iter_0000003").exists()

    # Resuming that checkpoint with another tokenizer (same padded vocabulary, 256) is refused in one line.
    r = run_single(tiny_args(6, ["--save", str(ck), "--load", str(ck), "--vocab-size", "250"]))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = _error_lines(r)
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith(f"error: {ck / 'iter_0000002'} was saved with NullTokenizer (257 ids"), errors
    assert "this run's tokenizer is NullTokenizer (251 ids" in errors[0] and "--allow-tokenizer-mismatch" in errors[0]
    assert (ck / TRACKER).read_text().strip() == "2"

    # Damaged files of the latest checkpoint: one line naming the file and the older complete checkpoint.
    _damaged_checkpoint_is_one_line_naming_the_file_and_the_older_one(ck)


def _damaged_checkpoint_is_one_line_naming_the_file_and_the_older_one(ck):
    import shutil

    import pytest

    from megatron_lev.checkpoint import CheckpointError, open_checkpoint
    from megatron_lev.compat.versions import megatron_core_version
    from megatron_lev.conversion import ConversionError
    from megatron_lev.conversion import open_checkpoint as open_for_conversion

    it2, it1 = ck / "iter_0000002", ck / "iter_0000001"
    shard = sorted(it2.glob("*.distcp"))[0]
    keep = ck.parent / "keep"
    shutil.copytree(it2, keep)

    def truncate(p):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    def flip(p):  # 512 bytes changed in the middle, the size kept (bit rot, a bad copy)
        data = bytearray(p.read_bytes())
        mid = max(0, len(data) // 2 - 256)
        data[mid:mid + 512] = bytes(b ^ 0xFF for b in data[mid:mid + 512])
        p.write_bytes(bytes(data))

    changed = "its bytes changed after the save (CRC32 differs from the "
    largest = max(it2.glob("*.distcp"), key=lambda p: p.stat().st_size)
    manifest = it2 / "checksums.json"
    cases = [(shard, truncate, "truncated ("), (shard, os.remove, "missing"), (largest, flip, changed),
             (it2 / ".metadata", os.remove, "missing"), (it2 / ".metadata", truncate, "unreadable ("),
             # Flipped bytes in the pickle may or may not stop it from reading: either way it is named.
             (it2 / ".metadata", flip, ("unreadable (", changed)),
             (manifest, lambda p: p.write_text("{"), "unreadable (JSONDecodeError"),
             (it2 / "metadata.json", os.remove, "missing"), (it2 / "config.yaml", os.remove, "missing")]
    # Up to 0.16.1 the common state is a file of its own; 0.19 keeps it inside the torch_dist files (the
    # shard cases above) and writes no common.pt.
    if megatron_core_version().release[:2] < (0, 19):
        cases += [(it2 / "common.pt", truncate, "unreadable ("), (it2 / "common.pt", os.remove, "missing"),
                  (it2 / "common.pt", flip, ("unreadable (", changed))]
    else:
        assert not (it2 / "common.pt").exists(), sorted(p.name for p in it2.iterdir())
    for path, damage, what in cases:
        whats = what if isinstance(what, tuple) else (what,)
        damage(path)
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(str(ck))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(tuple(f"{path}: {w}" for w in whats)), msg
        assert f"the newest complete older checkpoint is {it1}: pass --iteration 1" in msg, msg
        with pytest.raises(ConversionError) as e:
            open_for_conversion(str(ck))
        assert str(e.value).startswith(tuple(f"{path}: {w}" for w in whats)), str(e.value)
        shutil.rmtree(it2)
        shutil.copytree(keep, it2)
    open_checkpoint(str(ck))  # restored

    # Training: refused at start-up with the flag that loads the older one; that flag resumes from it.
    args = tiny_args(6, ["--save", str(ck), "--load", str(ck), "--save-interval", "1"])
    for path, damage, what in [(it2 / "metadata.json", os.remove, "missing"), (shard, truncate, "truncated ("),
                               (largest, flip, changed)]:
        shutil.rmtree(it2)
        shutil.copytree(keep, it2)
        damage(path)
        r = run_single(args)
        errors = _error_lines(r)
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert errors[0].startswith(f"error: {path}: {what}") and "nothing was loaded" in errors[0], errors
        assert errors[0].endswith(f"the newest complete older checkpoint is {it1}: resume from it with --ckpt-step 1")
    # --no-ckpt-checksums judges the newer, damaged iter_0000002 by its sizes alone: it stays in the way,
    # refused before any work. With checksums (every rank verifying its share) its changed bytes let the
    # run resume from the older one, as the line above says.
    r = run_single(args + ["--ckpt-step", "1", "--no-ckpt-checksums"])
    errors = _error_lines(r)
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{it2} is a newer complete checkpoint" in errors[0] and "--overwrite-checkpoints" in errors[0], errors
    r = run_single(args + ["--ckpt-step", "1", "--exit-interval", "3"])
    assert r.returncode == 0 and "at iteration 1" in r.stdout, r.stderr[-3000:]
    assert f"WARNING: {it2}, newer than the checkpoint this run loads, is damaged" in r.stdout, r.stdout[-3000:]
    assert (ck / TRACKER).read_text().strip() == "3" and (it2 / "checksums.json").exists()
    r = run_single(args + ["--no-ckpt-checksums"])
    assert r.returncode == 0 and "at iteration 3" in r.stdout, r.stderr[-3000:]
    assert (ck / TRACKER).read_text().strip() == "6"
    # --no-ckpt-checksums: those saves recorded none; a checkpoint without them (an older release's too)
    # opens with one warning line, however often it is opened.
    assert not (ck / "iter_0000006" / "checksums.json").exists()
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        open_checkpoint(str(ck), 4)
        open_checkpoint(str(ck), 4)
    assert err.getvalue().splitlines() == [
        f"WARNING: {ck / 'iter_0000004'}: written without checksums.json (an older release, or checksums were "
        "off); its files are checked for size only, not for changed bytes"], err.getvalue()

    # The tracker deleted beside complete checkpoints: refused at start-up, naming the newest and the flag;
    # nothing under iter_0000006 is rewritten (a fresh start used to train over it, exit 0).
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (ck / "iter_0000006").iterdir()}
    (ck / TRACKER).unlink()
    r = run_single(args)
    errors = _error_lines(r)
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{ck / 'iter_0000006'} is a complete checkpoint (the newest there)" in errors[0], errors
    assert f"--ckpt-step 6" in errors[0] and "training from scratch" not in r.stdout + r.stderr, errors
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (ck / "iter_0000006").iterdir()} == before


def test_disk_full_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    r = run_single(tiny_args(6, ["--save", str(ck), "--save-interval", "2", "--debug-enospc-during-save", "0:4"]))
    assert r.returncode == 4, r.stderr[-3000:]
    errors = _error_lines(r)
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    msg = errors[0]
    assert msg.startswith(f"error: --save {ck}: the checkpoint of iteration 4 could not be written "
                          "(no space left on device; "), msg
    assert " free there); its partial folder " in msg and f"{ck / 'iter_0000004'} was removed" in msg, msg
    assert f"the last complete checkpoint is {ck / 'iter_0000002'}" in msg and f"--load {ck}" in msg, msg
    assert not (ck / "iter_0000004").exists() and (ck / TRACKER).read_text().strip() == "2"

    # TP=2, the second rank's writer fails: the first rank still says it in one line, no rank's traceback.
    ck2 = tmp_path / "ck2"
    r = launch(2, tiny_args(6, ["--save", str(ck2), "--save-interval", "2", "--tensor-model-parallel-size", "2",
                                "--debug-enospc-during-save", "1:4"]), check=False)
    errors = _error_lines(r)
    assert r.returncode != 0 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith(f"error: --save {ck2}: the checkpoint of iteration 4 could not be written (no space"), errors
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr
    assert "inline_container" not in r.stderr
    assert not (ck2 / "iter_0000004").exists() and (ck2 / TRACKER).read_text().strip() == "2"

    # --save unwritable during the run (its iteration folder cannot be made): one line, exit 4, not a
    # traceback from os.makedirs (on which the other ranks used to report only "lost another rank").
    ck3 = tmp_path / "ck3"
    ck3.mkdir()
    (ck3 / "iter_0000002").write_text("in the way")
    r = run_single(tiny_args(2, ["--save", str(ck3), "--save-interval", "2"]))
    errors = _error_lines(r)
    assert r.returncode == 4 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith(f"error: --save {ck3}: the checkpoint of iteration 2 could not be written ("), errors
    assert "there is no complete checkpoint yet; once --save can be written, resume with --load" in errors[0], errors
    assert (ck3 / "iter_0000002").read_text() == "in the way"  # not the run's to remove


def signal_mid_run(ck, log, sig):
    """One process saving to ``ck`` every iteration, sent ``sig`` after iteration 5; (exit code, output).

    A save every iteration: the signal most likely lands inside one (held until the save ends; an
    interrupt during dist_checkpointing's fork of its writers used to be dropped, training went on)."""
    cmd = [sys.executable, PRETRAIN] + tiny_args(100000, ["--save", str(ck), "--save-interval", "1"])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=str(REPO),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for_text(log, " iteration        5/", proc)
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, Path(log).read_text()


def test_ctrl_c_is_one_line_naming_the_iteration_and_the_last_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    code, text = signal_mid_run(ck, tmp_path / "run.log", signal.SIGINT)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 130 and len(errors) == 1 and "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    last = int((ck / TRACKER).read_text())
    assert errors[0].startswith("error: interrupted at iteration "), errors
    assert f"the last checkpoint is iteration {last} ({ck / f'iter_{last:07d}'}; resume with --load {ck})" in errors[0]
