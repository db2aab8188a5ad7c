"""Why ``--model-class hybrid`` is not offered yet (docs/architecture.md, "HybridModel (0.19)").

megatron-core 0.19's ``HybridStack`` builds its final norm as Transformer Engine's ``TENorm`` whatever its spec
says, so the last pipeline stage of a ``HybridModel`` cannot be built without TE. This test holds that fact
against the installed megatron-core: when it fails, the stack can be built without TE and the LEV seam of
``LevGPTModel`` can be given to ``HybridModel`` as the architecture page describes.
"""

from __future__ import annotations

import importlib.util

import pytest

from megatron_lev.models.config import te_available

HAS_HYBRID = importlib.util.find_spec("megatron.core.models.hybrid") is not None


@pytest.fixture
def parallel_state():
    from megatron_lev.distributed import destroy_distributed, init_distributed

    setup = init_distributed(tp=1, pp=1, vpp=None, backend="gloo", timeout_minutes=1)
    yield
    destroy_distributed(setup)


@pytest.mark.skipif(not HAS_HYBRID, reason="this megatron-core has no HybridModel (it came after 0.16.1)")
@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed, so TENorm builds")
def test_hybrid_stack_last_stage_needs_transformer_engine(parallel_state):
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    # Only an MLP-free, attention-free layer list: nothing but the final norm needs TE.
    with pytest.raises(ImportError, match="Transformer Engine"):
        HybridStack(config, HybridStackSubmodules(), pre_process=True, post_process=True, layer_type_list=[],
                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())
