"""tied: megatron-core's own V x D word embedding, shared with the output head."""

from __future__ import annotations

from .base import InputArm


class TiedArm(InputArm):
    name = "tied"
    ties_output_head = True
    megatron_embedding = True

    def input_params(self, model_config, hidden_size: int) -> int:
        return model_config.vocab_size * hidden_size
