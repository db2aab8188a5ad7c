"""The grad norm of megatron-core's optimizer step as the training step's NaN/Inf check (0.16.1 and 0.19.x).

megatron-core's ``optimizer.step()`` prepares the gradients (``prepare_grads``: the main grads; with a grad
scaler, unscaled and searched for Inf/NaN), computes the global grad norm, clips and updates. The norm is
computed by a ``ChainedOptimizer`` (what ``get_megatron_optimizer`` returns) on every step, in
``get_grad_norm``, and by a lone Float16, FP32 or distributed optimizer in ``clip_grad_norm`` when
``clip_grad > 0``; both releases call these methods on ``self`` from ``step``. :func:`check_grads_in_step`
puts the check between the norm and the update, so the gradients are read once a step (by the norm; the
few it leaves out, below, once more for their finiteness):
a non-finite norm, or Inf/NaN found by a grad scaler, raises :class:`NonFiniteGrads` out of ``step()``
before anything is clipped or updated.

Every rank reaches the same verdict without a collective of its own. Without the distributed optimizer the
data-parallel all-reduce carries an Inf/NaN of any rank into every replica's gradients, and the norm is
reduced over the model-parallel ranks; with it the reduce-scatter leaves the Inf/NaN in its owner's shard
only, and the norm is reduced over every rank. Either way the reduced norm is non-finite on all ranks, the
same grounds on which megatron's found-inf check skips a step.

megatron's norm leaves out the gradients it would count twice: tensor-parallel duplicates (replicated
parameters such as LayerNorm weights) on tensor-parallel rank >= 1, and ``shared`` parameters. Those are
still updated from their own, local gradients, so :func:`check_grads_in_step` makes each optimizer's
grads-for-norm list carry one more element, 0 when the left-out gradients are finite and NaN otherwise: it
adds nothing to a finite norm and poisons the same reduction otherwise.
"""

from __future__ import annotations

import functools
import math

import torch


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


def _grads_getter_name(optimizer) -> str:
    # 0.19 renamed the getter (with an optional grad-norm group); 0.16.1 has get_main_grads_for_grad_norm.
    if hasattr(optimizer, "get_grads_for_grad_norm"):
        return "get_grads_for_grad_norm"
    return "get_main_grads_for_grad_norm"


def _left_out_grads(optimizer, counted):
    """The gradients of ``optimizer``'s parameters that are not in ``counted`` (megatron's own filter's output,
    so this is its complement on this rank by construction), the separate grad-norm groups of 0.19 aside."""
    from megatron.core.optimizer import optimizer as megatron_optimizer

    group_attr = getattr(megatron_optimizer, "GRAD_NORM_GROUP_ATTR", None)
    decoupled = getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
    seen = {id(g) for g in counted}
    left_out = []
    for param in optimizer.get_parameters():
        if group_attr is not None and getattr(param, group_attr, None) is not None:
            continue  # counted in its group's own norm
        grad = getattr(param, "decoupled_grad", None) if decoupled else param.grad
        if grad is not None and grad.numel() and id(grad) not in seen:
            left_out.append(grad)
    return left_out


def _with_left_out_marker(optimizer, get_grads):
    @functools.wraps(get_grads)
    def grads_for_norm(*args, **kwargs):
        grads = get_grads(*args, **kwargs)
        if (args[0] if args else kwargs.get("grad_norm_group")) is not None:
            return grads  # 0.19's norm of a separate group
        left_out = _left_out_grads(optimizer, grads)
        if not left_out:
            return grads
        # On the device, no host sync: 0 when all finite, else NaN (a 1-element fp32 term of the norm).
        finite = torch.stack([g.isfinite().all() for g in left_out]).all()
        marker = torch.where(finite, 0.0, math.nan).to(device=left_out[0].device, dtype=torch.float32).view(1)
        return list(grads) + [marker]

    return grads_for_norm


def _count_left_out_grads(optimizer) -> None:
    from megatron.core.optimizer import ChainedOptimizer

    subs = getattr(optimizer, "chained_optimizers", []) if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for sub in subs:
        name = _grads_getter_name(sub)
        if hasattr(sub, name):  # an optimizer without one has no gradients of its own
            setattr(sub, name, _with_left_out_marker(sub, getattr(sub, name)))


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
    _count_left_out_grads(optimizer)
    optimizer.prepare_grads = _checked_prepare(optimizer.prepare_grads)
    return True


def grads_checked_in_step(optimizer) -> bool:
    """Whether :func:`check_grads_in_step` is installed on ``optimizer``."""
    return getattr(getattr(optimizer, "prepare_grads", None), "checks_grads", False)


def device_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor=False, *args):
    """The L2 norm over ``tensor_lists`` as ``amp_C.multi_tensor_l2norm`` returns it, ``(norm as a 1-element
    fp32 tensor, None)``, computed on the tensors' device without reading anything on the host.

    megatron-core's stand-in where neither Transformer Engine nor Apex is installed,
    ``megatron.core.utils.local_multi_tensor_l2_norm``, builds ``torch.tensor`` from the per-tensor norms: one
    device-to-host copy a gradient tensor and one more for the total, each a host sync (160 a step at
    gpu-400m on an H100). Norms are taken in fp32 whatever the gradients' dtype (as amp_C's), on the first
    tensor's device. ``per_tensor`` norms are refused: megatron's grad norm asks for none."""
    if per_tensor:
        raise NotImplementedError("device_multi_tensor_l2_norm: per-tensor norms are not computed")
    tensors = [t for ts in tensor_lists for t in ts]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    device = tensors[0].device
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    return total.reshape(1), None


def keep_grad_norm_on_device() -> bool:
    """Give megatron-core's grad norm :func:`device_multi_tensor_l2_norm` where it would use its host-reading
    stand-in (no Transformer Engine, no Apex); True when it does. TE's and Apex's fused kernels are kept."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    impl = getattr(clip_grads, "l2_norm_impl", None)
    if impl is device_multi_tensor_l2_norm:
        return True
    if impl is not getattr(utils, "local_multi_tensor_l2_norm", None):
        return False
    clip_grads.l2_norm_impl = device_multi_tensor_l2_norm
    return True


def device_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``'s contract, ``tensor_lists[1][i] = tensor_lists[0][i] * scale``, in torch's
    foreach operators: one launch per operator and dtype group instead of megatron-core's stand-in
    (``megatron.core.utils.local_multi_tensor_scale``), which issues a multiply and a copy per tensor
    (clipping scales every gradient this way, 2 x 146 launches a step at gpu-400m's 24 layers; the
    non-distributed mixed-precision optimizer copies its fp32 parameters into the bf16 ones this way, where
    0.16.1's distributed optimizer copies shard by shard with ``copy_``: :func:`copy_main_params_in_one_launch`).
    The same products, rounded to the destination's dtype as ``copy_`` rounds them; a scale of 1 is a copy."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if not dst:
        return
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def keep_multi_tensor_scale_batched() -> bool:
    """Give megatron-core's parameter copies and gradient clipping :func:`device_multi_tensor_scale` where they
    would use its per-tensor stand-in (no Transformer Engine, no Apex); True when they do. TE's and Apex's
    kernels are kept."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    local = getattr(utils, "local_multi_tensor_scale", None)
    installed = False
    for module in (clip_grads, megatron_optimizer):
        impl = getattr(module, "multi_tensor_scale_impl", None)
        if impl is device_multi_tensor_scale:
            installed = True
        elif impl is local and local is not None:
            module.multi_tensor_scale_impl = device_multi_tensor_scale
            installed = True
    return installed


def _torch_adams(optimizer):
    """The torch Adam/AdamW instances inside megatron-core's (chained) optimizer."""
    from megatron.core.optimizer import ChainedOptimizer

    subs = getattr(optimizer, "chained_optimizers", []) if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    inner = [getattr(sub, "optimizer", None) for sub in subs]
    return [o for o in inner if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))]


def use_adam_impl(optimizer, impl: str) -> str:
    """Run the torch AdamW inside megatron-core's ``optimizer`` (built without Transformer Engine or Apex) as
    ``impl``: ``fused`` (torch's fused=True: one kernel per dtype and device a step, the step counts on the
    device; foreach reads its host-side counts per parameter, which syncs no GPU: the gain is launches),
    ``foreach`` (torch's default), ``auto`` (fused where every parameter is on CUDA). Called after the build
    and again after a checkpoint's load, whose saved groups carry the implementation they were saved with.
    Returns the implementation in use ('' without a torch Adam)."""
    adams = _torch_adams(optimizer)
    if not adams:
        return ""
    if impl == "auto":
        devices = {p.device.type for o in adams for g in o.param_groups for p in g["params"]}
        impl = "fused" if devices == {"cuda"} else "foreach"
    fused = impl == "fused"
    for o in adams:
        for group in [*o.param_groups, o.defaults]:
            group["fused"], group["foreach"] = fused, not fused
        o._step_supports_amp_scaling = fused
        for group in o.param_groups:
            for p in group["params"]:
                state = o.state.get(p, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor):
                    # A new tensor a parameter: megatron's load_state_dict gives every parameter one shared step
                    # tensor, which the fused kernel's in-place increment would advance once per parameter.
                    # torch keeps the count on the parameter's device for the fused kernel and where the group
                    # is capturable (CUDA graphs; it refuses a host step then), on the host otherwise.
                    on_device = fused or group.get("capturable", False)
                    state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                                 device=p.device if on_device else "cpu")
    return impl


def _pairs_by_dst_dtype(dst, src) -> list[tuple[list, list]]:
    """``(destinations, sources)`` grouped by the destination's dtype, in first-seen order."""
    groups: dict[torch.dtype, tuple[list, list]] = {}
    for d, s in zip(dst, src):
        ds, ss = groups.setdefault(d.dtype, ([], []))
        ds.append(d)
        ss.append(s)
    return list(groups.values())


def _copy_main_params_in_one_launch(optimizer) -> None:
    """``DistributedOptimizer._copy_main_params_to_model_params`` for bf16/fp16/fp32 parameters: the same
    copies of the updated fp32 shards into the parameter buffers, as one foreach copy a destination dtype
    (torch's CUDA foreach copy takes every destination to have the first one's dtype)."""
    dst, src = [], []
    for shard_groups, model_groups in ((optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups),
                                       (optimizer.shard_fp32_groups, optimizer.model_fp32_groups)):
        for shard_group, model_group in zip(shard_groups, model_groups):
            for shard_main_param, model_param in zip(shard_group, model_group):
                world_range = optimizer._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                assert world_range.size == shard_main_param.nelement()
                gbuf_index, _, bucket_id = optimizer.model_param_gbuf_map[model_param]
                buffer = optimizer.buffers[gbuf_index].buckets[bucket_id].param_data
                dst.append(buffer.view(-1)[world_range.start:world_range.end])
                src.append(shard_main_param)
    for dsts, srcs in _pairs_by_dst_dtype(dst, src):
        torch._foreach_copy_(dsts, srcs)


def _quantizes(sub) -> bool:
    """Whether megatron's own copy quantizes the main shards or gathers from elsewhere: FP8 parameter gather,
    the MXFP8 gather through the gradient buffer (a DDP and an optimizer config field), 0.19's FP4 gather."""
    ddp, config = sub.ddp_config, sub.config
    return bool(getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False)
                or getattr(ddp, "reuse_grad_buf_for_mxfp8_param_ag", False)
                or getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False))


def copy_main_params_in_one_launch(optimizer) -> bool:
    """Give megatron-core's distributed optimizers (inside ``optimizer``) a parameter copy after the update in
    one foreach launch a dtype, where megatron copies shard by shard (146 launches a step at gpu-400m's 24
    layers); not where it does more than copy (FP8 parameters, FP8/FP4 parameter all-gather, 0.19's MXFP8
    all-gather from the gradient buffer, Megatron FSDP, the precision-aware optimizer). True when at least one
    was given it."""
    from megatron.core.fp8_utils import is_float8tensor
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", []) if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    done = False
    for sub in subs:
        if not isinstance(sub, DistributedOptimizer) or sub.is_stub_optimizer or sub.ddp_config.use_megatron_fsdp \
                or getattr(sub.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            continue
        if any(is_float8tensor(p) for group in sub.model_float16_groups for p in group) or _quantizes(sub):
            continue
        sub._copy_main_params_to_model_params = functools.partial(_copy_main_params_in_one_launch, sub)
        done = True
    return done

