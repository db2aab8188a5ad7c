"""Every input arm of a seed starts from the same transformer body, and the untied-head arms from the same
output head: only the input side differs between the arms' initial weights (TP=1, TP=2 and PP=2)."""

from __future__ import annotations

import pytest
import torch

from megatron_lev.testing import run_distributed

from . import _harness as H

# One two-rank launch builds every arm in three layouts (~40 s on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

UNTIED_HEAD = ("untied", "albert", "flat_mlp", "factored_mlp", "lev")


@pytest.fixture(scope="module")
def weights():
    return run_distributed(H.initial_weights_run, 2, args=(H.ALL_ARMS,))


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
@pytest.mark.parametrize("arm", [a for a in H.ALL_ARMS if a != "tied"])
def test_every_arm_starts_from_tieds_decoder_and_untieds_head(weights, layout, arm):
    for rank, per_layout in enumerate(weights):
        got, tied, untied = (per_layout[layout][a] for a in (arm, "tied", "untied"))
        decoder = sorted(n for n in tied if n.startswith("decoder."))
        assert decoder and decoder == sorted(n for n in got if n.startswith("decoder.")), (rank, layout)
        for name in decoder:
            assert torch.equal(got[name], tied[name]), f"rank {rank} {layout} {arm}: {name} differs from tied's"
        if arm in UNTIED_HEAD and "output_layer.weight" in untied:
            assert torch.equal(got["output_layer.weight"], untied["output_layer.weight"]), (rank, layout, arm)

