"""bench/gpu_check.py --program speed: its plan fits one device window, and every stage runs end to end at
the tiny sizes on the CPU (the device's first run is not the program's first run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench import REPO, bench_module
WINDOW_S = 15 * 60  # device minutes lent to a task, the machine's start included
COMMAND_S = 600  # the longest one command may run there


@pytest.fixture(scope="module")
def gc():
    # Imported as the module gpu_check (as the script runs itself): the program's module imports it by name.
    return bench_module("gpu_check")


def test_the_speed_plan_fits_one_command_of_one_window(gc, capsys):
    prog = gc.load_program("speed")
    assert prog.names == ("env", "gpu400m", "pile400m", "profile", "kernels")
    assert prog.budget_s <= COMMAND_S and prog.budget_s + 4 * 60 <= WINDOW_S  # the start takes minutes
    limits = prog.stage_seconds(prog.budget_s)
    assert sum(limits.values()) <= prog.budget_s - gc.RESERVE_S
    assert gc.main(["--program", "speed", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"plan: budget {prog.budget_s:g} s at the device sizes")
    assert "un-profiled" in out and "examples/pile/configs/400m.yaml" in out and "without shapes" in out


@pytest.mark.gpu_program
@pytest.mark.slow
def test_every_speed_stage_runs_end_to_end_at_the_tiny_sizes(gc, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the check chooses it per stage
    out = tmp_path / "out"
    # A large budget: the stage limits are in proportion to it, and the tiny sizes bound the work.
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--program", "speed", "--out", str(out),
                        "--sizes", "tiny", "--budget-s", "20000", "--wheels", str(tmp_path / "none")],
                       capture_output=True, text=True, cwd=str(REPO), env=env, timeout=3600)
    report = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: (s["status"], s["reason"]) for s in report["stages"]}
    assert status == {n: ("ok", "") for n in gc.load_program("speed").names}, (status, r.stdout[-3000:])
    f = {s["name"]: s["figures"] for s in report["stages"]}
    for shape in ("gpu400m", "pile400m"):
        runs = f[shape]["runs"]
        assert set(runs) == {"tied", "untied", "lev"}, shape
        for arm, run in runs.items():
            assert run["iterations"] == len(run["lines"]) > 0 and run["median_ms"] > 0, (shape, arm)
        assert f[shape]["lev_over_tied"] > 0 and f[shape]["lev_over_untied"] > 0
    parts = f["profile"]["parts_ms_per_step"]
    assert set(parts) == {"lev", "rope", "cross_entropy", "optimizer", "attention", "other"}
    assert parts["rope"] > 0 and parts["cross_entropy"] > 0 and parts["optimizer"] > 0 and parts["lev"] > 0
    assert f["kernels"]["timings"]
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: program speed") and "LEV/TIED" in md and "kernel ms per step by part" in md


@pytest.mark.parametrize("sizes, impl", [("device", "auto"), ("tiny", "fused")])
def test_the_speed_runs_ask_for_auto_adamw_on_the_device_and_fused_on_the_cpu(gc, tmp_path, monkeypatch, sizes, impl):
    """--adam-impl fused is refused where megatron runs TE's or Apex's FusedAdam (a carried TE wheel on the
    device); auto is fused on CUDA without them. The tiny CPU runs ask for fused to run its path."""
    from megatron.core import optimizer as mcore_optimizer

    from megatron_lev.arguments import parse_args

    (tmp_path / "work").mkdir()
    ctx = gc.Ctx(out=str(tmp_path / "out"), work=str(tmp_path / "work"), wheels=None, shared_data=str(tmp_path),
                 sizes=sizes, cuda=sizes == "device", program="speed")
    import gpu_program_speed as speed

    argvs = [speed.train_argv(ctx, shape, arm) for shape in ("gpu400m", "pile400m") for arm in speed.ARMS]
    profiled = []
    monkeypatch.setattr(gc, "stage_profile", lambda ctx, timeout, extra=(): profiled.append(list(extra)))
    speed.stage_profile(ctx, 1.0)
    for argv in [*argvs, *profiled]:
        assert argv[argv.index("--adam-impl") + 1] == impl and argv.count("--adam-impl") == 1, argv
        assert "--rope-fusion" in argv
    if impl == "auto":  # accepted where TE or Apex imports
        monkeypatch.setattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False)
        gpu400m = speed.train_argv(ctx, "gpu400m", "tied")[1:]
        assert parse_args(gpu400m, world_size=1).adam_impl == "auto"
