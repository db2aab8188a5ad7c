"""``bench/gpu_check.py --program science``: the seed-paired science run sized to one device window from the
recorded H100 throughput, dropping runs in its stated order (never shortening training), and its tiny run
end to end on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench import BENCH, REPO, bench_module
ONE_PASS = 329 * 64 * 1024  # the science shape's token budget: one pass over the shared corpus


@pytest.fixture(scope="module")
def prog():
    return bench_module("gpu_program_science")


def test_the_program_is_registered_and_fits_one_window_in_one_command(prog):
    import gpu_check

    assert gpu_check.load_program("science").names == ("env", "science")
    assert prog.BUDGET_S <= 600 and prog.WINDOW_S == 900  # one command under the device's limit, one window
    runs = prog.size_runs(prog.BUDGET_S, prog.measured_rates(), ONE_PASS)
    assert runs["fits"] and runs["total_s"] <= prog.BUDGET_S - gpu_check.RESERVE_S
    assert runs["arms_by_seed"] == {2101: ["tied", "untied", "albert", "lev"], 2102: ["tied", "albert", "lev"]}
    assert runs["dropped"] == ["untied (seed 2102)"]


def test_runs_are_dropped_in_the_stated_order_and_training_is_never_shortened(prog):
    rates = prog.measured_rates()
    dropped = []
    for budget in (700, 580, 480, 420, 330, 100):
        runs = prog.size_runs(budget, rates, ONE_PASS)
        assert runs["dropped"][:len(dropped)] == dropped  # a smaller budget only drops more, in order
        dropped = runs["dropped"]
        assert all({"lev", "albert"} <= set(arms) for arms in runs["arms_by_seed"].values())
    assert dropped == ["untied (seed 2102)", "tied (seed 2102)", "untied (seed 2101)", "tied (seed 2101)"]
    assert not prog.size_runs(100, rates, ONE_PASS)["fits"]
    assert prog.size_runs(700, rates, ONE_PASS)["dropped"] == []
    # The plan's tokens are one pass over the corpus whatever the budget.
    assert prog.plan(300, "device")[1]["tokens_per_arm"] == prog.plan(900, "device")[1]["tokens_per_arm"]


def test_the_plan_says_what_runs_what_is_dropped_and_where_the_rates_come_from(capsys):
    gpu_check = bench_module("gpu_check")

    assert gpu_check.main(["--program", "science", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "plan: program science, budget 580 s" in out and "320 s of the 900 s device window" in out
    assert "dropped to fit: untied (seed 2102)" in out and "gpu_check_h100_2026-12-06/gpu_check.json" in out
    assert "DOES NOT FIT" not in out


@pytest.mark.gpu_program
@pytest.mark.slow
@pytest.mark.real_data
def test_the_tiny_run_passes_on_the_cpu(tmp_path):
    shared = os.environ.get("MEGATRON_LEV_SHARED_DATA", str(REPO.parent / "shared" / "data"))
    if not os.path.isdir(os.path.join(shared, "tokenizers", "gpt2")):
        pytest.skip(f"real-data check: the science stage reads the GPT-2 tokenizer and corpus under {shared}")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--program", "science", "--out", str(out),
                        "--work", str(tmp_path / "work"), "--sizes", "tiny", "--budget-s", "4000", "--wheels",
                        str(tmp_path / "none"), "--shared-data", shared], capture_output=True, text=True, cwd=str(REPO),
                       timeout=3600)
    report = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: (s["status"], s["reason"]) for s in report["stages"]}
    assert status == {"env": ("ok", ""), "science": ("ok", "")}, (status, r.stdout[-3000:], r.stderr[-3000:])
    f = next(s for s in report["stages"] if s["name"] == "science")["figures"]
    assert f["iterations"] == 3 and f["arms_by_seed"] == {"2101": ["tied", "untied", "albert", "lev"],
                                                         "2102": ["tied", "untied", "albert", "lev"]}
    assert {c["contrast"] for c in f["contrasts"]["valid"]} == {"lev-albert", "lev-tied", "lev-untied", "untied-tied"}
    assert len(f["curve_gaps"]) == 4 and all(len(g["windows"]) == 3 for g in f["curve_gaps"])  # 3 iterations
    science = (out / "science.md").read_text()
    for section in ("## Seed-paired differences", "### What the intervals support", "## Learning-curve gap",
                    "## Gradient norms and clipping", "mean NLL by exposure"):
        assert section in science, section
    assert "over 2 seeds" in science and "Learning-curve gap" in (out / "gpu_check.md").read_text()


def test_gpu_science_takes_arms_and_seeds_and_refuses_bad_ones_in_one_line(capsys):
    gpu_science = bench_module("gpu_science")

    base = ["--out", "o", "--work", "w", "--seconds", "1", "--assume-tflops", "100"]
    for bad, msg in ((["--arms", "tied,bogus"], "--arms tied,bogus: choose from"),
                     (["--seeds", "1,x"], "--seeds '1,x': expected comma-separated integers")):
        with pytest.raises(SystemExit) as e:
            gpu_science.main(base + bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert gpu_science.assumed_rates("gpu-science", 100.0)["albert"] == gpu_science.assumed_rates("gpu-science", 100.0)["untied"]
