"""The kernel-only timing and the device comparison of the backward variants (``kernels.lev_timing``).

On CPU they run end to end in Triton's interpreter at a tiny shape with several id partitions (what
the GPU check's kernel stage calls, so its first GPU run is not its first run); the ``gpu`` test runs
them at ``default_shapes()`` on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_lev.kernels import lev_timing, lev_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[2]
TINY = lev_timing.KernelShape("tiny", 40, 2, 3, 5, 6)  # 2 id tiles of the reference, 3 of the grouped


def test_timing_and_comparison_run_at_a_tiny_multi_partition_shape(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import lev_kernel_timing

    out = lev_kernel_timing.main(["--shape", "tiny,40,2,3,5,6", "--device", DEVICE, "--reps", "2", "--warmup", "1",
                                  "--compare", "--json", str(tmp_path / "k.json")])
    rows, errors = out["timings"], out["errors"]
    assert [r["variant"] for r in rows] == [r["variant"] for r in errors] == list(lev_triton.BACKWARD_VARIANTS)
    for r in rows:
        assert (r["shape"], r["n"], r["h"], r["d_s"], r["kappa"], r["r"]) == ("tiny", 40, 2, 3, 5, 6)
        assert r["partitions"] > 1 and r["reps"] == 2
        assert r["timer"] == ("cuda-events" if DEVICE == "cuda" else "perf_counter")
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["bwd_fwd_ratio"] == pytest.approx(r["bwd_ms"] / r["fwd_ms"])
    for e in errors:
        assert e["ok"] and e["partitions"] > 1
        assert 0 < max(e["max_rel_err_m"], e["max_rel_err_grad_x"], e["max_rel_err_grad_delta"]) <= e["tolerance"]
    assert (tmp_path / "k.json").exists()


def test_a_wrong_variant_or_device_is_a_one_line_error():
    with pytest.raises(ValueError, match="backward must be one of"):
        lev_timing.time_kernels([TINY], variants=["fast"], device=DEVICE)
    with pytest.raises(RuntimeError, match="Triton kernels run on") as e:
        lev_timing.compare_backward([TINY], device="meta")
    assert "\n" not in str(e.value)


def test_default_shapes_have_one_and_several_partitions():
    default, tp2 = lev_timing.default_shapes()
    part = lambda s, v: lev_triton._bwd_partitions(s.n, s.h, s.d_s, s.kappa, s.r, v)[0]  # noqa: E731
    assert (part(default, "reference"), part(tp2, "reference")) == (1, 2)
    assert part(tp2, "grouped") > 1


@pytest.mark.gpu
def test_variants_match_fp64_and_are_timed_on_the_gpu():
    errors = lev_timing.compare_backward(device="cuda")
    assert {(e["shape"], e["variant"]) for e in errors} == {
        (s.label, v) for s in lev_timing.default_shapes() for v in lev_triton.BACKWARD_VARIANTS}
    assert all(e["ok"] for e in errors), errors
    rows = lev_timing.time_kernels(reps=5, warmup=2, device="cuda")
    assert all(r["timer"] == "cuda-events" and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)
