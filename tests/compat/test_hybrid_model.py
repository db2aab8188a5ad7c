"""Why ``--model-class hybrid`` is not offered yet (docs/architecture.md, "HybridModel (0.19)").

megatron-core 0.19's ``HybridStack`` builds its final norm as Transformer Engine's ``TENorm`` whatever its spec
says, so the last pipeline stage of a ``HybridModel`` cannot be built without TE. This test holds that fact
against the installed megatron-core: when it fails, the stack can be built without TE and the LEV seam of
``LevGPTModel`` can be given to ``HybridModel`` as the architecture page describes.

The stack is built in a rank process (``run_distributed``): the CPU backend that megatron-core needs there
patches torch process-wide, and in the test process it would change what later tests compute (transformers
5 leaves a Llama's rotary buffers uninitialised when ``torch.tensor`` is wrapped).
"""

from __future__ import annotations

import importlib.util

import pytest

from megatron_lev.models.config import te_available
from megatron_lev.testing import run_distributed

HAS_HYBRID = importlib.util.find_spec("megatron.core.models.hybrid") is not None


def _build_stack_without_te():
    """On one rank: build a layer-free HybridStack; returns the ImportError's message (None if it built)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    # Only an MLP-free, attention-free layer list: nothing but the final norm needs TE.
    try:
        HybridStack(config, HybridStackSubmodules(), pre_process=True, post_process=True, layer_type_list=[],
                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    except ImportError as e:
        return str(e)
    return None


@pytest.mark.skipif(not HAS_HYBRID, reason="this megatron-core has no HybridModel (it came after 0.16.1)")
@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed, so TENorm builds")
def test_hybrid_stack_last_stage_needs_transformer_engine():
    (message,) = run_distributed(_build_stack_without_te, world_size=1)
    assert message is not None and "Transformer Engine" in message, message
