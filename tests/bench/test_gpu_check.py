"""bench/gpu_check.py's CPU-side parts: the checks' selection, the budget it enforces (fake clock, tiny
budget), the report rewritten after every check (and kept when the run is killed), the judgements of
the training and layer checks, and the LEV layer comparison itself on the CPU (eager bases and the
Triton kernel in Triton's interpreter), including a miscompiled kernel it must catch."""

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

from tests.bench import REPO

SMALL_LEV = dict(num_digits=2, seed_dim=8, num_knots=5, rank=4, num_heads=2)


@pytest.fixture(scope="module")
def gc():
    # Imported by name (not load_bench's private copy): bench/gpu_science.py imports it so, and both must
    # share its exception classes.
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    return gpu_check


def _ctx(gc, tmp_path, **kw):
    args = dict(out=str(tmp_path / "out"), work=str(tmp_path / "work"), wheels=None, shared_data=str(tmp_path),
                corpus=str(tmp_path / "corpus.jsonl.zst"), steps=10, cuda=True)
    args.update(kw)
    (tmp_path / "work" / "logs").mkdir(parents=True, exist_ok=True)
    return gc.Ctx(**args)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_arguments(gc, capsys):
    a = gc.parse_args(["--out", "x"])
    assert a.checks == list(gc.NAMES) and a.steps == 10 and a.budget_s == 400
    assert a.corpus.endswith(os.path.join("corpus", "train.jsonl.zst"))
    assert gc.parse_args(["--out", "x", "--only", "train_lev,env"]).checks == ["env", "train_lev"]
    assert "science" not in gc.parse_args(["--out", "x", "--skip", "science,next_mcore"]).checks
    for bad, msg in ((["--out", "x", "--only", "nope"], "unknown check(s) ['nope']"),
                     (["--out", "x", "--steps", "2"], "--steps must be >= 3"),
                     (["--out", "x", "--budget-s", "0"], "--budget-s must be a positive number"),
                     ([], "--out DIR is required")):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_the_order_puts_what_we_most_need_first(gc):
    names = list(gc.NAMES)
    assert names.index("env") < names.index("lev_layer") < names.index("train_tied") < names.index("throughput")
    assert names.index("throughput") < names.index("kernel") < names.index("science") == len(names) - 1
    assert [n for n in names if n.startswith("train_")] == ["train_tied", "train_lev", "train_lev_table"]


def test_budget_skips_what_does_not_fit_and_bounds_the_timeouts(gc, tmp_path):
    clock, seen = FakeClock(), {}

    def work(seconds):
        def run(ctx, timeout):
            seen[len(seen)] = timeout
            clock.t += seconds
            return {"took": seconds}
        return run

    checks = [gc.Check("a", work(30), timeout_s=100, estimate_s=10, cuda=False),
              gc.Check("b", work(30), timeout_s=20, estimate_s=10, cuda=False),
              gc.Check("c", work(30), timeout_s=100, estimate_s=10, cuda=False),
              gc.Check("d", work(1), timeout_s=100, estimate_s=lambda ctx: (2.0, "tiny"), cuda=False),
              gc.Check("e", work(1), timeout_s=100, estimate_s=1, cuda=True)]
    res = gc.run_checks(checks, _ctx(gc, tmp_path, cuda=False), 75 + gc.RESERVE_S, clock=clock, log=lambda m: None)
    status = {r["name"]: (r["status"], r["reason"]) for r in res}
    assert status["a"] == status["b"] == status["c"] == ("ok", "")
    # a ran (75 left, timeout its own 100 capped at 75), b (45 left: its own 20), c (15 left: 15)
    assert seen[0] == 75 and seen[1] == 20 and seen[2] == 15
    assert status["d"] == ("skipped", "budget: needs ~2 s, 0 s left")
    assert status["e"] == ("skipped", "no CUDA device")
    assert res[3]["estimate_basis"] == "tiny"


def test_a_tiny_budget_skips_every_check_with_its_reason(gc, tmp_path):
    code = gc.main(["--out", str(tmp_path / "out"), "--budget-s", "1", "--wheels", str(tmp_path / "none")])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert code == 0 and report["state"] == "done" and report["pending"] == []
    status = {c["name"]: (c["status"], c["reason"]) for c in report["checks"]}
    assert status["env"] == ("skipped", "budget: needs ~15 s, 0 s left")
    gpu = "no CUDA device" if not torch.cuda.is_available() else "budget: needs ~40 s, 0 s left"
    assert status["lev_layer"] == ("skipped", gpu)
    assert all(s == "skipped" and r for s, r in status.values())


def test_timeouts_and_failures_are_reported_with_their_figures(gc, tmp_path):
    def timed_out(ctx, timeout):
        raise gc.CheckTimeout(timeout, {"rows_done": 3}, "last words")

    def broken(ctx, timeout):
        raise gc.CheckFailed("arms disagree", {"lev": {"exit": 1}})

    def crash(ctx, timeout):
        raise KeyError("x")

    checks = [gc.Check("slow", timed_out, timeout_s=42, estimate_s=1, cuda=False),
              gc.Check("bad", broken, timeout_s=10, estimate_s=1, cuda=False),
              gc.Check("crash", crash, timeout_s=10, estimate_s=1, cuda=False)]
    slow, bad, crashed = gc.run_checks(checks, _ctx(gc, tmp_path), 400, log=lambda m: None)
    assert slow["status"] == "failed" and slow["reason"] == "timeout: killed after 42 s"
    assert slow["figures"] == {"rows_done": 3} and slow["log_tail"] == "last words"
    assert bad["reason"] == "arms disagree" and bad["figures"] == {"lev": {"exit": 1}}
    assert crashed["status"] == "failed" and crashed["reason"] == "KeyError: 'x'"


def test_the_report_is_on_disk_and_valid_after_every_check(gc, tmp_path, monkeypatch):
    out = tmp_path / "out"
    seen_on_disk = []

    def look(ctx, timeout):
        report = json.loads((out / "gpu_check.json").read_text())
        seen_on_disk.append([(c["name"], c["status"]) for c in report["checks"]])
        if len(seen_on_disk) == 2:
            raise RuntimeError("boom")
        return {"n": len(seen_on_disk)}

    fakes = tuple(gc.Check(n, look, timeout_s=10, estimate_s=1, cuda=False) for n in ("install", "env", "lev_layer"))
    monkeypatch.setattr(gc, "CHECKS", fakes)
    code = gc.main(["--out", str(out), "--only", "install,env,lev_layer"])
    assert code == 1
    assert seen_on_disk == [[], [("install", "ok")], [("install", "ok"), ("env", "failed")]]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["state"] == "done" and [c["status"] for c in report["checks"]] == ["ok", "failed", "ok"]
    md = (out / "gpu_check.md").read_text()
    assert "| env | failed |" in md and "RuntimeError: boom" in md
    assert not list(out.glob("*.tmp"))


def test_a_killed_run_keeps_what_it_learnt(tmp_path):
    """The run is killed (SIGKILL) inside its second check: the first check's result is on disk."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(REPO / "bench")!r})
        import gpu_check as gc
        def ok(ctx, timeout):
            return {{"measured": 1.5}}
        def die(ctx, timeout):
            os.kill(os.getpid(), signal.SIGKILL)
        gc.CHECKS = (gc.Check("install", ok, 10, 1, cuda=False), gc.Check("env", die, 10, 1, cuda=False),
                     gc.Check("lev_layer", ok, 10, 1, cuda=False))
        gc.main(["--out", {str(tmp_path / "out")!r}, "--only", "install,env,lev_layer"])
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=str(REPO))
    assert r.returncode == -9, r.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["state"] == "running" and report["pending"] == ["env", "lev_layer"]
    assert [(c["name"], c["status"], c["figures"]) for c in report["checks"]] == [("install", "ok", {"measured": 1.5})]
    assert "| install | ok |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_a_subprocess_past_its_timeout_is_killed_with_its_children(gc, tmp_path):
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
            " print('child', p.pid, flush=True); time.sleep(300)")
    rc, output = gc.run_logged([sys.executable, "-c", code], 3, tmp_path / "log")
    assert rc == 124 and "child" in output
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_every_gpu_check_is_skipped_and_reported(gc, tmp_path):
    code = gc.main(["--out", str(tmp_path / "out"), "--budget-s", "400", "--wheels", str(tmp_path / "none")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    status = {c["name"]: (c["status"], c["reason"]) for c in report["checks"]}
    assert list(status) == list(gc.NAMES)
    for c in gc.CHECKS:
        if c.cuda:
            assert status[c.name] == ("skipped", "no CUDA device"), c.name
    assert status["env"][0] == "ok" and status["install"][0] == "skipped"
    env = next(c for c in report["checks"] if c["name"] == "env")["figures"]
    assert env["device"] is None and env["megatron.core"] != "" and not env["megatron.core"].startswith("not")
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| lev_layer | skipped | 0.0 | no CUDA device |" in md and "none (no CUDA device" in md
    assert "TP=1 over NCCL" in md
    if env["transformer_engine"].startswith("not"):
        assert "FP8 / Transformer Engine: not installed here" in md


# -------------------------------------------------------------------------------- the layer comparison


def test_lev_layer_comparison_agrees_on_cpu_and_records_the_basis_that_ran(gc):
    res = gc.compare_lev_layer("cpu", vocab=257, hidden=16, batch=(2, 24), lev_kw=SMALL_LEV,
                               bases=("dense", "sparse", "triton"))
    assert len(res) == 2 * 2 * 3
    for name, r in res.items():
        assert r["params_dtype"] == f"torch.{r['dtype']}" and r["params_device"] == "cpu"
        assert set(r["errors"]) >= {"forward", "offset", "heads.delta", "seed.codebooks"}
        assert 0 < r["max_rel_error"] <= gc.LAYER_TOLERANCE[r["dtype"]], (name, r["errors"])
        assert r["basis_ok"], (name, r["ran"])
        want = "triton kernel" if r["basis"] == "triton" else f"eager {r['basis']}"
        assert set(r["ran"]) == {want}, (name, r["ran"])
        assert r["ran"][want] == (2 if r["mode"] == "table" else 1)  # table: the table, then its backward
    assert gc.judge_layer_rows(res) is res


def test_a_miscompiled_triton_kernel_fails_the_layer_check(gc, monkeypatch):
    from megatron_lev.kernels import register_default_kernels
    from megatron_lev.lev import functional

    register_default_kernels()
    good = functional._FUSED_PRODUCTS[("triton", "cpu")]

    def miscompiled(x, delta, num_knots, **kw):
        return good(x, delta, num_knots, **kw) * 1.05

    monkeypatch.setitem(functional._FUSED_PRODUCTS, ("triton", "cpu"), miscompiled)
    res = gc.compare_lev_layer("cpu", vocab=257, hidden=16, batch=(2, 24), lev_kw=SMALL_LEV,
                               bases=("sparse", "triton"), dtypes=("float32",), modes=("unique",))
    with pytest.raises(gc.CheckFailed) as e:
        gc.judge_layer_rows(res)
    assert "over tolerance ['unique/float32/triton']" in str(e.value)
    assert res["unique/float32/sparse"]["max_rel_error"] <= gc.LAYER_TOLERANCE["float32"]
    assert functional._FUSED_PRODUCTS[("triton", "cpu")] is miscompiled  # the probe put it back


def test_basis_judgement(gc):
    ok = gc._ran_as_asked
    assert ok("triton", {"triton kernel": 2})
    assert ok("triton", {"triton kernel": 1, "triton kernel's eager fallback": 1, "eager dense": 1})
    assert not ok("triton", {"eager sparse": 1})  # asked for the kernel, the eager path ran
    assert not ok("triton", {"triton kernel": 1, "eager sparse": 1})
    assert not ok("fused", {"eager dense": 1})
    assert ok("sparse", {"eager sparse": 3}) and not ok("sparse", {"eager dense": 1}) and not ok("sparse", {})


# -------------------------------------------------------------------------------- training checks


def _log_lines(ms, grad=1.0):
    from megatron_lev.training.logger import TrainingLogger

    return "\n".join(TrainingLogger.training_line(
        None, iteration=i + 1, train_iters=len(ms), consumed_samples=8 * (i + 1), consumed_tokens=4096 * (i + 1),
        ms_per_iter=m, lr=1e-4, global_batch_size=8, losses={"lm loss": 10.0 - i}, loss_scale=1.0, grad_norm=grad,
        skipped=0, nan=0, tokens_per_s=4096 / m * 1e3, tflops_per_device=m / 10, mfu=None) for i, m in enumerate(ms))


def _fake_pretrain(gc, monkeypatch, losses, grad_norms, rc=0):
    ms = [900.0, 300.0] + [100.0 + i for i in range(len(losses) - 2)]

    def fake_run(cmd, timeout, log, env=None):
        metrics = Path(cmd[cmd.index("--metrics-file") + 1])
        metrics.write_text("".join(json.dumps({"kind": "train", "iteration": i + 1, "lm loss": x, "grad norm": g}) + "\n"
                                   for i, (x, g) in enumerate(zip(losses, grad_norms))))
        return rc, _log_lines(ms)

    monkeypatch.setattr(gc, "run_logged", fake_run)
    return ms


def test_training_figures_come_from_the_log_lines_and_the_metrics_file(gc, tmp_path, monkeypatch):
    losses = [10.9 - 0.2 * i for i in range(10)]
    ms = _fake_pretrain(gc, monkeypatch, losses, [2.0] * 10)
    fig = gc.train_check("tied")(_ctx(gc, tmp_path), 100)
    assert fig["iterations"] == 10 and fig["losses"] == losses and fig["exit"] == 0
    assert fig["median_ms"] == pytest.approx(sorted(ms[2:])[4] / 2 + sorted(ms[2:])[3] / 2)  # after the warm-up two
    assert fig["median_tflops"] == pytest.approx(fig["median_ms"] / 10)
    assert fig["total_step_s"] == pytest.approx(sum(ms) / 1e3)


def test_training_check_fails_on_short_runs_and_non_decreasing_loss(gc, tmp_path, monkeypatch):
    _fake_pretrain(gc, monkeypatch, [10.0] * 10, [1.0] * 10)
    with pytest.raises(gc.CheckFailed, match=r"loss did not decrease \(10.000 -> 10.000\)"):
        gc.train_check("tied")(_ctx(gc, tmp_path), 100)
    _fake_pretrain(gc, monkeypatch, [10.0, 9.0], [1.0] * 2, rc=1)
    with pytest.raises(gc.CheckFailed, match="(?s)^2 of 10 iterations recorded; exit 1: .*iteration        2/"):
        gc.train_check("lev")(_ctx(gc, tmp_path), 100)


def test_table_mode_check_catches_lost_gradients(gc, tmp_path, monkeypatch):
    ctx = _ctx(gc, tmp_path)
    ctx.results = {"train_lev": {"status": "ok", "figures": {"grad_norms": [3.241] + [1.0] * 9}}}
    losses = [10.9 - 0.1 * i for i in range(10)]
    _fake_pretrain(gc, monkeypatch, losses, [0.812] + [1.0] * 9)  # overlap dispatched LEV's bucket too early
    with pytest.raises(gc.CheckFailed, match="first grad norm 0.8120 vs 3.2410 in unique mode") as e:
        gc.train_check("lev", gc.TABLE_FLAGS)(ctx, 100)
    assert e.value.figures["first_grad_norm_vs_unique"]["relative_gap"] == pytest.approx(1 - 0.812 / 3.241)
    _fake_pretrain(gc, monkeypatch, losses, [3.25] + [1.0] * 9)
    fig = gc.train_check("lev", gc.TABLE_FLAGS)(ctx, 100)
    assert fig["flags"] == list(gc.TABLE_FLAGS) and fig["first_grad_norm_vs_unique"]["relative_gap"] < 0.01


def test_throughput_ratios_are_median_steps_of_the_default_lev_arm(gc):
    data = {"sections": [{"title": "GPU (gpu-400m configuration, bf16)", "result": {
        "lev_default": "lev unique/triton",
        "arms": {"tied": {"ms_per_iter": 100.0}, "untied": {"ms_per_iter": 104.0},
                 "lev unique/triton": {"ms_per_iter": 105.0}, "lev table/triton": {"ms_per_iter": 150.0}}}}]}
    (r,) = gc._ratios(data).values()
    assert r["lev_arm"] == "lev unique/triton"
    assert r["lev_over_tied"] == pytest.approx(1.05) and r["lev_over_untied"] == pytest.approx(105 / 104)


# -------------------------------------------------------------------------------- science run planning


def test_science_is_planned_from_measured_throughput(gc, tmp_path):
    import gpu_science as sci

    corpus = tmp_path / "train.jsonl.zst"
    ctx = _ctx(gc, tmp_path, corpus=str(corpus))
    ctx.results = {}
    with pytest.raises(gc.Skip, match="no corpus at"):
        gc.science_estimate(ctx)
    corpus.write_bytes(b"x" * 20_000_000)
    with pytest.raises(gc.Skip, match="no measured throughput to plan with"):
        gc.science_estimate(ctx)
    ctx.results = {"train_tied": {"status": "ok", "figures": {"median_tflops": 100.0, "median_ms": 50.0, "startup_s": 20}},
                   "train_lev": {"status": "ok", "figures": {"median_ms": 60.0}}}
    slow, basis = gc.science_estimate(ctx)
    assert "train_tied check's 100 TFLOP/s" in basis and "LEV/TIED 1.20" in basis
    tokens = 20_000_000 * sci.TOKENS_PER_COMPRESSED_BYTE
    train = tokens * sci._flops_per_token(sci.MODEL) / 100e12
    fixed = sci.PREPROCESS_S + 2 * (20 + sci.CHECKPOINT_S + sci.EVAL_S)
    assert slow == pytest.approx(sci.MARGIN * (fixed + train * 2.2))
    ctx.results["train_tied"]["status"] = "failed"  # a failed check's figures are not used
    ctx.science_tflops = 400.0
    fast, basis = gc.science_estimate(ctx)
    assert basis.startswith(f"~{tokens / 1e6:.1f} M tokens per arm at --science-tflops 400") and fast < slow


def test_science_report_is_written_from_its_steps(tmp_path):
    import gpu_science as sci

    fig = {"corpus": "c.jsonl.zst", "steps": {"preprocess_train": {"exit": 0, "seconds": 40.0},
                                             "train_tied": {"exit": 124, "seconds": 300.0}}}
    sci.write_report(tmp_path / "science.md", fig, tmp_path)
    md = (tmp_path / "science.md").read_text()
    assert "| train_tied | 124 | 300.0 |" in md and "not preprocessed yet" in md


# -------------------------------------------------------------------------------- preparing and markers


def test_prepare_data_copies_what_the_checks_read_and_cuts_the_task_files(gc, tmp_path):
    src = tmp_path / "shared"
    for f in gc.DATA_FILES:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes(b"data of " + f.encode())
    (src / "downstream").mkdir()
    (src / "downstream" / "piqa_validation.jsonl").write_text("".join(f'{{"i": {i}}}\n' for i in range(10)))
    assert gc.prepare_data(str(tmp_path / "carry"), str(src), task_lines=3) == 0
    for f in gc.DATA_FILES:
        assert (tmp_path / "carry" / f).read_bytes() == (src / f).read_bytes()
    assert (tmp_path / "carry" / "downstream" / "piqa_validation.jsonl").read_text().splitlines() == [
        '{"i": 0}', '{"i": 1}', '{"i": 2}']
    (src / gc.DATA_FILES[0]).unlink()
    assert gc.prepare_data(str(tmp_path / "carry2"), str(src), task_lines=3) == 1


def _marks(fn: ast.FunctionDef) -> set:
    return {d.attr for d in fn.decorator_list if isinstance(d, ast.Attribute)} | {
        d.func.attr for d in fn.decorator_list if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)}


def test_gpu_tests_that_need_transformer_engine_are_marked_te():
    """``pytest -m "gpu and not te"`` (the GPU check without TE) must not select a test that fails without TE."""
    needing_te = []
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "gpu" in _marks(node):
                body = ast.unparse(node)
                if "te_available" in body or "transformer_engine" in body:
                    needing_te.append((path.name, node.name, "te" in _marks(node)))
    assert ("test_te_layout.py", "test_te_spec_checkpoint_and_local_spec_checkpoint_swap_on_gpu", True) in needing_te
    assert all(marked for _, _, marked in needing_te), needing_te
