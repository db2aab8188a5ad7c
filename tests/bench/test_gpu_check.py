"""bench/gpu_check.py on a machine without CUDA: argument handling, the checks' selection, every GPU
check skipped with its reason, a failing check reported (not raised), the report files, the throughput
ratios it extracts, and the LEV layer comparison it runs on the GPU (here on the CPU, small sizes)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.bench import load_bench

@pytest.fixture(scope="module")
def gc():
    return load_bench("gpu_check")


def test_arguments(gc, capsys):
    a = gc.parse_args(["--out", "x"])
    assert a.checks == list(gc.CHECKS) and a.steps == 20
    assert gc.parse_args(["--out", "x", "--only", "arms,env"]).checks == ["env", "arms"]
    assert gc.parse_args(["--out", "x", "--skip", "throughput,next_mcore"]).checks[-1] == "arms"
    for bad, msg in ((["--out", "x", "--only", "nope"], "unknown check(s) ['nope']"),
                     (["--out", "x", "--steps", "1"], "--steps must be >= 2"),
                     ([], "--out DIR is required")):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_every_gpu_check_is_skipped_and_reported(gc, tmp_path):
    code = gc.main(["--out", str(tmp_path), "--wheels", str(tmp_path / "none")])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {c["name"]: (c["status"], c["reason"]) for c in report["checks"]}
    assert list(status) == list(gc.CHECKS)
    for name in ("pytest_gpu", "lev_layer", "kernel", "arms", "throughput"):
        assert status[name] == ("skipped", "no CUDA device"), name
    assert status["env"][0] == "ok" and status["install"][0] == "skipped"
    env = next(c for c in report["checks"] if c["name"] == "env")["figures"]
    assert env["device"] is None and env["megatron.core"] is True
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| lev_layer | skipped |" in md and "none (no CUDA device" in md
    if not env["transformer_engine"]:
        assert "FP8 / Transformer Engine: not installed here" in md


def test_a_failing_check_is_reported_with_its_figures(gc, tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("arms failed: ['lev']", {"lev": {"exit": 1}})

    monkeypatch.setitem(gc.FUNCS, "arms", broken)
    code = gc.main(["--out", str(tmp_path), "--only", "arms"])
    assert code == 1
    (check,) = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert check["status"] == "failed" and check["reason"] == "RuntimeError: arms failed: ['lev']"
    assert check["figures"] == {"lev": {"exit": 1}}


def test_throughput_ratios_are_median_steps_of_the_default_lev_arm(gc):
    data = {"sections": [{"title": "GPU (gpu-400m configuration, bf16)", "result": {
        "lev_default": "lev unique/sparse",
        "arms": {"tied": {"ms_per_iter": 100.0}, "untied": {"ms_per_iter": 104.0},
                 "lev unique/sparse": {"ms_per_iter": 105.0}, "lev table/sparse": {"ms_per_iter": 150.0}}}}]}
    (r,) = gc._ratios(data).values()
    assert r["lev_arm"] == "lev unique/sparse"
    assert r["lev_over_tied"] == pytest.approx(1.05) and r["lev_over_untied"] == pytest.approx(105 / 104)


def test_lev_layer_comparison_runs_and_agrees_on_cpu(gc):
    res = gc.compare_lev_layer("cpu", vocab=257, hidden=16, batch=(2, 24),
                               lev_kw=dict(num_digits=2, seed_dim=8, num_knots=5, rank=4, num_heads=2))
    assert set(res) == {"unique/float32", "unique/bfloat16", "table/float32", "table/bfloat16"}
    for name, r in res.items():
        assert r["params_dtype"] == f"torch.{r['dtype']}" and r["params_device"] == "cpu"
        assert set(r["errors"]) >= {"forward", "offset", "heads.delta", "seed.codebooks"}
        assert r["max_rel_error"] <= gc.LAYER_TOLERANCE[r["dtype"]], (name, r["errors"])
        assert r["max_rel_error"] > 0  # an error of exactly 0 would mean the comparison compared nothing
