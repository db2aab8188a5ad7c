"""untied: megatron-core's own V x D word embedding and a separate vocab-parallel output head."""

from __future__ import annotations

from .base import InputArm


class UntiedArm(InputArm):
    name = "untied"
    megatron_embedding = True

    def input_params(self, model_config, hidden_size: int) -> int:
        return model_config.vocab_size * hidden_size
