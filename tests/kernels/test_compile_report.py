"""The Triton kernels (the forward and every backward variant) compiled ahead of time for sm_90 and
sm_80 on this machine (no GPU needed): no register spill at the paper's default shapes, and ``bench/lev_layer.py --compile-report`` prints
one line per kernel, arch and shape.

Compilation runs in a child process without TRITON_INTERPRET (tests/conftest.py sets it here, and
kernels built for the interpreter cannot be compiled). When compilation cannot run on this machine
(no triton, no ptxas, an unsupported arch), the test fails with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lev.kernels import lev_triton

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(REPO / "bench" / "lev_layer.py"), "--compile-report", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        pytest.fail(f"compiling the Triton kernels for sm_90/sm_80 failed on this machine (rc "
                    f"{done.returncode}): " + " | ".join(tail), pytrace=False)
    return json.loads(out.read_text())["compile_report"], done.stdout


def test_no_spill_at_the_default_shapes_on_sm90_and_sm80(report):
    records, _ = report
    defaults = [r for r in records if r["label"] == "default"]
    seen = {(r["kernel"], r["arch"], r["delta_dtype"], r["n"]) for r in defaults}
    assert lev_triton.report_kernels() == ("forward", "backward", "backward-grouped")
    want = {(k, a, d, n) for k in lev_triton.report_kernels() for a in ("sm_90", "sm_80") for d in ("bf16", "fp32")
            for n in lev_triton.REPORT_IDS}
    assert seen == want
    spilled = [f"{r['kernel']} {r['arch']} Delta {r['delta_dtype']} N={r['n']}: {r['spill']} B stored, "
               f"{r['spill_loads']} B loaded, {r['registers']} registers" for r in defaults
               if r["spill"] or r["spill_loads"]]
    assert not spilled, "register spills at the default shapes: " + "; ".join(spilled)
    assert all(0 < r["registers"] <= 255 for r in records)


def test_the_report_prints_one_line_per_kernel_arch_and_shape(report):
    records, stdout = report
    lines = [line for line in stdout.splitlines() if "registers" in line and "spill" in line]
    kernels = lev_triton.report_kernels()
    assert len(lines) == len(records) == len(kernels) * 2 * len(lev_triton.report_shapes()) * len(lev_triton.REPORT_IDS)
    assert {line.split()[0] for line in lines} == set(kernels)  # each kernel named in the first column
    assert any("sm_80 r=128" in line and "Delta fp32" in line for line in lines)
    assert all("shared memory" in line for line in lines)


def test_compile_failures_are_one_clear_error(monkeypatch):
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):  # the interpreter's kernels cannot compile
        lev_triton.compile_report()

    def no_ptxas(*args, **kwargs):
        raise FileNotFoundError("ptxas not found")

    monkeypatch.setattr(lev_triton, "interpreted", lambda: False)
    monkeypatch.setattr(lev_triton, "_compile", no_ptxas)
    with pytest.raises(RuntimeError, match="compiling the forward for sm_90 failed: FileNotFoundError: ptxas"):
        lev_triton.compile_report()
