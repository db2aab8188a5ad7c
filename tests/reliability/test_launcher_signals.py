"""What a user reads when a run under torchrun fails: a start-up refusal (the rank's one line is the
last word of torchrun's failure summary), one rank SIGKILLed during a checkpoint save, and SIGTERM
without --exit-signal-handler (mid-run and during a save that cannot finish). No partial checkpoint is
ever loaded, the tracker stays on the last complete one and the next run resumes from it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from megatron_lev.testing import free_port
from tests.reliability.test_training_faults import TAG, TRACKER, signal_mid_run, tagged_processes, tiny_args, \
    wait_for_text
from tests.training.test_pretrain import PRETRAIN, REPO, _env, launch, metrics

# Its tests share multi-process jobs (~65 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow


def _summary_lines(stderr: str):
    """torchrun's output without its frame lines (rows of = or -)."""
    return [ln.strip() for ln in stderr.splitlines() if ln.strip() and set(ln.strip()) - {"=", "-"}]


def _rank_errors(text: str):
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def test_a_start_up_refusal_under_torchrun_is_the_last_line_of_its_summary():
    r = launch(2, tiny_args(2, ["--no-such-flag"]), check=False, launcher=True)
    assert r.returncode == 1, r.stderr[-3000:]  # torchrun's own code; the ranks' is in the summary
    lines = _summary_lines(r.stderr)
    assert lines[-1] == "traceback : error: unrecognized arguments: --no-such-flag", lines[-12:]
    assert "exitcode  : 2 " in r.stderr and "To enable traceback" not in r.stderr
    # Printed by rank 0 only, recorded by every rank; on a loaded machine torchrun may stop rank 0 on rank 1's
    # exit before it prints: the summary's last line above holds the error in either case.
    assert len(_rank_errors(r.stderr)) <= 1


class _Launch:
    """torchrun with 2 ranks in its own process group, its output in ``log``; leftovers killed at the end."""

    def __init__(self, args, log):
        self.tag, self.log = uuid.uuid4().hex, log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), PRETRAIN] + args
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(_env(), **{TAG: self.tag}),
                                         cwd=str(REPO), start_new_session=True)

    def wait(self, text):
        return wait_for_text(self.log, text, self.proc)

    def finish(self):
        try:
            code = self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in tagged_processes(self.tag):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return code, Path(self.log).read_text()


def _cut_short(ck, it, last):
    return (f"at iteration {it}, during the save of iteration {it} (incomplete, not loaded: {ck / f'iter_{it:07d}'}); "
            f"the last checkpoint is iteration {last} ({ck / f'iter_{last:07d}'}; resume with --load {ck})")


def test_a_rank_killed_during_a_save_and_sigterm_during_a_save_are_one_line_and_resume(tmp_path):
    ck = tmp_path / "ck"
    args = tiny_args(100000, ["--save", str(ck), "--load", str(ck), "--save-interval", "2"])

    # Rank 1 is SIGKILLed while its checkpoint writers write iteration 4 (stalled there). Rank 0 sees the
    # lost connection or torchrun's SIGTERM to the survivors, whichever comes first: either way it names
    # rank 1 and exits 5 (torchrun's later SIGTERM is not its death).
    run = _Launch(args + ["--debug-stall-during-save", "1:4"], tmp_path / "a.log")
    # The hook names the rank's process: the writers are its children up to megatron-core 0.18, its
    # threads from 0.19.
    rank1 = int(re.search(r"checkpoint writer \d+ of rank process (\d+) stalled", run.wait("stalled")).group(1))
    os.kill(rank1, signal.SIGKILL)
    code, text = run.finish()
    errors = _rank_errors(text)
    assert code == 1 and len(errors) == 1 and "[rank0]: Traceback" not in text, text[-4000:]
    assert re.match(r"error: lost rank 1 \((connection (closed|reset) by peer|its process ended; the launcher's "
                    r"SIGTERM followed)\) ", errors[0]), errors
    assert re.search(r"exitcode\s*: 5 ", text), text[-3000:]
    assert _cut_short(ck, 4, 2) in errors[0], errors
    assert f"traceback : {errors[0]}" in text  # in torchrun's summary too, beside rank 1's SIGKILL
    assert "Signal 9 (SIGKILL) received by PID" in text
    assert (ck / TRACKER).read_text().strip() == "2"

    # SIGTERM to torchrun while rank 0's writers hang in the save of iteration 4: held for the grace
    # period, then the save is cut short in one line; nothing partial becomes the latest checkpoint.
    run = _Launch(args + ["--debug-stall-during-save", "0:4"], tmp_path / "b.log")
    run.wait("stalled")
    os.kill(run.proc.pid, signal.SIGTERM)
    code, text = run.finish()
    errors = _rank_errors(text)
    assert len(errors) == 1 and "[rank0]: Traceback" not in text and "Exception ignored" not in text, text[-4000:]
    assert errors[0].startswith("error: terminated by SIGTERM " + _cut_short(ck, 4, 2)), errors
    assert errors[0].endswith("pass --exit-signal-handler to save a checkpoint before stopping"), errors
    assert "at iteration 2" in text and (ck / TRACKER).read_text().strip() == "2"
    assert not (ck / "run.lock").exists()  # --save's lock released on SIGTERM

    # The next run resumes from iteration 2 and saves 4 again, complete.
    r = launch(2, args + ["--exit-interval", "4", "--metrics-file", str(tmp_path / "c.jsonl")])
    assert "at iteration 2" in r.stdout and sorted(metrics(tmp_path / "c.jsonl")) == [3, 4]
    assert (ck / TRACKER).read_text().strip() == "4" and (ck / "iter_0000004" / "config.yaml").exists()


def test_sigterm_without_the_signal_handler_is_one_line_naming_the_iteration_and_the_checkpoint(tmp_path):
    # A SIGTERM during a save is held until it completes (kept), then the run stops.
    ck = tmp_path / "ck"
    code, text = signal_mid_run(ck, tmp_path / "run.log", signal.SIGTERM)
    errors = _rank_errors(text)
    assert code == 143 and len(errors) == 1 and "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    last = int((ck / TRACKER).read_text())
    m = re.match(r"error: terminated by SIGTERM at iteration (\d+); the last checkpoint is iteration (\d+) ", errors[0])
    assert m and int(m.group(2)) == last and int(m.group(1)) in (last, last + 1), errors
    assert f"({ck / f'iter_{last:07d}'}; resume with --load {ck}); pass --exit-signal-handler" in errors[0]
    assert not (ck / "run.lock").exists()  # --save's lock released on SIGTERM
