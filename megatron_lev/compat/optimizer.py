"""The grad norm of megatron-core's optimizer step as the training step's NaN/Inf check (0.16.1 and 0.19.x).

megatron-core's ``optimizer.step()`` prepares the gradients (``prepare_grads``: the main grads; with a grad
scaler, unscaled and searched for Inf/NaN), computes the global grad norm, clips and updates. The norm is
computed by a ``ChainedOptimizer`` (what ``get_megatron_optimizer`` returns) on every step, in
``get_grad_norm``, and by a lone Float16, FP32 or distributed optimizer in ``clip_grad_norm`` when
``clip_grad > 0``; both releases call these methods on ``self`` from ``step``. :func:`check_grads_in_step`
puts the check between the norm and the update, so the gradients are read once a step (by the norm):
a non-finite norm, or Inf/NaN found by a grad scaler, raises :class:`NonFiniteGrads` out of ``step()``
before anything is clipped or updated.

Every rank reaches the same verdict without a collective of its own: the norm is reduced over the
optimizer's grad-stats group (the model-parallel ranks; every rank with the distributed optimizer) after
the data-parallel reduction has carried an Inf/NaN of any rank into every replica's gradients, the same
grounds on which megatron's found-inf check skips a step.
"""

from __future__ import annotations

import functools
import math


class NonFiniteGrads(RuntimeError):
    """The step's gradients hold NaN/Inf (raised out of ``optimizer.step()`` before the update)."""


def _checked_norm(compute):
    @functools.wraps(compute)
    def norm(*args, **kwargs):
        value = compute(*args, **kwargs)
        # The step's one host read of its gradient statistics: whether to update is decided on the host
        # before the update is queued. 0.16.1 has read it already (a float); 0.19 may hand back the device
        # tensor, which megatron then takes as the float for clipping and the loop for its log line.
        host = float(value)
        if not math.isfinite(host):
            raise NonFiniteGrads(f"grad norm {host}")
        return host

    return norm


def _checked_prepare(prepare):
    @functools.wraps(prepare)
    def prepare_grads(*args, **kwargs):
        if prepare(*args, **kwargs):  # a grad scaler found Inf/NaN (a host bool, reduced like the norm)
            raise NonFiniteGrads("Inf/NaN found while unscaling")
        return False

    prepare_grads.checks_grads = True
    return prepare_grads


def check_grads_in_step(optimizer, config) -> bool:
    """Make ``optimizer.step()`` raise :class:`NonFiniteGrads` before its update when the step's gradients hold
    NaN/Inf. True when installed; False when its step computes no grad norm (no ``ChainedOptimizer``,
    ``clip_grad`` 0) or not one over every gradient (0.19's ``mtp_detach_heads`` gives the MTP heads a norm of
    their own, computed only when clipping): the caller checks the gradients itself then.

    Not for fp16: there a NaN/Inf step is the dynamic loss scale's, which skips it and backs off.
    ``config``: megatron-core's TransformerConfig of the model."""
    from megatron.core.optimizer import ChainedOptimizer

    if grads_checked_in_step(optimizer):
        return True
    if getattr(config, "mtp_detach_heads", False):
        return False
    if isinstance(optimizer, ChainedOptimizer):
        optimizer.get_grad_norm = _checked_norm(optimizer.get_grad_norm)
    elif optimizer.config.clip_grad > 0.0:
        optimizer.clip_grad_norm = _checked_norm(optimizer.clip_grad_norm)
    else:
        return False
    optimizer.prepare_grads = _checked_prepare(optimizer.prepare_grads)
    return True


def grads_checked_in_step(optimizer) -> bool:
    """Whether :func:`check_grads_in_step` is installed on ``optimizer``."""
    return getattr(getattr(optimizer, "prepare_grads", None), "checks_grads", False)
