"""bench/step_ops.py counts the aten operators of a pretrain_lev.py step by part (forward, backward,
optimizer), with torch's AdamW as it runs on CUDA."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_lev.testing import run_cli

REPO = Path(__file__).resolve().parents[2]


def test_step_ops_counts_each_part_of_a_training_step(tmp_path):
    out = tmp_path / "ops.json"
    r = run_cli(REPO / "bench" / "step_ops.py", ["--arms", "tied", "--layers", "2", "--hidden", "32", "--seq", "16",
                                                  "--steps", "2", "--vocab", "200", "--json", out], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["tied"]
    top = res["top_launching"]
    # Two layers' four GEMMs each forward (QKV, projection, MLP in and out) plus the head; twice that backward.
    assert top["forward:mm"] == 2 * 4 + 1 and top["backward:mm"] == 2 * top["forward:mm"]
    assert top["forward:silu"] == 2 and top["backward:silu_backward"] == 2
    # torch's rms_norm as CUDA runs it: one kernel each way per norm (2 a layer and the final one)
    assert top["forward:_fused_rms_norm"] == top["backward:_fused_rms_norm_backward"] == 2 * 2 + 1
    assert "forward:rsqrt" not in top and "backward:pow" not in top
    # torch's AdamW as --adam-impl auto runs it on CUDA: fused, one kernel per parameter group
    assert top["optimizer:_fused_adamw_"] == 2 and "optimizer:_foreach_addcdiv_" not in top
    assert not [k for k in top if k.startswith("optimizer:") and k.endswith("_backward")]
    # the distributed optimizer's copies of its updated shards into the parameters: one foreach copy
    assert "optimizer:copy_" not in top and top["optimizer:_foreach_copy_"] == 1
    assert res["total"]["ops"] == sum(res[p]["ops"] for p in ("forward", "backward", "optimizer", "other"))
    assert res["total"]["launching"] < res["total"]["ops"]
    assert "| tied | total |" in r.stdout
