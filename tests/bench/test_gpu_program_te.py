"""bench/gpu_program_te.py (``gpu_check.py --program te``) on the CPU: its plan inside one 15-minute
window with the piece-carrying calls, its judgements, and one run of every stage at the tiny sizes
without Transformer Engine (TE's runs skipped with "no TE", the rest run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.bench import BENCH, REPO, bench_module


@pytest.fixture(scope="module")
def te():
    return bench_module("gpu_program_te")


def test_the_te_program_is_registered_with_its_stages(te):
    import gpu_check

    assert gpu_check.PROGRAMS["te"] == "gpu_program_te"
    assert gpu_check.load_program("te").names == ("install", "env", "correctness", "fp8", "speed", "checkpoint")


def test_the_fp8_probe_builds_and_runs_the_lev_model_here():
    """The fp8 stage's probe child at the tiny sizes, without TE (no FP8): LEV's output and parameters in bf16, no
    decoder verdict without FP8. It once called the bench's model builder with stale arguments and failed on
    every device before its check ran. In a process of its own: the probe sets megatron's groups up."""
    code = textwrap.dedent("""
        import json, sys
        from types import SimpleNamespace
        sys.path.insert(0, "bench")
        import gpu_program_te as te
        te.te_ready = lambda ctx: False
        print(json.dumps(te.child_fp8_probe(SimpleNamespace(device="cpu", size=te.SIZES["tiny"]), None)))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["stays_out_of_fp8"] and got["lev_output_dtype"] == "torch.bfloat16", got
    assert got["fp8"] is None and got["decoder_layers_in_fp8"] is None and got["decoder_layer_calls"] == 0


def test_the_plan_fits_one_window_with_the_carrying_calls(te, capsys, tmp_path):
    import _carry
    import gpu_check

    assert gpu_check.main(["--program", "te", "--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    m = re.match(r"window: 900 s of device time: machine start (\d+) s, (\d+) calls x (\d+) s = (\d+) s .*"
                 r"the install stage (\d+) s in the last carrying call, the other stages (\d+) s; (-?\d+) s left", lines[0])
    assert m, lines[0]
    start, calls, per_call, calls_s, install, run, left = map(int, m.groups())
    stages = {g[0]: int(g[1]) for g in (re.match(r"stage (\w+): planned (\d+) s", x).groups() for x in lines
                                        if x.startswith("stage "))}
    assert list(stages) == ["install", "env", "correctness", "fp8", "speed", "checkpoint"]
    assert stages["install"] == install and sum(stages.values()) <= install + run - te.RESERVE_S + len(stages)
    assert start + calls_s + install + run + left == 900 and left >= 60  # room to give the machine back
    # The calls come from the pieces' manifest when bench/prepare_te.py has written one.
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.whl").write_bytes(os.urandom(3000))
    _carry.split(src, tmp_path / "carry", "te", piece_bytes=1024)
    w = te.window(te.BUDGET_S, tmp_path / "carry")
    assert w["carry_calls"] == len(_carry.read_manifest(tmp_path / "carry", "te")["pieces"]) >= 3
    assert w["left_s"] == 900 - te.MACHINE_START_S - (w["carry_calls"] + 1) * te.CALL_S - te.BUDGET_S


def _run(losses, grads, exit=0, loaded=True):
    return {"exit": exit, "iterations": len(losses), "losses": losses, "grad_norms": grads, "loaded": loaded}


def test_correctness_compares_te_and_local_from_the_same_checkpoint(te):
    runs = {}
    for arm in te.ARMS:
        runs[f"{arm}_save"] = _run([10.9], [3.0], loaded=False)
        runs[f"{arm}_local"] = _run([10.80, 10.6], [2.50, 2.2])
        runs[f"{arm}_te"] = _run([10.82, 10.6], [2.55, 2.2])
    fig = te.judge_correctness(runs, 2)
    assert fig["agreement"]["lev"]["loss_gap"] == pytest.approx(0.02 / 10.80)
    runs["tied_te"] = _run([10.95, 10.6], [2.5, 2.2])  # 1.4% off: a wrong layer, not rounding
    with pytest.raises(te.CheckFailed, match=r"tied: first loss TE \(10.95, 10.8\)"):
        te.judge_correctness(runs, 2)
    runs["tied_te"] = _run([10.80, 10.6], [2.5, 2.2], loaded=False)
    with pytest.raises(te.CheckFailed, match="tied_te: did not load the saved checkpoint"):
        te.judge_correctness(runs, 2)


def test_the_fp8_gap_is_over_the_last_tenth_of_the_common_iterations(te):
    bf16 = [10.0 - 0.01 * i for i in range(100)]
    fp8 = [x * 1.005 for x in bf16[:95]]  # killed 5 iterations short
    g = te.last_tenth_gap(fp8, bf16)
    assert g["iterations"] == 95 and g["last"] == 9 and g["gap"] == pytest.approx(0.005)
    assert te.last_tenth_gap([], bf16) is None


def test_flops_per_token_counts_the_shapes_own_ffn_and_vocabulary(te):
    from throughput import CONFIGS

    pile = CONFIGS["pile-400m"]
    assert te.flops_per_token(pile) < te.flops_per_token(dict(pile, ffn=4 * pile["hidden"]))
    assert te.flops_per_token(pile) > te.flops_per_token(dict(pile, vocab=50304))


@pytest.mark.gpu_program
@pytest.mark.slow
def test_every_stage_runs_at_the_tiny_sizes_without_te_and_skips_tes_runs(tmp_path):
    """The CPU stands in for the device; TE is not installed here, so what needs it is skipped with
    "no TE" and its command lines reported, and everything else runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--program", "te", "--out", str(tmp_path / "out"),
                        "--sizes", "tiny", "--budget-s", "48000", "--wheels", str(tmp_path / "none")],
                       capture_output=True, text=True, cwd=str(REPO), env=env, timeout=1800)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    status = {s["name"]: (s["status"], s["reason"]) for s in report["stages"]}
    assert status == {"install": ("ok", ""), "env": ("ok", ""), "correctness": ("skipped", "no TE"), "fp8": ("skipped", "no TE"),
                      "speed": ("skipped", "no TE"), "checkpoint": ("skipped", "no TE")}, (status, r.stderr[-3000:])
    assert r.returncode == 0 and report["program"] == "te" and report["state"] == "done"
    f = {s["name"]: s["figures"] for s in report["stages"]}
    assert f["env"]["te_pytorch"] is False and "te_error" in f["env"]
    c = f["correctness"]
    assert {n: (r["exit"], r["iterations"], r["loaded"]) for n, r in c["runs"].items()} == {
        "lev_save": (0, 1, False), "lev_local": (0, 2, True)}  # one arm at the tiny sizes
    assert set(c["not_run"]) == {"lev_te"}
    assert all("--transformer-impl transformer_engine" in cmd and "--load" in cmd for cmd in c["not_run"].values())
    p = f["fp8"]
    assert p["runs"]["bf16"]["iterations"] == 10 and set(p["not_run"]) == {"fp8_delayed", "fp8_tensorwise"}
    assert "--fp8-format hybrid --fp8-recipe tensorwise" in p["not_run"]["fp8_tensorwise"]
    assert p["lev_layer"]["stays_out_of_fp8"] and p["lev_layer"]["lev_output_dtype"] == "torch.bfloat16"
    s = f["speed"]["shapes"]["tiny"]
    assert set(s) == {"bf16"} and set(s["bf16"]["arms"]) == {"tied", "untied", "lev"}
    assert all(a["tflops"] > 0 for a in s["bf16"]["arms"].values())
    assert set(f["checkpoint"]["not_run"]) == {"te_save", "local_from_te", "te_from_te"}
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: program te") and "| fp8 | skipped |" in md and "no TE or FP8 figure" in md
    assert "`pretrain_lev.py" in md  # the command lines each skipped run would run
