"""bench/gpu_check.py on the CPU: its plan (the science stage's share and sizing, the kernel stage's
variants and shapes), the budget it enforces (fake clock), the report rewritten after every stage and
kept when the run is killed, the judgements of its stages, the profiler-trace summary, and one run of
every stage end to end at the tiny sizes (the CPU stands in for the device)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.bench import BENCH, REPO, bench_module


@pytest.fixture(scope="module")
def gc():
    return bench_module("gpu_check")


@pytest.fixture(scope="module")
def sci(gc):
    import gpu_science

    return gpu_science


def _ctx(gc, tmp_path, **kw):
    args = dict(out=str(tmp_path / "out"), work=str(tmp_path / "work"), wheels=None, shared_data=str(tmp_path),
                sizes="device", cuda=True)
    args.update(kw)
    (tmp_path / "work" / "logs").mkdir(parents=True, exist_ok=True)
    return gc.Ctx(**args)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# -------------------------------------------------------------------------------- arguments and plan


def test_arguments(gc, capsys, tmp_path):
    a = gc.parse_args(["--out", "x", "--wheels", str(tmp_path)])
    assert a.stages == list(gc.NAMES) and a.budget_s == 400 and a.sizes == "device"
    assert gc.parse_args(["--out", "x", "--only", "science,env"]).stages == ["env", "science"]
    assert "science" not in gc.parse_args(["--out", "x", "--skip", "science"]).stages
    assert gc.parse_args(["--plan"]).plan
    for bad, msg in ((["--out", "x", "--only", "nope"], "unknown stage(s) ['nope']"),
                     (["--out", "x", "--budget-s", "0"], "--budget-s must be a positive number"),
                     (["--out", "x", "--budget-s", "4"], "--budget-s 4 leaves nothing"),
                     (["--plan", "--assume-tflops", "-1"], "--assume-tflops must be a positive number"),
                     ([], "--out DIR is required")):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    for name in ("megatron_core-0.16.1-cp312-cp312-any.whl", "megatron_core-0.19.2-cp312-cp312-any.whl"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(SystemExit):  # pip would refuse two versions of one package: say so before any stage
        gc.parse_args(["--out", "x", "--wheels", str(tmp_path)])
    assert "several wheels of megatron-core (megatron_core-0.16.1" in capsys.readouterr().err


def test_the_stages_are_in_the_order_of_what_their_figures_are_worth(gc):
    assert gc.NAMES == ("env", "correctness", "kernels", "throughput", "profile", "science")


PLAN_RE = re.compile(r"^stage (\w+): planned (\d+) s(.*)$")


def _plan(gc, capsys, *args):
    assert gc.main(["--plan", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    stages = {m.group(1): (int(m.group(2)), m.group(3)) for m in map(PLAN_RE.match, lines) if m}
    return lines, stages


def test_the_plan_gives_the_science_stage_200_s_of_400_and_its_tokens(gc, sci, capsys):
    counts = {}
    for tflops in (150, 250, 400):
        lines, stages = _plan(gc, capsys, "--budget-s", "400", "--assume-tflops", str(tflops))
        assert list(stages) == list(gc.NAMES)
        assert sum(s for s, _ in stages.values()) <= 400 - gc.RESERVE_S + len(stages)  # rounding
        seconds, rest = stages["science"]
        assert seconds >= 200
        m = re.match(r"^, (\d+) tokens per arm \((\d+) iterations", rest)
        assert m, rest
        counts[tflops] = int(m.group(1))
    shape = sci.model_shape("gpu-science")
    assert 0 < counts[150] < counts[250] <= counts[400]  # sized by the rate, whole iterations
    assert all(n % (shape["global_batch"] * shape["seq"]) == 0 for n in counts.values())


def test_the_plan_holds_kernel_only_timing_of_both_backwards_at_several_partitions(gc, capsys):
    """Findings 4 and 5: the fused product alone with CUDA events, every backward variant, and a shape whose
    reference backward runs over several id partitions, besides the defaults (one)."""
    from megatron_lev.kernels import lev_triton

    _, stages = _plan(gc, capsys, "--budget-s", "400")
    what = stages["kernels"][1]
    assert "alone with CUDA events" in what
    for variant in lev_triton.BACKWARD_VARIANTS:
        assert variant in what.split(" at ")[0], what
    parts = [int(n) for n in re.findall(r"backward partitions: reference (\d+)", what)]
    assert 1 in parts and max(parts) > 1, what
    assert "tokens per arm sized from the throughput stage" in stages["science"][1]


def test_stage_limits_follow_the_budget_and_the_science_stage_gets_the_rest(gc):
    s = gc.stage_seconds(400)
    assert s["science"] == 400 - gc.RESERVE_S - sum(gc.BASE_S.values()) and s["science"] >= 200
    s2 = gc.stage_seconds(800)
    assert s2["correctness"] == 2 * s["correctness"] and s2["science"] > 2 * s["science"]


DEMO_PROGRAM = """
from gpu_check import Stage

def _one(ctx, limit):
    return {"limit": limit, "program": ctx.program, "n": ctx.size["n"]}

STAGES = (Stage("alpha", _one, cuda=False), Stage("beta", _one, cuda=False))
SIZES = {"device": {"n": 100}, "tiny": {"n": 1}}
BUDGET_S = 60.0

def plan(budget_s, sizes, assume_tflops, shared_data):
    return [{"name": "alpha", "planned_s": budget_s / 2 - 5, "what": f"alpha at n={SIZES[sizes]['n']}"},
            {"name": "beta", "planned_s": budget_s / 2, "what": "beta"}]

MARKDOWN = {"alpha": lambda f: [f"alpha ran at n={f['n']}"]}
"""


def test_a_program_is_a_module_with_stages_and_a_plan_registered_by_name(gc, capsys, tmp_path, monkeypatch):
    """--program NAME: its stages, plan, sizes, budget and report sections; --only/--skip against its stages."""
    (tmp_path / "gpu_program_demo.py").write_text(DEMO_PROGRAM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(gc.PROGRAMS, "demo", "gpu_program_demo")
    lines, stages = _plan(gc, capsys, "--program", "demo", "--sizes", "tiny")
    assert stages == {"alpha": (25, " - alpha at n=1"), "beta": (30, " - beta")}
    assert lines[0].startswith("plan: budget 60 s at the tiny sizes")
    out = tmp_path / "out"
    assert gc.main(["--program", "demo", "--out", str(out), "--sizes", "tiny", "--skip", "beta"]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["program"] == "demo" and report["budget_s"] == 60 and report["plan"] == {"alpha": 25, "beta": 30}
    assert [(c["name"], c["status"], c["limit_s"], c["figures"]) for c in report["stages"]] == [
        ("alpha", "ok", 25, {"limit": 25.0, "program": "demo", "n": 1})]
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: program demo") and "alpha ran at n=1" in md
    for bad, msg in ((["--only", "env"], "unknown stage(s) ['env'] of program demo; choose from alpha,beta"),
                     (["--sizes", "huge"], "--sizes huge: program demo has the sizes device,tiny"),
                     (["--budget-s", "9"], "--budget-s 9 leaves nothing")):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(["--program", "demo", "--out", "x", *bad])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gc.parse_args(["--program", "nope", "--plan"])
    assert "argument --program: invalid choice: 'nope'" in capsys.readouterr().err


def test_without_program_the_default_program_runs_and_plans_as_before(gc, capsys):
    assert gc.PROGRAMS["default"] == "gpu_check" and gc.load_program("default").names == gc.NAMES
    plain, _ = _plan(gc, capsys, "--assume-tflops", "250")
    named, _ = _plan(gc, capsys, "--program", "default", "--assume-tflops", "250")
    assert plain == named and plain[0].startswith("plan: budget 400 s at the device sizes")
    assert gc.parse_args(["--out", "x"]).budget_s == gc.PLAN_BUDGET_S


# -------------------------------------------------------------------------------- the runner


def test_budget_bounds_each_stage_by_its_limit_and_what_is_left(gc, tmp_path):
    clock, seen = FakeClock(), {}

    def work(seconds):
        def run(ctx, limit):
            seen[len(seen)] = limit
            clock.t += seconds
            return {"took": seconds}
        return run

    limits = gc.stage_seconds(100 + gc.RESERVE_S)
    stages = [gc.Stage("env", work(limits["env"] + 50), cuda=False),  # overran its limit (a fake clock)
              gc.Stage("correctness", work(1), cuda=False),
              gc.Stage("kernels", work(1), cuda=True),
              gc.Stage("science", work(1), cuda=False)]
    res = gc.run_stages(stages, _ctx(gc, tmp_path, cuda=False), 100 + gc.RESERVE_S, clock=clock, log=lambda m: None)
    status = {r["name"]: (r["status"], r["reason"]) for r in res}
    assert seen[0] == pytest.approx(limits["env"]) and seen[1] == pytest.approx(limits["correctness"])
    assert status["kernels"] == ("skipped", "no CUDA device")
    left = 100 - (limits["env"] + 50) - 1
    assert seen[2] == pytest.approx(left)  # science: all that is left, not its planned share
    assert res[0]["planned_s"] == round(limits["env"])

    clock.t, seen = 0.0, {}
    res = gc.run_stages([gc.Stage("env", work(200), cuda=False), gc.Stage("correctness", work(1), cuda=False)],
                        _ctx(gc, tmp_path, cuda=False), 100 + gc.RESERVE_S, clock=clock, log=lambda m: None)
    assert res[1]["status"] == "skipped" and res[1]["reason"] == "budget: 0 s left"


def test_stage_failures_are_reported_with_their_figures(gc, tmp_path):
    def slow(ctx, limit):
        raise gc.CheckTimeout(limit, {"rows_done": 3}, "last words")

    def bad(ctx, limit):
        raise gc.CheckFailed("arms disagree", {"lev": {"exit": 1}})

    def crashed(ctx, limit):
        raise KeyError("x")

    stages = [gc.Stage(n, f, cuda=False) for n, f in (("env", slow), ("correctness", bad), ("kernels", crashed))]
    res = gc.run_stages(stages, _ctx(gc, tmp_path), 400, log=lambda m: None)
    slow_, bad_, crashed_ = res
    assert slow_["status"] == "failed" and slow_["reason"].startswith("timeout: killed after")
    assert slow_["figures"] == {"rows_done": 3} and slow_["log_tail"] == "last words"
    assert bad_["reason"] == "arms disagree" and bad_["figures"] == {"lev": {"exit": 1}}
    assert crashed_["status"] == "failed" and crashed_["reason"] == "KeyError: 'x'"


def test_the_report_is_on_disk_and_valid_after_every_stage(gc, tmp_path, monkeypatch):
    out = tmp_path / "out"
    seen_on_disk = []

    def look(ctx, limit):
        report = json.loads((out / "gpu_check.json").read_text())
        seen_on_disk.append([(c["name"], c["status"]) for c in report["stages"]])
        if len(seen_on_disk) == 2:
            raise RuntimeError("boom")
        return {"n": len(seen_on_disk)}

    monkeypatch.setattr(gc, "STAGES", tuple(gc.Stage(n, look, cuda=False) for n in ("env", "correctness", "kernels")))
    code = gc.main(["--out", str(out), "--only", "env,correctness,kernels", "--wheels", str(tmp_path / "none")])
    assert code == 1
    assert seen_on_disk == [[], [("env", "ok")], [("env", "ok"), ("correctness", "failed")]]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["state"] == "done" and [c["status"] for c in report["stages"]] == ["ok", "failed", "ok"]
    assert report["plan"]["science"] >= 200
    md = (out / "gpu_check.md").read_text()
    assert "| correctness | failed |" in md and "RuntimeError: boom" in md
    assert not list(out.glob("*.tmp"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_at_the_device_sizes_without_cuda_every_stage_but_env_is_skipped(gc, tmp_path, monkeypatch):
    stages = tuple(gc.Stage(s.name, (lambda ctx, limit: {"python": "3"}) if s.name == "env" else s.run, s.cuda)
                   for s in gc.STAGES)
    monkeypatch.setattr(gc, "STAGES", stages)
    assert gc.main(["--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "none")]) == 0
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [(c["name"], c["status"], c["reason"]) for c in report["stages"]] == [("env", "ok", "")] + [
        (n, "skipped", "no CUDA device") for n in gc.NAMES[1:]]
    assert "No CUDA device: every stage but env was skipped." in (tmp_path / "out" / "gpu_check.md").read_text()


def test_a_killed_run_keeps_what_it_learnt(tmp_path):
    """The run is killed (SIGKILL) inside its second stage: the first stage's result is on disk."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(BENCH)!r})
        import gpu_check as gc
        def ok(ctx, limit):
            return {{"measured": 1.5}}
        def die(ctx, limit):
            os.kill(os.getpid(), signal.SIGKILL)
        gc.STAGES = (gc.Stage("env", ok, cuda=False), gc.Stage("correctness", die, cuda=False),
                     gc.Stage("kernels", ok, cuda=False))
        gc.main(["--out", {str(tmp_path / "out")!r}, "--only", "env,correctness,kernels", "--wheels", {str(tmp_path)!r}])
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=str(REPO))
    assert r.returncode == -9, r.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["state"] == "running" and report["pending"] == ["correctness", "kernels"]
    assert [(c["name"], c["status"], c["figures"]) for c in report["stages"]] == [("env", "ok", {"measured": 1.5})]
    assert "| env | ok |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_a_subprocess_past_its_timeout_is_killed_with_its_children(gc, tmp_path):
    import _check_harness as harness

    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
            " print('child', p.pid, flush=True); time.sleep(300)")
    rc, output = harness.run_logged([sys.executable, "-c", code], 3, tmp_path / "log")
    assert rc == harness.TIMEOUT_RC and "child" in output
    pid = int(re.search(r"^child (\d+)$", output, re.M).group(1))
    state = Path(f"/proc/{pid}/status")

    def dead():  # gone, or dead and not yet reaped
        try:
            return "State:\tZ" in state.read_text()
        except FileNotFoundError:
            return True

    # SIGKILL is delivered asynchronously: on a loaded machine the child can still show as running for a
    # moment after its group was killed.
    deadline = time.monotonic() + 10
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dead(), state.read_text()
    rc, output = harness.run_logged([sys.executable, "-c", "print('again')"], None, tmp_path / "log", append=True)
    assert rc == 0 and output.strip().endswith("again") and "child" not in output  # this command's output only
    assert "child" in (tmp_path / "log").read_text()


def test_the_check_and_the_science_run_do_not_import_each_other():
    """Both take the harness from bench/_check_harness.py; the science run imports nothing of the check."""

    def imports(path):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module)
        return names

    science = imports(BENCH / "gpu_science.py")
    assert "gpu_check" not in science and "_check_harness" in science
    check = imports(BENCH / "gpu_check.py")
    assert "_check_harness" in check
    assert "sys.modules" not in (BENCH / "gpu_check.py").read_text()


# -------------------------------------------------------------------------------- stage judgements


def _run(losses, grads, exit=0):
    return {"exit": exit, "iterations": len(losses), "losses": losses, "grad_norms": grads}


def test_correctness_needs_the_fused_and_eager_first_iterations_to_agree(gc):
    runs = {"lev_triton": _run([10.90, 10.5, 10.1], [3.241, 2.0, 1.5]),
            "lev_sparse": _run([10.9001, 10.5, 10.1], [3.2415, 2.0, 1.5]),
            "tied": _run([10.95, 10.6, 10.3], [2.5, 2.0, 1.8])}
    fig = gc.judge_correctness(runs, "triton", "sparse", 3)
    assert fig["agreement"]["grad_norm_gap"] == pytest.approx(0.0005 / 3.2415)
    runs["lev_triton"] = _run([10.90, 10.5, 10.1], [0.812, 2.0, 1.5])  # gradients lost on one path
    with pytest.raises(gc.CheckFailed, match=r"first grad norm triton 0.812 vs sparse 3.2415") as e:
        gc.judge_correctness(runs, "triton", "sparse", 3)
    assert e.value.figures["runs"]["tied"]["losses"][0] == 10.95
    runs["lev_triton"] = _run([10.90, 10.5], [3.241, 2.0])
    runs["tied"] = _run([10.95, float("nan"), 10.3], [2.5, 2.0, 1.8])
    with pytest.raises(gc.CheckFailed) as e:
        gc.judge_correctness(runs, "triton", "sparse", 3)
    assert "lev_triton: 2 of 3 iterations recorded" in str(e.value) and "tied: non-finite" in str(e.value)


def test_correctness_runs_share_every_flag_but_the_arm_and_basis(gc, tmp_path):
    ctx = _ctx(gc, tmp_path)
    ctx.results = {"env": {"status": "ok", "figures": {"lev_basis": "triton"}}}
    runs = gc.correctness_runs(ctx)
    assert list(runs) == ["lev_triton", "lev_sparse", "tied"]
    for argv in runs.values():
        assert {"--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"} <= set(argv)
    strip = [a for a in runs["lev_triton"] if a not in ("triton",)]
    assert strip == [a for a in runs["lev_sparse"] if a != "sparse"]
    assert runs["lev_triton"][runs["lev_triton"].index("--lev-basis") + 1] == "triton"
    ctx.results = {"env": {"status": "ok", "figures": {"lev_basis": "sparse"}}}  # no fused kernel here
    assert list(gc.correctness_runs(ctx)) == ["lev_sparse", "lev_dense", "tied"]
    ctx.results = {}
    with pytest.raises(gc.Skip, match="did not say which LEV basis"):
        gc.correctness_runs(ctx)


def _log_lines(ms, grad=1.0):
    from megatron_lev.training.logger import TrainingLogger

    return "\n".join(TrainingLogger.training_line(
        None, iteration=i + 1, train_iters=len(ms), consumed_samples=8 * (i + 1), consumed_tokens=4096 * (i + 1),
        ms_per_iter=m, lr=1e-4, global_batch_size=8, losses={"lm loss": 10.0 - i}, loss_scale=1.0, grad_norm=grad,
        skipped=0, nan=0, tokens_per_s=4096 / m * 1e3, tflops_per_device=m / 10, mfu=None) for i, m in enumerate(ms))


def test_training_figures_come_from_the_log_lines_and_the_metrics_file(gc, tmp_path):
    ms = [900.0, 300.0] + [100.0 + i for i in range(8)]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"kind": "train", "iteration": i + 1, "lm loss": 10.9 - 0.2 * i,
                                           "grad norm": 2.0}) + "\n" for i in range(10)))
    fig = gc.parse_training(_log_lines(ms), metrics)
    assert fig["iterations"] == 10 and fig["losses"][0] == 10.9 and fig["grad_norms"] == [2.0] * 10
    assert fig["median_ms"] == pytest.approx(sorted(ms[2:])[4] / 2 + sorted(ms[2:])[3] / 2)  # after the warm-up two
    assert fig["median_tflops"] == pytest.approx(fig["median_ms"] / 10)
    assert fig["total_step_s"] == pytest.approx(sum(ms) / 1e3)


def test_the_science_run_is_sized_from_the_rates_and_capped_by_one_pass(sci):
    shape = sci.model_shape("gpu-science")
    per_iter = shape["global_batch"] * shape["seq"]
    rates = {"tied": 6e5, "untied": 6e5, "lev": 3e5}
    p = sci.plan(205, rates, 10**9, "gpu-science")
    train = (205 - sum(sci.OVERHEAD_S.values())) * sci.TRAIN_SAFETY
    assert p["train_s"] == pytest.approx(train) and p["limited_by"] == "time"
    assert p["iterations"] == int(train / (1 / 6e5 + 1 / 6e5 + 1 / 3e5) // per_iter)  # the arms share the device
    assert p["tokens_per_arm"] == p["iterations"] * per_iter
    capped = sci.plan(205, {a: 1e8 for a in sci.ARMS}, 3 * per_iter + 5, "gpu-science")
    assert capped["iterations"] == 3 and capped["limited_by"] == "one pass over the corpus"
    assert sci.plan(205, rates, 10**9, "gpu-science", max_iters=2)["iterations"] == 2
    assert sci.plan(10, rates, 10**9, "gpu-science")["iterations"] == 0
    with pytest.raises(sci.Skip, match=r"no tokens/s for \['lev'\]"):
        sci.plan(205, {"tied": 1.0, "untied": 1.0}, 10**9, "gpu-science")
    assumed = sci.assumed_rates("gpu-science", 250)
    assert assumed["tied"] == pytest.approx(250e12 / sci.flops_per_token(shape))
    assert assumed["lev"] == pytest.approx(assumed["tied"] / sci.LEV_OVER_TIED_ASSUMED)


def test_the_science_figures_read_the_evaluation_buckets(sci):
    def row(arm, ppls):
        buckets = [{"bucket": b, "tokens": n, "ppl": p} for (b, n), p in zip((("< 1e-5", 10), (">= 1e-5", 90)), ppls)]
        return {"arm": arm, "eval": {"perplexity": {"valid": {"ppl": ppls[1], "frequency_buckets": buckets}}}}

    rows = [row("tied", (200.0, 50.0)), row("untied", (180.0, 48.0)), row("lev", (150.0, 49.0))]
    buckets = sci.frequency_buckets(rows)
    assert buckets[0] == {"bucket": "< 1e-5", "tokens": 10, "ppl": {"tied": 200.0, "untied": 180.0, "lev": 150.0}}
    md = "\n".join(sci.markdown({"description": "d", "steps": {"preprocess": {"seconds": 1.0, "ok": True}},
                                 "buckets": buckets}))
    assert "| < 1e-5 | 10 | 200.00 | 180.00 | 150.00 | -25.0% | -16.7% |" in md and "- preprocess: 1.0 s" in md


# -------------------------------------------------------------------------------- the profiler trace


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_the_trace_summary_splits_a_step_into_lev_kernels_lev_gemms_and_the_rest(gc, tmp_path):  # gc: bench/ on sys.path
    import _profile_trace as pt

    ev = []
    for step, t in enumerate((0.0, 1000.0)):
        ev.append(_x(f"ProfilerStep#{step + 3}", "user_annotation", t, 1000.0))
        # On CUDA kineto also draws each step on the GPU's timeline (the H200 run counted 4 steps for 2)
        ev.append(_x(f"ProfilerStep#{step + 3}", "gpu_user_annotation", t + 30, 900.0, tid=7))
        ev.append(_x("aten::mm", "cpu_op", t + 10, 50, **{"Input type": ["float", "float"]}))  # LEV's fp32 projection
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", t + 20, 5, correlation=10 * step + 1))
        ev.append(_x("sm90_xmma_gemm_f32", "kernel", t + 30, 100, tid=7, correlation=10 * step + 1))
        ev.append(_x("aten::linear", "cpu_op", t + 100, 80))
        ev.append(_x("aten::mm", "cpu_op", t + 110, 50, **{"Input type": ["c10::BFloat16", "c10::BFloat16"]}))
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", t + 120, 5, correlation=10 * step + 2))
        ev.append(_x("sm90_gemm_bf16", "kernel", t + 130, 300, tid=7, correlation=10 * step + 2))
        ev.append(_x("cuLaunchKernelEx", "cuda_driver", t + 200, 5, correlation=10 * step + 3))
        ev.append(_x("_bwd_grouped_kernel", "kernel", t + 430, 200, tid=7, correlation=10 * step + 3))
        ev.append(_x("aten::_scaled_dot_product_flash_attention", "cpu_op", t + 300, 20))
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", t + 305, 5, correlation=10 * step + 4))
        ev.append(_x("pytorch_flash::flash_fwd_kernel", "kernel", t + 630, 100, tid=7, correlation=10 * step + 4))
        ev.append(_x("megatron_lev.log", "user_annotation", t + 790, 60))  # the loop's span
        ev.append(_x("aten::item", "cpu_op", t + 795, 40))
        ev.append(_x("aten::_local_scalar_dense", "cpu_op", t + 800, 30))
        ev += [_x("cudaStreamSynchronize", "cuda_runtime", t + 805 + i, 1) for i in range(3)]
        # a sync in the backward, on the autograd thread
        ev.append(_x("autograd::engine::evaluate_function: IndexBackward0", "cpu_op", t + 850, 20, tid=2))
        ev.append(_x("aten::nonzero", "cpu_op", t + 852, 10, tid=2))
        ev.append(_x("cudaMemcpy", "cuda_runtime", t + 855, 1, tid=2))
    path = tmp_path / "host_1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    assert pt.find_trace(tmp_path) == str(path)
    f = pt.summarize(str(path))
    assert f["timeline"] == "cuda kernels" and f["steps"] == 2 and f["step_ms"] == pytest.approx(1.0)
    ms = f["ms_per_step"]
    assert ms["lev_gemm"] == pytest.approx(0.1) and ms["other"] == pytest.approx(0.3)
    assert ms["lev_triton"] == pytest.approx(0.2) and ms["attention"] == pytest.approx(0.1)
    assert ms["idle"] == pytest.approx(0.3) and f["share"]["lev_triton"] == pytest.approx(0.2)
    assert f["host_syncs_per_step"] == 4 and f["scalar_reads_per_step"] == 1
    assert f["syncs_by_place"] == [{"place": "megatron_lev.log / aten::_local_scalar_dense", "per_step": 3},
                                   {"place": "backward of IndexBackward0 / aten::nonzero", "per_step": 1}]
    assert f["scalar_reads_by_place"] == [{"place": "megatron_lev.log / aten::item", "per_step": 1}]
    with pytest.raises(ValueError, match="no ProfilerStep# spans"):
        pt.summarize({"traceEvents": ev[1:2]})


def test_the_trace_summary_puts_each_kernel_in_a_part_of_the_step_and_a_loop_span(gc):
    """RoPE and the cross-entropy by the project's named ranges, the optimizer by the loop's span, LEV by its
    kernels, the backward by autograd's thread (outside the loop's ranges on CUDA)."""
    import _profile_trace as pt

    ev, corr = [_x("ProfilerStep#3", "user_annotation", 0.0, 1000.0)], iter(range(1, 100))

    def launched(t, kernel, dur, *ranges, tid=1):
        c = next(corr)
        ev.extend(_x(r, "user_annotation" if r.startswith("megatron_lev") else "cpu_op", t - 2, 20, tid=tid)
                  for r in ranges)
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", t, 5, tid=tid, correlation=c))
        ev.append(_x(kernel, "kernel", t + 500, dur, tid=7, correlation=c))

    ev.append(_x("megatron_lev.forward_backward", "user_annotation", 10, 400))
    launched(20, "elementwise_kernel", 10, "megatron_lev.rope")
    launched(60, "_fwd_kernel", 30)
    launched(100, "reduce_kernel", 20, "megatron_lev.cross_entropy")
    launched(140, "elementwise_kernel", 5, "autograd::engine::evaluate_function: _RotaryPosEmbBackward", tid=2)
    launched(180, "sm90_gemm_bf16", 40, "autograd::engine::evaluate_function: MmBackward0", "aten::mm", tid=2)
    ev.append(_x("megatron_lev.optimizer", "user_annotation", 420, 100))
    launched(430, "multi_tensor_apply_kernel", 15)
    f = pt.summarize({"traceEvents": ev})
    us = {k: round(v * 1e3) for k, v in f["parts_ms_per_step"].items()}
    assert us == {"lev": 30, "rope": 15, "cross_entropy": 20, "optimizer": 15, "attention": 0, "other": 40}
    assert f["parts_items_per_step"]["rope"] == 2
    spans = {k: round(v * 1e3) for k, v in f["spans_ms_per_step"].items()}
    assert spans == {"forward_backward": 60, "backward": 45, "optimizer": 15}


def test_the_trace_summary_puts_torchs_own_cross_entropy_backward_in_the_cross_entropy(gc):
    """F.cross_entropy's backward runs as NllLossBackward0 and LogSoftmaxBackward0 nodes on autograd's thread,
    outside the forward's megatron_lev.cross_entropy range; the project's fused loss as _LinearCrossEntropy's."""
    import _profile_trace as pt

    ev = [_x("ProfilerStep#3", "user_annotation", 0.0, 1000.0)]
    kernels = [("NllLossBackward0", "nll_loss_backward_reduce_cuda_kernel_2d", 10),
               ("LogSoftmaxBackward0", "cunn_SoftMaxBackward", 20),
               ("_LinearCrossEntropyBackward", "elementwise_kernel", 40),
               ("MmBackward0", "sm90_gemm_bf16", 80)]
    for c, (node, kernel, dur) in enumerate(kernels, start=1):
        t = 100.0 * c
        ev.append(_x(f"autograd::engine::evaluate_function: {node}", "cpu_op", t - 2, 20, tid=2))
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", t, 5, tid=2, correlation=c))
        ev.append(_x(kernel, "kernel", t + 500, dur, tid=7, correlation=c))
    us = {k: round(v * 1e3) for k, v in pt.summarize({"traceEvents": ev})["parts_ms_per_step"].items()}
    assert us["cross_entropy"] == 70 and us["other"] == 80, us


def test_the_trace_summary_knows_the_lev_kernels_by_their_names(gc):
    import _profile_trace as pt

    source = (REPO / "megatron_lev" / "kernels" / "lev_triton.py").read_text()
    kernels = set(re.findall(r"@triton\.jit\s+def (\w+_kernel)\(", source))
    assert kernels == set(pt.LEV_KERNELS)


# -------------------------------------------------------------------------------- preparing and markers


def test_prepare_data_copies_what_the_stages_read(gc, tmp_path):
    src = tmp_path / "shared"
    for f in gc.DATA_FILES:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes(b"data of " + f.encode())
    assert gc.prepare_data(str(tmp_path / "carry"), str(src)) == 0
    for f in gc.DATA_FILES:
        assert (tmp_path / "carry" / f).read_bytes() == (src / f).read_bytes()
    (src / gc.DATA_FILES[0]).unlink()
    assert gc.prepare_data(str(tmp_path / "carry2"), str(src)) == 1


def _marks(fn: ast.FunctionDef) -> set:
    return {d.attr for d in fn.decorator_list if isinstance(d, ast.Attribute)} | {
        d.func.attr for d in fn.decorator_list if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)}


def test_gpu_tests_that_need_transformer_engine_are_marked_te():
    """``pytest -m "gpu and not te"`` on a GPU without TE must not select a test that fails without TE."""
    needing_te = []
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "gpu" in _marks(node):
                body = ast.unparse(node)
                if "te_available" in body or "transformer_engine" in body:
                    needing_te.append((path.name, node.name, "te" in _marks(node)))
    assert ("test_te_layout.py", "test_te_spec_checkpoint_and_local_spec_checkpoint_swap_on_gpu", True) in needing_te
    assert all(marked for _, _, marked in needing_te), needing_te


# -------------------------------------------------------------------------------- every stage, tiny


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of the whole check at the tiny sizes on this machine's CPU (no device), as a subprocess."""
    shared = Path(os.environ.get("MEGATRON_LEV_SHARED_DATA", REPO.parent / "shared" / "data"))
    if not (shared / "tokenizers" / "gpt2").is_dir():
        pytest.skip(f"real-data check: the science stage reads the GPT-2 tokenizer and corpus under {shared}")
    root = tmp_path_factory.mktemp("gpu_check_tiny")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the check chooses it per stage
    # The stage limits are in proportion to the budget: a large one keeps a loaded CPU from reaching them
    # (the tiny sizes bound the work; the science run is capped at 3 iterations).
    r = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--out", str(root / "out"), "--sizes", "tiny",
                        "--budget-s", "40000", "--wheels", str(root / "none"), "--shared-data", str(shared)],
                       capture_output=True, text=True, cwd=str(REPO), env=env, timeout=3600)
    report = json.loads((root / "out" / "gpu_check.json").read_text())
    return r, report, root / "out"


@pytest.mark.gpu_program
@pytest.mark.slow
@pytest.mark.real_data
def test_every_stage_runs_end_to_end_at_the_tiny_sizes(gc, tiny_run):
    r, report, out = tiny_run
    status = {s["name"]: (s["status"], s["reason"]) for s in report["stages"]}
    assert status == {n: ("ok", "") for n in gc.NAMES}, (status, r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0 and report["state"] == "done"
    f = {s["name"]: s["figures"] for s in report["stages"]}
    basis = f["env"]["lev_basis"]
    assert f["correctness"]["fused"] == basis and set(f["correctness"]["runs"]) == {
        f"lev_{basis}", f"lev_{'dense' if basis == 'sparse' else 'sparse'}", "tied"}
    assert f["correctness"]["agreement"]["grad_norm_gap"] <= gc.GRAD_NORM_RTOL
    from megatron_lev.kernels import lev_triton

    assert {r["variant"] for r in f["kernels"]["timings"]} == set(lev_triton.BACKWARD_VARIANTS)
    assert all(r["ok"] for r in f["kernels"]["errors"]) and max(r["partitions"] for r in f["kernels"]["timings"]) > 1
    science_shape = next(iter(f["throughput"]["shapes"].values()))
    assert set(science_shape["arms"]) == {"tied", "untied", "lev"} and science_shape["lev_over_untied"] > 0
    assert f["profile"]["steps"] == 2 and f["profile"]["scalar_reads_per_step"] > 0
    s = f["science"]
    assert s["plan"]["iterations"] == 3 and s["rates_from"] == "the throughput stage's measurement"
    assert set(s["arms"]) == {"tied", "untied", "lev"} and all(a["valid_ppl"] for a in s["arms"].values())
    assert s["buckets"] and all(set(b["ppl"]) == {"tied", "untied", "lev"} for b in s["buckets"])
    md = (out / "gpu_check.md").read_text()
    for name in gc.NAMES:
        assert f"## {name}\n" in md, name
    assert "LEV/TIED" in md and "Host syncs per step" in md and "no figure here is a GPU figure" in md
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "science.md",
                                                     "science_loss_curves.png", "throughput.md"]
    assert "one seed: no interval" in (out / "science.md").read_text()  # one seed: no verdict
