"""RMSNorm / LayerNorm in plain torch that support Megatron's sequence parallelism.

megatron-core's torch norm (``WrappedTorchNorm``) refuses ``sequence_parallel=True`` because
nothing marks its weights for the sequence-parallel gradient reduction. Under sequence
parallelism each tensor-parallel rank normalises only its own slice of the sequence, so its
weight gradient is a partial sum; megatron's ``finalize_model_grads`` all-reduces over the TP
group the gradients of every parameter carrying ``sequence_parallel = True`` (as Apex's and
Transformer Engine's norms set it). ``SequenceParallelNorm`` sets that attribute from the config,
so the local (non-TE) layer spec can run with sequence parallelism on CPU and GPU alike.

Constructor signature is megatron's norm interface, so it drops into a ``ModuleSpec`` in place of
``WrappedTorchNorm`` / ``FusedLayerNorm`` / ``TENorm``; parameter names (``weight``, ``bias``) are
those of ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``, so checkpoints are interchangeable with the
local spec's. ``layernorm_zero_centered_gamma`` stores gamma - 1 (initialised at 0) as Megatron does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["SequenceParallelNorm", "SequenceParallelRMSNorm", "SequenceParallelLayerNorm"]


class SequenceParallelNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (by ``config.normalization`` unless ``normalization`` is given)."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,  # accepted for interface compatibility; unused
        zero_centered_gamma: Optional[bool] = None,
        normalization: Optional[str] = None,
    ):
        super().__init__()
        self.config = config
        self.normalization = normalization or getattr(config, "normalization", "LayerNorm")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm (got {self.normalization!r})")
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        if zero_centered_gamma is None:
            zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.zero_centered_gamma = zero_centered_gamma
        dtype = getattr(config, "params_dtype", torch.float32)
        device = None if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available() else torch.cuda.current_device()
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(self.hidden_size, dtype=dtype, device=device))
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(self.hidden_size, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        sp = bool(getattr(config, "sequence_parallel", False))
        for p in (self.weight, self.bias):
            if p is not None:
                # finalize_model_grads all-reduces these over TP when sequence parallelism is on.
                setattr(p, "sequence_parallel", sp)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalization}({self.hidden_size}, eps={self.eps}, sequence_parallel={self.weight.sequence_parallel})"


def SequenceParallelRMSNorm(config, hidden_size: int, eps: float = 1e-5, **kwargs) -> SequenceParallelNorm:
    """RMSNorm whatever ``config.normalization`` says."""
    kwargs["normalization"] = "RMSNorm"
    return SequenceParallelNorm(config, hidden_size, eps, **kwargs)


def SequenceParallelLayerNorm(config, hidden_size: int, eps: float = 1e-5, **kwargs) -> SequenceParallelNorm:
    """LayerNorm whatever ``config.normalization`` says."""
    kwargs["normalization"] = "LayerNorm"
    return SequenceParallelNorm(config, hidden_size, eps, **kwargs)
