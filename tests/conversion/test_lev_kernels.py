"""The conversion entry points that build a pure-torch ``LEVEmbedding`` (to-lev's fit and
``load_lev_embedding``) register the fused kernels first, so basis "auto" uses them there as it does
in a megatron model (Triton on CUDA; on this CPU machine, numba's kernel: basis "fused").

Each check runs in a fresh process: the registry is process-wide, and any test that built a
tensor-parallel LEV layer has already filled it in this one.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lev.kernels import lev_cpu
from megatron_lev.lev import LEVConfig, LEVEmbedding

REPO = Path(__file__).resolve().parents[2]
LEV = dict(seed_dim=4, rank=3, num_heads=2, num_knots=5)

CHILD = """
import sys, torch
from megatron_lev.lev import LEVConfig, functional
from megatron_lev.conversion import fit_lev, load_lev_embedding
from megatron_lev.conversion.dense_to_lev import FitConfig
assert not functional.has_fused_product("cpu"), "registered before the call"
if sys.argv[1] == "load":
    emb = load_lev_embedding(sys.argv[2])
else:
    table = torch.randn(60, 8, generator=torch.Generator().manual_seed(0))
    emb, _ = fit_lev(table, LEVConfig(**{lev}), fit=FitConfig(max_steps=1, progress=False))
print("basis", emb.config.resolved_basis("cpu"))
"""


def _basis_after(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-c", CHILD.format(lev=LEV), *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split("basis", 1)[1].strip()


@pytest.fixture(scope="module", autouse=True)
def _numba():
    assert lev_cpu.available(), "numba is a dependency (pyproject.toml): pip install numba"


def test_load_lev_embedding_registers_the_kernels(tmp_path):
    from megatron_lev.conversion.files import save_safetensors
    from megatron_lev.conversion.lev_export import CONFIG_FILE, WEIGHTS_FILE

    emb = LEVEmbedding(60, 8, LEVConfig(**LEV), init_statistics=False)
    save_safetensors({k: v.contiguous() for k, v in emb.state_dict().items()}, str(tmp_path / WEIGHTS_FILE))
    meta = {"vocab_size": 60, "hidden_size": 8, "lev": dataclasses.asdict(emb.config), "dtype": "float32"}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    assert _basis_after("load", str(tmp_path)) == "fused"


def test_the_to_lev_fit_registers_the_kernels():
    assert _basis_after("fit") == "fused"
