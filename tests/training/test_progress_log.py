"""--log-progress: Megatron-LM's progress.txt in --save, a line when a job starts and one per checkpoint, the
floating-point operations and tokens counted across a resume. The line arithmetic on its own, and a run
stopped at 4 of 6 iterations and its resume forked from the rank server."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from megatron_lev.testing.cli import run_cli
from megatron_lev.training.progress_log import first_start, progress_line, saved_event

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "200", "--log-interval", "1",
        "--eval-iters", "0", "--quiet-config", "--save-interval", "2", "--log-progress", "--train-iters", "6"]


def test_saved_lines_and_the_first_start_of_a_world_size_follow_megatron_lms_format():
    line = progress_line(saved_event(8, 4e12, 2.0, (8e12, 4.0), 1.6e13, 3_000_000_000, 2), 2,
                         now=datetime(2026, 1, 2, 3, 4, 5))
    assert line == ("2026-01-02 03:04:05\tJob ID: \t# GPUs: 2\tSaved checkpoint\tIteration: 8\tJob throughput: 1.0 "
                    "TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: 1.60e+13\t"
                    "Tokens (in billions): 3.00\n")
    lines = [progress_line("Starting job", 4, now=datetime(2026, 1, 1)), line,
             progress_line("Starting job", 2, now=datetime(2026, 1, 3)),
             progress_line("Starting job", 2, now=datetime(2026, 1, 4))]
    assert first_start(lines, 2) == (datetime(2026, 1, 3), 1.6e13)  # the flops saved before that job
    assert first_start(lines, 8) is None


def test_a_resumed_run_appends_to_progress_txt_counting_operations_across_the_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    save = tmp_path / "ck"
    first = run_cli(REPO / "pretrain_lev.py", ARGS + ["--exit-interval", "4", "--save", save], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(REPO / "pretrain_lev.py", ARGS + ["--save", save, "--load", save],
                     timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = [line.split("\t") for line in (save / "progress.txt").read_text().splitlines()]
    assert [r[3] for r in rows] == ["Starting job", "Saved checkpoint", "Saved checkpoint", "Starting job",
                                    "Saved checkpoint"]
    assert all(r[1] == "Job ID: 4242" and r[2] == "# GPUs: 1" for r in rows)
    saved = [dict(f.split(": ", 1) for f in r[4:]) for r in rows if r[3] == "Saved checkpoint"]
    assert [s["Iteration"] for s in saved] == ["2", "4", "6"]
    flops = [float(s["Floating-point operations"]) for s in saved]
    # three significant digits in the file: equal steps, counted on across the resume
    assert flops[0] > 0 and all(abs(f - (i + 1) * flops[0]) <= 0.01 * f for i, f in enumerate(flops)), flops
    assert [s["Tokens (in billions)"] for s in saved] == ["0.00"] * 3
