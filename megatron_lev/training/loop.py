"""The pretraining loop over megatron-core pieces (not re-implemented here):

- ``get_forward_backward_func`` (no pipelining, 1F1B, interleaved 1F1B with virtual stages),
- megatron ``DistributedDataParallel`` (grad buffers, optional overlapped grad reduce / param gather),
- ``get_megatron_optimizer`` (Adam(W)/SGD, fp16/bf16 with loss scaling, distributed optimizer,
  gradient clipping), ``finalize_model_grads`` (DP/embedding/sequence-parallel reductions),
- ``OptimizerParamScheduler`` (warmup, then constant/linear/cosine/inverse-sqrt/WSD decay to --min-lr).

One iteration = one optimizer step over the current global batch, in
``num_microbatches = global / (micro x data-parallel)`` micro-batches per data-parallel rank. The
global batch is ``--global-batch-size``, or megatron-core's micro-batch calculator's for the consumed
samples (``--rampup-batch-size``, ``--step-batch-size-schedule``); as in Megatron-LM, a checkpoint is
saved (with ``--save``) whenever the number of micro-batches changes.

Loss normalisation (megatron-core's schedules): by default each micro-batch's loss is its mean over
its tokens, averaged over the micro-batches and data-parallel ranks; ``--calculate-per-token-loss``
sums over tokens and ``finalize_model_grads`` divides by the step's global token count.

LEV ``table`` compute mode: the first forward of a step evaluates G once over the vocabulary (inside
the module, so after megatron DDP's forward pre-hooks have finished an overlapped parameter
all-gather); ``finish_table_step()`` runs after the last backward and before the gradient reduction
(the accumulated row gradients go back through G with one gradient delivery per parameter, which is
what megatron DDP's overlapped grad reduce counts on), as the first thing of the finalize-grads hook
that the schedule calls.

What ends a run early (SIGTERM, Ctrl-C, NaN/Inf, --exit-interval, --exit-duration-in-mins, a lost rank) and
the line it prints is in ``faults``; the profiler, memory history and manual GC around the steps in
``profiling``. The loop asks them in a few lines (``_train``, ``_train_loop``, ``_train_step``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Optional

import torch

from megatron_lev import checkpoint
from megatron_lev._procutil import EXIT_INTERRUPTED
from megatron_lev.arguments import format_config, parse_run_config, resolved_config
from megatron_lev.arguments.precision import OPTIMIZER_DTYPE_FIELDS, OPTIMIZER_DTYPES
from megatron_lev.arguments.schedule import batch_calculator, batch_sizes, check_interleaved_microbatches
from megatron_lev.compat.optimizer import NonFiniteGrads, check_grads_in_step, keep_grad_norm_on_device, \
    copy_main_params_in_one_launch, keep_multi_tensor_scale_batched, use_adam_impl
from megatron_lev.compat.versions import fallback_notice
from megatron_lev.config import RunConfig
from megatron_lev.config.groups import ScheduleConfig
from megatron_lev.data.datasets import DatasetValidationError
from megatron_lev.distributed import DistributedConfigError, destroy_distributed, init_distributed, report_error, \
    set_seed
from megatron_lev.lev.config import ConfigError
from megatron_lev.models import factory, format_parameter_breakdown, parameter_breakdown
from megatron_lev.parallel.collectives import all_gather_objects, all_reduce_, broadcast_object, group_device
from megatron_lev.parallel.weight_decay import weight_decay_overrides

from . import faults, grad_groups, profiling
from .data import build_datasets, build_tokenizer_from_args, close_iterators, get_batch, train_iterators, \
    valid_iterators
from .faults import EXIT_CONFIG_ERROR, EXIT_NAN, EXIT_SAVE_FAILED, NanDetected, Terminated, rank_is0
from .flops import flops_per_iteration, peak_statement, peak_tflops_per_device
from .logger import LogWriterError, TrainingLogger, memory_scalars
from .progress_log import ProgressLog
from .moe_metrics import reset_aux_loss_trackers, step_aux_losses
from .params_norm import params_l2_norm


@dataclass
class _State:
    """The run's state: counters saved in checkpoints, and the iteration of the latest save."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    last_saved: Optional[int] = None
    saving: Optional[int] = None
    """The iteration whose checkpoint is being written (None between saves)."""
    num_zeros_in_grad: Optional[float] = None
    """The last optimizer step's zero gradient entries (--log-num-zeros-in-grad; not saved)."""
    floating_point_operations: float = 0.0
    """Of every step so far, resumes included (Megatron-LM's num_floating_point_operations_so_far)."""
    grad_group_squares: Optional[torch.Tensor] = None
    """The last step's squared gradient norms of the input side, body and head before clipping, on the device
    (``grad_groups``; computed on the logged steps only; not saved)."""

    def counters(self) -> Dict[str, Any]:
        return {"skipped_iterations": self.skipped_iterations, "nan_iterations": self.nan_iterations,
                "floating_point_operations": self.floating_point_operations}

    def restore(self, loaded: Dict[str, Any]) -> None:
        """Continue from a loaded checkpoint's common state."""
        self.iteration = int(loaded["iteration"])
        self.consumed_train_samples = int(loaded["consumed_train_samples"])
        self.skipped_iterations = int(loaded["counters"].get("skipped_iterations", 0))
        self.nan_iterations = int(loaded["counters"].get("nan_iterations", 0))
        self.floating_point_operations = float(loaded["counters"].get("floating_point_operations", 0.0))
        self.last_saved = self.iteration if self.iteration > 0 else None


@dataclass
class _Interval:
    """Time, iterations and losses since the last log line."""

    start: float
    iters: int = 0
    samples: int = 0
    flops: float = 0.0
    losses: List[float] = field(default_factory=list)
    aux_losses: Dict[str, List[float]] = field(default_factory=dict)
    """The MoE and MTP losses of each step (``moe_metrics.step_aux_losses``), by name."""


# ------------------------------------------------------------------------------------------------
# start-up


def _wrap_model(rc: RunConfig, config, chunks):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    for chunk in chunks:
        for p in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    if torch.cuda.is_available():
        chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    if rc.model.fp16 or rc.model.bf16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    dist = rc.distributed
    kw = dict(
        grad_reduce_in_fp32=dist.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=dist.overlap_grad_reduce,
        overlap_param_gather=dist.overlap_param_gather,
        use_distributed_optimizer=rc.optimizer.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # checked by the loop (clean message, optional skip)
    )
    if dist.ddp_bucket_size is not None:
        kw["bucket_size"] = dist.ddp_bucket_size
    ddp_config = DistributedDataParallelConfig(**kw)
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def optimizer_config(rc: RunConfig, params_dtype: torch.dtype):
    """megatron-core's OptimizerConfig of the run, as Megatron-LM fills it from its arguments (the
    precision-aware optimizer's state dtypes by their Megatron-LM names, fp8 as uint8)."""
    from megatron.core.optimizer import OptimizerConfig

    opt, model = rc.optimizer, rc.model
    dtypes = {f: getattr(torch, OPTIMIZER_DTYPES[getattr(opt, f)]) for f in OPTIMIZER_DTYPE_FIELDS}
    return OptimizerConfig(
        optimizer=opt.optimizer, lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        sgd_momentum=opt.sgd_momentum, clip_grad=opt.clip_grad, bf16=model.bf16, fp16=model.fp16,
        params_dtype=params_dtype, loss_scale=opt.loss_scale, initial_loss_scale=opt.initial_loss_scale,
        min_loss_scale=opt.min_loss_scale, loss_scale_window=opt.loss_scale_window, hysteresis=opt.hysteresis,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        overlap_param_gather=rc.distributed.overlap_param_gather,
        decoupled_lr=opt.decoupled_lr, decoupled_min_lr=opt.decoupled_min_lr,
        use_precision_aware_optimizer=opt.use_precision_aware_optimizer, **dtypes,
        # The distributed optimizer and the precision-aware one treat FP8 parameters by recipe.
        fp8_recipe=model.fp8_recipe if model.fp8_format is not None else None,
        log_num_zeros_in_grad=rc.logging.log_num_zeros_in_grad,
    )


def _build_optimizer(rc: RunConfig, config, model):
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = optimizer_config(rc, config.params_dtype)

    # Megatron's rule (no decay on 1-D params and biases) plus LEV's: decay Delta, A, W and the
    # codebooks; never its LayerNorm parameters, biases or the offset. With --decoupled-lr, megatron's
    # own override gives the parameters marked is_embedding_or_output_parameter their max/min lr.
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=weight_decay_overrides(opt_config))
    keep_grad_norm_on_device()  # without TE or Apex, megatron's grad norm reads each gradient's norm on the host
    keep_multi_tensor_scale_batched()  # ... and its parameter copies and clipping launch twice per tensor
    use_adam_impl(optimizer, rc.optimizer.adam_impl)
    copy_main_params_in_one_launch(optimizer)  # the distributed optimizer copies its shards one by one
    if rc.distributed.check_for_nan_in_loss_and_grad and not rc.model.fp16:
        # The gradients' NaN/Inf check rides on the grad norm that step() computes (one read of the grads).
        check_grads_in_step(optimizer, config)
    sched = rc.schedule
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=sched.lr_warmup_init, max_lr=rc.optimizer.lr, min_lr=rc.optimizer.min_lr,
        lr_decay_style=sched.lr_decay_style, start_wd=sched.start_weight_decay, end_wd=sched.end_weight_decay,
        wd_incr_style=sched.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=sched.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=sched.override_opt_param_scheduler,
        lr_wsd_decay_style=sched.lr_wsd_decay_style, **_scheduler_steps(sched),
    )
    return optimizer, scheduler


def _scheduler_steps(sched: "ScheduleConfig") -> Dict[str, Any]:
    """The scheduler's step counts, in samples, as Megatron-LM's ``get_optimizer_param_scheduler``:
    the iteration counts times the global batch, or the sample counts (--train-samples)."""
    if sched.train_samples is None:
        gbs = sched.global_batch_size
        decay = sched.lr_decay_iters * gbs
        warmup = (int(sched.lr_warmup_fraction * decay) if sched.lr_warmup_fraction is not None
                  else sched.lr_warmup_iters * gbs)
        return dict(lr_decay_steps=decay, lr_warmup_steps=warmup, wd_incr_steps=max(1, sched.train_iters) * gbs,
                    wsd_decay_steps=(sched.lr_wsd_decay_iters * gbs) if sched.lr_wsd_decay_iters else None)
    decay = sched.lr_decay_samples
    warmup = (int(sched.lr_warmup_fraction * decay) if sched.lr_warmup_fraction is not None
              else sched.lr_warmup_samples)
    return dict(lr_decay_steps=decay, lr_warmup_steps=warmup, wd_incr_steps=sched.train_samples,
                wsd_decay_steps=sched.lr_wsd_decay_samples)


def _grad_sync_with_tables(chunk, tables):
    """The chunk's grad sync, after its LEV tables (table mode) have delivered their gradients.

    The interleaved schedule starts a chunk's grad sync right after the chunk's last backward, before
    finalize: the table's row gradients are complete then, but not yet pushed through G. Pushing them
    here, inside ``no_sync`` (so DDP's hooks accumulate the main grads without counting them as ready),
    puts LEV's gradients in the bucket before it is dispatched; finalize then finds the table gone."""
    if not tables:
        return chunk.start_grad_sync

    def sync(*a):
        with chunk.no_sync():
            for m in tables:
                m.finish_table_step()
        return chunk.start_grad_sync(*a)

    return sync


def _configure_hooks(rc: RunConfig, config, model, optimizer, table_modules) -> None:
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    if rc.distributed.overlap_grad_reduce:
        no_sync = [m.no_sync for m in model]
        grad_sync = [_grad_sync_with_tables(m, [t for t in table_modules if _holds(m, t)]) for m in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if rc.distributed.overlap_param_gather:
        param_sync = [m.start_param_sync for m in model]
        config.param_sync_func = param_sync[0] if len(model) == 1 else param_sync

    def finalize(*a, **kw):
        # LEV table mode: push the table's gradient back through G first (a no-op for a table that the
        # chunk's grad sync has already finished).
        for m in table_modules:
            m.finish_table_step()
        return finalize_model_grads(*a, **kw)

    config.finalize_model_grads_func = finalize


def _holds(chunk, module) -> bool:
    return any(m is module for m in chunk.modules())


# ------------------------------------------------------------------------------------------------
# one step


def _forward_step(state: _State, rc: RunConfig, data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, mask_dtype=getattr(torch, rc.model.params_dtype_name))
    output = model(tokens, position_ids, attention_mask, labels=labels)
    inject = faults.inject_nan(rc, state.iteration + 1)
    return output, partial(_loss_func, loss_mask, inject and model.training)


def _loss_func(loss_mask, inject_nan: bool, output_tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    if inject_nan:  # test hook (--inject-nan-at-iteration)
        loss = loss * float("nan")
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach().clone(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": report}


def _reduce_losses(losses_reduced: List[Dict[str, torch.Tensor]]) -> Optional[float]:
    """Token-weighted loss of the step over micro-batches and data-parallel ranks (None if no tokens)."""
    from megatron.core import parallel_state as ps

    buf = torch.zeros(2, dtype=torch.float64, device=group_device())
    if (losses_reduced and ps.is_pipeline_last_stage(ignore_virtual=True)
            and ps.get_tensor_model_parallel_rank() == 0):
        buf += torch.stack([d["lm loss"] for d in losses_reduced]).double().sum(dim=0).to(buf.device)
    all_reduce_(buf)
    # Summed and reduced on the device, copied to the host once per step: the log line and the NaN check
    # need the loss there.
    buf = buf.cpu()
    if buf[1] <= 0:
        return None
    return float(buf[0] / buf[1])


def _aux_losses(config, num_microbatches: int, iteration: int) -> Dict[str, float]:
    """The step's MoE and MTP losses on every rank (``step_aux_losses`` is a collective; rank 0, which logs,
    gets the MTP losses from the last stage). Empty for a dense model without MTP (no collective)."""
    from megatron.core import parallel_state as ps

    losses = step_aux_losses(config, num_microbatches, iteration)
    mtp = [f"mtp_{k + 1} loss" for k in range(config.mtp_num_layers or 0)]
    if mtp:
        # One contributor (the last stage's first TP and DP rank), so the sum is its value exactly.
        own = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
               and ps.get_data_parallel_rank() == 0)
        buf = torch.tensor([losses.get(n, 0.0) if own else 0.0 for n in mtp], dtype=torch.float64)
        all_reduce_(buf)
        losses.update(zip(mtp, buf.tolist()))
    return losses


def _empty_cuda_cache(rc: RunConfig, level: int) -> None:
    """--empty-unused-memory-level: hand the CUDA caching allocator's unused blocks back (as Megatron-LM,
    level 1 after the backward and each evaluation step, level 2 also after the optimizer step)."""
    if rc.run.empty_unused_memory_level >= level:
        torch.cuda.empty_cache()


def _train_step(rc: RunConfig, state, model, optimizer, scheduler, train_iter, table_modules, num_microbatches=None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_microbatches = rc.schedule.num_microbatches if num_microbatches is None else num_microbatches
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # LEV table mode: the table is built by the step's first forward and consumed in finalize.
    with profiling.span("forward_backward"):
        losses_reduced = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, state, rc), data_iterator=train_iter, model=model,
            num_microbatches=num_microbatches, seq_length=rc.data.seq_length,
            micro_batch_size=rc.schedule.micro_batch_size, decoder_seq_length=rc.data.seq_length, forward_only=False,
        )
    _empty_cuda_cache(rc, 1)
    state.grad_group_squares = None
    with profiling.span("loss"):
        loss = _reduce_losses(losses_reduced)
        nonfinite = faults.nonfinite_before_step(rc, loss, model, optimizer)
    if nonfinite is not None:
        return faults.nan_step(rc, state.iteration, nonfinite, loss)
    if grad_groups_due(rc, state.iteration + 1):
        # Before the step, which clips the gradients in place; read on the host only by the log line.
        state.grad_group_squares = grad_groups.group_squares(model, experts=bool(rc.model.num_experts))
    try:
        with profiling.span("optimizer"):
            update_successful, grad_norm, state.num_zeros_in_grad = optimizer.step()
    except NonFiniteGrads:  # raised by the step's own grad norm, before its update (check_grads_in_step)
        return faults.nan_step(rc, state.iteration, "gradients", loss)
    if update_successful:
        # The scheduler counts samples (Megatron-LM): this step's global batch.
        scheduler.step(increment=num_microbatches * rc.schedule.micro_batch_size * rc.layout.dp)
    _empty_cuda_cache(rc, 2)
    grad_norm = float(grad_norm) if grad_norm is not None else None
    return loss, grad_norm, update_successful, loss is None or not math.isfinite(loss)


@torch.no_grad()
def evaluate(rc: RunConfig, model, valid_dataset, table_modules) -> Optional[float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if valid_dataset is None or rc.schedule.eval_iters == 0:
        return None
    for chunk in model:
        chunk.eval()
    it = valid_iterators(valid_dataset, rc)
    dummy = _State(iteration=-10)
    collected: List[Dict[str, torch.Tensor]] = []
    # LEV table mode outside training evaluates G per distinct id (no table, no gradient).
    try:
        for _ in range(rc.schedule.eval_iters):
            collected += get_forward_backward_func()(
                forward_step_func=partial(_forward_step, dummy, rc), data_iterator=it, model=model,
                num_microbatches=rc.schedule.num_microbatches, seq_length=rc.data.seq_length,
                micro_batch_size=rc.schedule.micro_batch_size, decoder_seq_length=rc.data.seq_length, forward_only=True,
            )
            _empty_cuda_cache(rc, 1)
    finally:
        close_iterators(it)
    for chunk in model:
        chunk.train()
    return _reduce_losses(collected)


# ------------------------------------------------------------------------------------------------
# the run


def _will_load_checkpoint(rc: RunConfig) -> bool:
    """Collective. Whether the run will load its weights from --load (LEV then skips its initialisation,
    whose vocabulary statistics are collectives over the tensor-parallel ranks). Rank 0's look, sent to
    every rank: another rank's could differ (--load created at this moment by rank 0's TensorBoard or
    wandb writer, a tracker a node's filesystem cache does not show yet), and a rank that initialised
    alone would wait for the others in the statistics' all-reduces."""
    found = None
    if torch.distributed.get_rank() == 0:
        found = False
        try:
            if rc.checkpointing.load and os.path.isdir(rc.checkpointing.load):
                ck = rc.checkpointing
                found = ck.ckpt_step is not None or checkpoint.find_checkpoint(ck.load) is not None
        except (checkpoint.CheckpointError, OSError):
            pass  # reported by the load itself
    return bool(broadcast_object(found))


def _count_params(model) -> int:
    from megatron.core import parallel_state as ps

    n = sum(p.numel() for chunk in model for p in chunk.parameters()
            if getattr(p, "allreduce", True) or ps.get_tensor_model_parallel_rank() == 0)
    return n


def pretrain(argv: Optional[List[str]] = None) -> int:
    """Entry point of pretrain_lev.py; returns the process exit code.

    Inside a process that already holds a default process group (e.g. several runs in one torchrun
    job) the run uses it and leaves it in place; megatron's parallel state is set up and torn down
    per run either way."""
    rank_env = int(os.environ.get("RANK", "0"))
    try:
        rc, tokenizer, config, model_config = _setup_configs(argv)
        setup = init_distributed(
            layout=rc.layout, backend=rc.distributed.distributed_backend,
            timeout_minutes=rc.distributed.distributed_timeout_minutes)
    except (_StartupError, DistributedConfigError) as e:
        report_error(str(e), show=rank_env == 0)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        report_error("interrupted (Ctrl-C) during start-up, before the model was built; nothing was written",
                     show=rank_env == 0)
        return EXIT_INTERRUPTED
    lock, sigterm = None, None
    try:
        lock = _take_save_lock(rc)
        sigterm = faults.SigtermRaises() if lock is not None else None
        return _run(rc, tokenizer, config, model_config)
    except Terminated:  # outside the loop, on the rank holding --save's lock (the loop reports its own)
        report_error(f"terminated by SIGTERM outside the training loop; {faults.last_checkpoint(rc)[1]}",
                     show=rank_is0())
        return faults.EXIT_TERMINATED
    except _StartupError as e:
        report_error(str(e), show=rank_is0())
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:  # in _run's start-up (model, checkpoint load, data): the loop reports its own
        report_error(f"interrupted (Ctrl-C) during start-up, before training started; {faults.last_checkpoint(rc)[1]}",
                     show=rank_is0())
        return EXIT_INTERRUPTED
    except checkpoint.CheckpointSaveError as e:
        report_error(str(e), show=rank_is0())
        torch.distributed.barrier()  # no rank exits (and gets the others killed) before the line is out
        return EXIT_SAVE_FAILED
    finally:
        if sigterm is not None:
            sigterm.release()
        if lock is not None:  # however the run ended (SIGTERM and Ctrl-C are exceptions here)
            lock.release()
        # The config holds the run's hooks (no_sync, finalize_model_grads: bound to its DDP model), which keep
        # the model and its process groups alive: dropped before the teardown collects them.
        del config, model_config
        destroy_distributed(setup)


class _StartupError(Exception):
    pass


def _take_save_lock(rc: RunConfig) -> Optional[checkpoint.SaveLock]:
    """Collective. Rank 0 takes --save's lock before anything is written there and sends its verdict, so a
    refusal stops every rank with its line (the lock and its release are rank 0's alone)."""
    lock, error = None, None
    if rc.checkpointing.save and rank_is0():
        try:
            lock = checkpoint.take_save_lock(rc.checkpointing.save, log=lambda line: print(line, flush=True))
        except checkpoint.CheckpointError as e:
            error = str(e)
    error = broadcast_object(error) if rc.checkpointing.save else None
    if error is not None:
        raise _StartupError(error)
    return lock


def _startup_errors():
    return (ConfigError, checkpoint.CheckpointError, DatasetValidationError)


def _setup_configs(argv):
    """The run's configuration (the flags parsed and validated, the tokenizer's vocabulary and fingerprint
    in it), the tokenizer and the typed model configs (TransformerConfig, LevModelConfig)."""
    try:
        rc = parse_run_config(argv)
        # Newer checkpoints in --save are judged once the ranks can share reading them (_run), unless only
        # their sizes are checked.
        checkpoint.check_save_and_load(rc.checkpointing, newer=rc.checkpointing.no_ckpt_checksums)
        try:
            tokenizer = build_tokenizer_from_args(rc.data)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise ConfigError(f"--tokenizer-type {rc.data.tokenizer_type}: {str(e).splitlines()[0]}") from None
        rc = rc.with_tokenizer(tokenizer)
        # The loss flags are TransformerConfig fields that only training reads.
        config, model_config = factory.build_configs(
            rc, calculate_per_token_loss=rc.model.calculate_per_token_loss,
            cross_entropy_loss_fusion=rc.model.cross_entropy_loss_fusion,
            cross_entropy_fusion_impl=rc.model.cross_entropy_fusion_impl)
    except _startup_errors() as e:
        raise _StartupError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    return rc, tokenizer, config, model_config


@dataclass
class _Run:
    """What the loop works with, built once at start-up (``_start``)."""

    rc: RunConfig
    """The run's typed configuration."""
    config: Any
    """megatron-core's TransformerConfig."""
    model_config: Any
    """The project's LevModelConfig."""
    cfg: Dict[str, Any]
    """The resolved arguments (printed at start-up, saved with every checkpoint)."""
    logger: TrainingLogger
    model: List[Any]
    optimizer: Any
    scheduler: Any
    table_modules: List[Any]
    t_start: float
    batches: Any = None
    """megatron-core's micro-batch calculator (constant, ramp-up or step schedule)."""
    train_iter: Any = None
    valid_ds: Any = None
    flops: Any = None
    """FLOPs of one iteration, by global batch size."""
    peak: Optional[float] = None
    stops: Optional[faults.Stops] = None
    progress: Optional[ProgressLog] = None
    """--log-progress's progress.txt (a disabled one without the flag, and on ranks other than 0)."""
    """SIGTERM, --exit-duration-in-mins, --exit-interval (installed with the data, released at the end)."""
    logging_level: Optional[int] = None
    """The root logger's level before --logging-level (restored at the end)."""


def _run(rc: RunConfig, tokenizer, config, model_config) -> int:
    with profiling.memory_history(rc):
        return _run_recorded(rc, tokenizer, config, model_config)


def _run_recorded(rc: RunConfig, tokenizer, config, model_config) -> int:
    if not rc.checkpointing.no_ckpt_checksums:
        try:
            checkpoint.refuse_newer_checkpoints(rc.checkpointing, checksums_on=True)
        except checkpoint.CheckpointError as e:
            raise _StartupError(str(e)) from None
    run = _start(rc, config, model_config)
    state = _State()
    _load(run, state)
    impl = use_adam_impl(run.optimizer, rc.optimizer.adam_impl)  # a loaded checkpoint's groups carry the saved one
    if impl:
        run.logger.log(f"optimizer: torch's AdamW, {impl} (--adam-impl {rc.optimizer.adam_impl})")
    _start_data(run, state, tokenizer)
    try:
        return _train(run, state)
    except (KeyboardInterrupt, Terminated, Exception) as e:
        code = faults.stop_code(e, rc, state, run.stops)  # Ctrl-C, SIGTERM, a lost rank: one line
        if code is None:
            raise
        return code
    finally:
        close_iterators(run.train_iter)
        if run.stops is not None:
            run.stops.release()
        if run.logging_level is not None:
            logging.getLogger().setLevel(run.logging_level)
        run.logger.close()
        _release_hooks(run.config, run.model)


def _release_hooks(config, model) -> None:
    """Undo the run's references that pass through autograd's C++ side, which Python's garbage collector
    cannot follow, so that a process outliving the run (several runs in one job) frees its model, optimizer
    and gloo process groups:

    * _configure_hooks's functions on the model's TransformerConfig (every module holds the config): its
      ``grad_scale_func`` holds the optimizer, whose fp32 shards under the distributed optimizer are views of
      the parameters, and their graph leads to megatron DDP's backward hooks, which hold the DDP module;
    * the DDP module's gradient-accumulator nodes (``grad_accs``), whose backward hooks hold the module."""
    for name in ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
                 "finalize_model_grads_func"):
        setattr(config, name, None)
    for chunk in model or ():
        accs = getattr(chunk, "grad_accs", None)
        if isinstance(accs, list):
            accs.clear()


def _vocab_size_notice(rc: RunConfig) -> Optional[str]:
    """The line that says a --vocab-size given beside a tokenizer with files sizes the model's vocabulary."""
    from megatron_lev.tokenizer.tokenizers import vocab_size_sets_tokenizer

    d = rc.data
    if d.vocab_size is None or vocab_size_sets_tokenizer(d.tokenizer_type, d.tiktoken_pattern):
        return None
    ids = (d.tokenizer_fingerprint or {}).get("vocab_size", "its")
    return (f" > --vocab-size {d.vocab_size} beside the {d.tokenizer_type} ({ids} ids): the model's vocabulary is "
            f"{d.vocab_size}, {rc.model.padded_vocab_size} rows once padded")


def _start(rc: RunConfig, config, model_config) -> _Run:
    """Logger, seeds, model chunks (with the parameter report), DDP, optimizer and schedule hooks."""
    from megatron.core import parallel_state as ps

    t_start = time.time()
    if rc.run.profile and not rc.run.use_pytorch_profiler and not torch.cuda.is_available():
        raise _StartupError("--profile without --use-pytorch-profiler records nsys ranges (torch.cuda.profiler), "
                            "which needs CUDA; add --use-pytorch-profiler for a torch.profiler trace")
    logging_level = _set_logging_level(rc)
    try:
        logger = _start_logger(rc)
    except _StartupError:
        if logging_level is not None:
            logging.getLogger().setLevel(logging_level)
        raise
    if torch.cuda.is_available():
        notice = fallback_notice()
        if notice is not None:
            logger.log(notice)
    notice = _vocab_size_notice(rc)
    if notice:
        logger.log(notice)
    cfg = resolved_config(rc.to_saved_args())
    if not rc.logging.quiet_config:
        logger.log(format_config(cfg))
    logger.set_config(cfg)

    set_seed(rc.run.seed)
    # Every weight is about to come from the checkpoint: LEV skips its vocabulary-wide initialisation.
    model_config.weights_from_checkpoint = _will_load_checkpoint(rc)
    chunks = factory.build_model_chunks(config, model_config)
    logger.log(format_parameter_breakdown(parameter_breakdown(model_config, config)))
    logger.log(f" > number of parameters on (tensor, pipeline) model parallel rank "
               f"({ps.get_tensor_model_parallel_rank()}, {ps.get_pipeline_model_parallel_rank()}): "
               f"{_count_params(chunks)}")
    model = _wrap_model(rc, config, chunks)
    table_modules = factory.lev_table_modules(chunks)
    optimizer, scheduler = _build_optimizer(rc, config, model)
    _configure_hooks(rc, config, model, optimizer, table_modules)
    return _Run(rc=rc, config=config, model_config=model_config, cfg=cfg, logger=logger, model=model,
                optimizer=optimizer, scheduler=scheduler, table_modules=table_modules, t_start=t_start,
                batches=batch_calculator(rc.schedule, rc.layout.dp, rc.data.seq_length,
                                                                    rank=torch.distributed.get_rank()), logging_level=logging_level)


def _start_logger(rc: RunConfig) -> TrainingLogger:
    """Collective. The run's logger, whose writers start on one rank each (TensorBoard and --metrics-file on
    rank 0, wandb on the last): their failure (wandb without a login on the node, a folder made read-only
    since the start-up checks) stops every rank with its line, instead of that rank alone while the others
    wait for it in the model's first collectives."""
    logger, error = None, None
    try:
        logger = TrainingLogger(rc.logging, save=rc.checkpointing.save)
    except LogWriterError as e:
        error = str(e)
    error = next((e for e in all_gather_objects(error) if e is not None), None)  # rank 0's first
    if error is not None:
        raise _StartupError(error)
    return logger


def _set_logging_level(rc: RunConfig) -> Optional[int]:
    """Megatron-LM's --logging-level (else $MEGATRON_LOGGING_LEVEL) on the root logger; the previous
    level (None when unchanged)."""
    level = rc.logging.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        try:
            level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
        except ValueError:
            raise _StartupError(f"MEGATRON_LOGGING_LEVEL={os.environ['MEGATRON_LOGGING_LEVEL']!r}: expected an "
                                "integer level (e.g. 20 for INFO)") from None
    if level is None:
        return None
    root = logging.getLogger()
    previous = root.level
    root.setLevel(level)
    return previous


def _load(run: _Run, state: _State) -> None:
    """Resume from ``--load`` (model, optimizer, scheduler, RNG, counters) when it holds a checkpoint."""
    ck = run.rc.checkpointing
    if not ck.load:
        return
    try:
        loaded = checkpoint.load_checkpoint(
            ck.load, run.model, run.optimizer, run.scheduler, run_args=run.cfg,
            load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng, finetune=ck.finetune,
            exit_on_missing=ck.exit_on_missing_checkpoint, iteration=ck.ckpt_step,
            verify=not ck.no_ckpt_checksums, allow_missing_checksums=ck.allow_missing_ckpt_checksums,
            log=run.logger.log)
    except checkpoint.CheckpointError as e:
        raise _StartupError(str(e)) from None
    if loaded is not None:
        state.restore(loaded)


def _start_data(run: _Run, state: _State, tokenizer) -> None:
    """Datasets and the training iterator (from the consumed samples), FLOPs figures, the stop conditions."""
    rc = run.rc
    try:
        train_ds, run.valid_ds, _test_ds = build_datasets(run.rc, tokenizer)
    except _startup_errors() as e:
        raise _StartupError(str(e).strip().splitlines()[0]) from None
    run.train_iter = train_iterators(train_ds, state.consumed_train_samples, run.rc)
    _check_batches_ahead(rc, state)
    run.batches.update(state.consumed_train_samples, consistency_check=False)
    run.flops = _Memo(lambda gbs: flops_per_iteration(
        run.config, run.model_config, global_batch_size=gbs, seq_length=rc.data.seq_length,
        data_parallel_size=rc.layout.dp))
    run.peak = peak_tflops_per_device(rc.logging.peak_tflops_per_device)
    run.stops = faults.Stops(rc, state, run.t_start, run.logger.log)
    run.progress = ProgressLog(rc.checkpointing.save, rc.layout.world_size, rc.logging.log_progress and rank_is0(),
                               run.logger.log)
    run.progress.start(state.floating_point_operations)
    run.logger.log(
        f"[after start-up] {time.time() - run.t_start:.1f} s; training from iteration {state.iteration} "
        f"to {rc.schedule.train_iters} ({run.batches.get()} micro-batches of {rc.schedule.micro_batch_size} per "
        f"data-parallel rank, DP={rc.layout.dp}, TP={rc.layout.tp}, "
        f"PP={rc.layout.pp}); {peak_statement(rc.logging.peak_tflops_per_device)}")


class _Memo(dict):
    """``fn(key)``, computed once per key."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, key):
        self[key] = value = self.fn(key)
        return value


def _check_batches_ahead(rc: RunConfig, state: _State) -> None:
    """Every global batch this run will take (from the consumed samples on) splits into whole
    micro-batches on this layout (megatron's calculator asserts it step by step; refused at start-up
    instead, naming the batch)."""
    if rc.schedule.rampup_batch_size is None and rc.schedule.step_batch_size_schedule is None:
        return
    ahead = batch_sizes(rc.schedule, rc.layout.dp, rc.data.seq_length, state.consumed_train_samples,
                        iterations=max(0, rc.schedule.train_iters - state.iteration))
    per_step = rc.schedule.micro_batch_size * rc.layout.dp
    for consumed, gbs in ahead:
        if gbs % per_step:
            flag = "--rampup-batch-size" if rc.schedule.rampup_batch_size is not None else "--step-batch-size-schedule"
            raise _StartupError(f"{flag}: the global batch {gbs} (from sample {consumed}) is not divisible by "
                                f"--micro-batch-size {rc.schedule.micro_batch_size} x data-parallel size "
                                f"{rc.layout.dp}")
    try:
        check_interleaved_microbatches(rc.schedule, rc.layout.dp, rc.layout.pp, rc.layout.vpp,
                                       sorted({gbs for _, gbs in ahead}))
    except ConfigError as e:
        raise _StartupError(str(e)) from None


def _save(run: _Run, state: _State, iteration: int) -> bool:
    """Write a checkpoint; refuse (False, one error line) when the parameters are not finite."""
    ck = run.rc.checkpointing
    if not faults.params_finite(run.model):
        msg = (f"NaN/Inf in the parameters at iteration {iteration}; no checkpoint written (the latest "
               f"stays {state.last_saved if state.last_saved is not None else 'none'}); lower --lr or keep the "
               "NaN check on")
        run.logger.log(f"ERROR: {msg}")
        report_error(msg, show=rank_is0())
        return False
    state.saving = iteration
    path = checkpoint.checkpoint_dir(ck.save, iteration)
    notice = (f"Ctrl-C: the checkpoint of iteration {iteration} is being written to {path}; the run stops once it "
              f"is complete (Ctrl-C again stops at once, leaving it incomplete)") if rank_is0() else ""
    with faults.ctrl_c_held(notice), _params_gathered(run):
        checkpoint.save_checkpoint(
            ck.save, iteration, run.model, run.optimizer, run.scheduler,
            consumed_train_samples=state.consumed_train_samples, counters=state.counters(), config=run.cfg,
            save_optim=not ck.no_save_optim, save_rng=not ck.no_save_rng,
            optim_fully_reshardable=ck.dist_ckpt_optim_fully_reshardable, kill_at=ck.debug_kill_during_save,
            stall_at=ck.debug_stall_during_save, enospc_at=ck.debug_enospc_during_save,
            record_checksums=not ck.no_ckpt_checksums, log=run.logger.log)
        state.last_saved = iteration
    state.saving = None
    if run.progress is not None:
        run.progress.saved(iteration, state.floating_point_operations,
                           state.consumed_train_samples * run.rc.data.seq_length)
    return True


@contextlib.contextmanager
def _params_gathered(run: _Run):
    """The parameters as the last optimizer step left them, for a save.

    With the distributed optimizer and ``--overlap-param-gather``, the all-gather of the step's updated
    shards waits for the next forward's pre-hooks: a checkpoint written before it holds the other ranks'
    shards of the previous iteration, and a run resumed from it diverges. As Megatron-LM does around its
    saves, the hooks are taken off with a synchronous gather and put back after."""
    hooked = run.rc.optimizer.use_distributed_optimizer and run.rc.distributed.overlap_param_gather
    if hooked:
        for chunk in run.model:
            chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        if hooked:
            for chunk in run.model:
                chunk.enable_forward_pre_hook()


def _run_eval(run: _Run, state: _State, prefix: str) -> None:
    with profiling.gc_around_evaluation(run.rc):
        loss = evaluate(run.rc, run.model, run.valid_ds, run.table_modules)
    if loss is None:
        return
    logger = run.logger
    logger.log(logger.validation_block(prefix, {"lm loss": loss}))
    ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
    logger.scalars(state.iteration, {"validation/lm loss": loss,
                                     # As Megatron-LM: the perplexity only with --log-validation-ppl-to-tensorboard
                                     "validation/lm loss ppl": ppl if run.rc.logging.log_validation_ppl_to_tensorboard
                                     else None},
                   consumed_samples=state.consumed_train_samples)
    logger.record("valid", state.iteration, {"lm loss": loss, "lm loss hex": float(loss).hex(), "ppl": ppl})


def params_norm_due(rc: RunConfig, iteration: int) -> bool:
    """Whether --log-params-norm computes the norm at ``iteration``: on the log line's steps, and on the
    scalars' steps when there is a TensorBoard or wandb to write them to. Decided on the arguments alone so
    that every rank joins the norm's collectives on the same steps (the writers live on one rank only)."""
    if not rc.logging.log_params_norm:
        return False
    line_due = iteration % rc.logging.log_interval == 0
    scalars_wanted = bool(rc.logging.tensorboard_dir or rc.logging.wandb_project)
    return line_due or (scalars_wanted and iteration % rc.logging.tensorboard_log_interval == 0)


def grad_groups_due(rc: RunConfig, iteration: int) -> bool:
    """Whether the step of ``iteration`` computes the per-group gradient norms: on the log line's steps, where
    every gradient is whole on its rank (``grad_groups.supported``). Decided on the arguments alone, as the
    norms' reduction is a collective over the model-parallel ranks."""
    return (iteration % rc.logging.log_interval == 0
            and grad_groups.supported(rc.optimizer.use_distributed_optimizer, rc.layout.dp))


def _log_iteration(run: _Run, state: _State, interval: _Interval, loss, grad_norm, ok: bool, got_nan: bool,
                   global_batch_size: int) -> None:
    """The per-iteration record, and every --log-interval iterations the log line and scalars."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    rc, logger = run.rc, run.logger
    # The lr of the groups on the default schedule (not --decoupled-lr's), as Megatron-LM logs it.
    lr = get_canonical_lr_for_logging(run.optimizer.param_groups)
    scalars_due = state.iteration % rc.logging.tensorboard_log_interval == 0 and (logger.tb is not None
                                                                          or logger.wandb is not None)
    line_due = state.iteration % rc.logging.log_interval == 0
    # The loss scale is a device tensor: read (a host sync) only on the steps that log it.
    loss_scale = float(run.optimizer.get_loss_scale().item()) if scalars_due or line_due else None
    num_zeros = state.num_zeros_in_grad if ok and rc.logging.log_num_zeros_in_grad else None
    groups = {}
    if line_due and ok and state.grad_group_squares is not None:
        # The one host read of the group norms, on the logged steps only (the loss scale's comes just above).
        groups = grad_groups.norms(state.grad_group_squares.tolist())
    params_norm = None
    if params_norm_due(rc, state.iteration):
        # A collective over the model's ranks (so on a condition every rank shares), on the logged steps only.
        with _params_gathered(run):
            params_norm = params_l2_norm(run.model)
    logger.record("train", state.iteration, {
        "lm loss": loss, "lm loss hex": float(loss).hex() if loss is not None else None,
        "grad norm": grad_norm, "clipped": grad_groups.clipped(grad_norm, rc.optimizer.clip_grad) if ok else None,
        **groups, "lr": lr, "skipped": not ok, "nan": got_nan,
        "consumed_samples": state.consumed_train_samples, "global_batch_size": global_batch_size,
        **{name: values[-1] for name, values in interval.aux_losses.items()},
        **({"num zeros": num_zeros} if num_zeros is not None else {}),
        **({"params norm": params_norm} if params_norm is not None else {})})
    if scalars_due:
        # As Megatron-LM: this iteration's values every --tensorboard-log-interval iterations (TensorBoard
        # and wandb); the interval's throughput with the log line below.
        logger.scalars(state.iteration, {
            "lm loss": loss, **{name: values[-1] for name, values in interval.aux_losses.items()},
            "learning-rate": lr, "loss-scale": loss_scale if rc.logging.log_loss_scale_to_tensorboard else None,
            "grad-norm": grad_norm, "batch-size": global_batch_size,
            "skipped-iterations": state.skipped_iterations, "nan-iterations": state.nan_iterations,
            "num-zeros": num_zeros, "params-norm": params_norm,
            "world-size": rc.layout.world_size if rc.logging.log_world_size_to_tensorboard else None,
            **(memory_scalars() if rc.logging.log_memory_to_tensorboard else {}),
        }, consumed_samples=state.consumed_train_samples)
    if not line_due:
        return
    elapsed = max(time.time() - interval.start, 1e-9)
    per_iter = elapsed / max(1, interval.iters)
    tokens_s = interval.samples * rc.data.seq_length / elapsed
    tflops = interval.flops / elapsed / torch.distributed.get_world_size() / 1e12
    mfu = tflops / run.peak if run.peak else None
    avg = sum(interval.losses) / len(interval.losses) if interval.losses else float("nan")
    losses = {"lm loss": avg, **{name: sum(v) / len(v) for name, v in interval.aux_losses.items()}}
    logger.log(logger.training_line(
        iteration=state.iteration, train_iters=rc.schedule.train_iters, consumed_samples=state.consumed_train_samples,
        consumed_tokens=state.consumed_train_samples * rc.data.seq_length, ms_per_iter=per_iter * 1000,
        lr=lr, global_batch_size=global_batch_size, losses=losses,
        loss_scale=loss_scale, grad_norm=grad_norm, skipped=state.skipped_iterations,
        nan=state.nan_iterations, tokens_per_s=tokens_s, tflops_per_device=tflops, mfu=mfu,
        num_zeros=num_zeros, params_norm=params_norm))
    logger.scalars(state.iteration, {"tokens-per-second": tokens_s, "throughput-tflops-per-device": tflops,
                                     "iteration-time": per_iter if rc.logging.log_timers_to_tensorboard else None})
    profiling.snapshot_memory(rc)
    interval.start, interval.iters, interval.samples, interval.flops, interval.losses = time.time(), 0, 0, 0.0, []
    interval.aux_losses = {}


def _train(run: _Run, state: _State) -> int:
    """The iterations up to --train-iters (or only the evaluation with --skip-train); the exit code.

    The loop runs inside its instrumentation (manual GC, the profiler), which ends however the loop does. A
    NaN/Inf that stops a step is reported here; Ctrl-C, SIGTERM and a lost rank by ``_run_recorded``."""
    with profiling.manual_gc(run.rc) as collector, profiling.Profiler(run.rc) as profiler:
        try:
            return _train_loop(run, state, profiler, collector)
        except NanDetected as e:
            return faults.stop_on_nan(run.rc, state, e, run.logger.log, partial(_save, run, state))


def _next_batch(run: _Run, state: _State, interval: _Interval) -> Optional[int]:
    """The micro-batches of the next step, from megatron-core's calculator; saves a checkpoint first
    (with --save) when the count changes, as Megatron-LM does. None: that save failed."""
    previous = run.batches.get()
    run.batches.update(state.consumed_train_samples, consistency_check=False, verbose=True)
    if run.batches.get() != previous and state.iteration != 0 and run.rc.checkpointing.save \
            and state.last_saved != state.iteration:
        t_save = time.time()  # kept out of the per-iteration time, as the other saves
        if not _save(run, state, state.iteration):
            return None
        interval.start += time.time() - t_save
    run.batches.update(state.consumed_train_samples, consistency_check=True)
    return run.batches.get()


def _count_step(run: _Run, state: _State, interval: _Interval, num_microbatches: int, loss, ok: bool,
                got_nan: bool) -> int:
    """Advance the counters (saved with checkpoints) and the log interval past the step just taken; its
    global batch size."""
    global_batch = num_microbatches * run.rc.schedule.micro_batch_size * run.rc.layout.dp
    # Every step, as Megatron-LM's training_log: the routers' trackers hold this step's losses.
    for name, value in _aux_losses(run.config, num_microbatches, state.iteration + 1).items():
        interval.aux_losses.setdefault(name, []).append(value)
    state.iteration += 1
    state.consumed_train_samples += global_batch
    if not ok:
        state.skipped_iterations += 1
    if got_nan:
        state.nan_iterations += 1
    interval.iters += 1
    interval.samples += global_batch
    interval.flops += run.flops[global_batch]
    state.floating_point_operations += run.flops[global_batch]
    if loss is not None and math.isfinite(loss):
        interval.losses.append(loss)
    return global_batch


def _train_loop(run: _Run, state: _State, profiler: profiling.Profiler, collector: profiling.ManualGC) -> int:
    """Each iteration: the step, its record and log line, then evaluation, checkpoint and the stop
    conditions (``run.stops``: SIGTERM, --exit-interval, --exit-duration-in-mins) at their intervals."""
    rc, sched, ck = run.rc, run.rc.schedule, run.rc.checkpointing
    reset_aux_loss_trackers()
    interval = _Interval(start=time.time())
    for chunk in run.model:
        chunk.train()
    while not sched.skip_train and state.iteration < sched.train_iters:
        profiler.before_step(state.iteration)
        with profiling.span("batch"):
            num_microbatches = _next_batch(run, state, interval)
        if num_microbatches is None:
            return EXIT_NAN
        with profiling.span("step"):
            loss, grad_norm, ok, got_nan = _train_step(rc, state, run.model, run.optimizer, run.scheduler,
                                                       run.train_iter, run.table_modules, num_microbatches)
        with profiling.span("log"):
            global_batch = _count_step(run, state, interval, num_microbatches, loss, ok, got_nan)
            _log_iteration(run, state, interval, loss, grad_norm, ok, got_nan, global_batch)
        profiler.after_step(state.iteration)
        collector.after_step(state.iteration)
        t_side = time.time()  # evaluation and checkpointing are kept out of the per-iteration time
        if sched.eval_interval and state.iteration % sched.eval_interval == 0 and state.iteration < sched.train_iters:
            _run_eval(run, state, f"iteration {state.iteration}")
        stop = run.stops.due(state.iteration)
        if ck.save and (stop or (ck.save_interval and state.iteration % ck.save_interval == 0)):
            if not _save(run, state, state.iteration):
                return EXIT_NAN
        interval.start += time.time() - t_side
        run.stops.raise_held()
        if stop:
            break
    if sched.skip_train or state.iteration >= sched.train_iters:
        _run_eval(run, state, f"iteration {state.iteration} on validation set")
        if not sched.skip_train and ck.save and state.last_saved != state.iteration:
            if not _save(run, state, state.iteration):
                return EXIT_NAN
    return 0
