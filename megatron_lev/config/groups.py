"""The non-model groups of :class:`~megatron_lev.config.run.RunConfig`: data, schedule,
optimizer, distributed, checkpointing, logging, run control, and the folded flags. Each field is an
argument under Megatron-LM's name (the flag ``--field-name``, the key of ``config.yaml``) holding its
resolved value; its docstring is the flag's help. A module of their own (as ``model`` for the model group),
so that the flag modules of ``arguments`` (``checkpointing``, ``run``, ...) import just the groups they
generate their flags from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# Megatron-LM's names of the precision-aware optimizer's dtypes (fp8 is stored as uint8, as there).
OPTIMIZER_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}

# megatron-core's StrictHandling values that load a checkpoint (its return_* ones hand the keys to a caller).
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "ignore_all")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Datasets, loader and tokenizer (Megatron-LM's data arguments, megatron-core's GPTDatasetConfig)."""

    seq_length: int
    """Tokens per sample (--seq-length)."""

    data_path: Optional[List[str]] = field(default=None, metadata={"nargs": "*"})
    """prefix, or 'weight prefix weight prefix ...'; split into train, valid and test by --split"""

    train_data_path: Optional[List[str]] = field(default=None, metadata={"nargs": "*"})
    """Training dataset prefixes, instead of --data-path with --split."""

    valid_data_path: Optional[List[str]] = field(default=None, metadata={"nargs": "*"})
    """Validation dataset prefixes."""

    test_data_path: Optional[List[str]] = field(default=None, metadata={"nargs": "*"})
    """Test dataset prefixes."""

    split: str = "969,30,1"
    """Train,valid,test proportions of --data-path."""

    data_cache_path: Optional[str] = None
    """Where the dataset index caches are written."""

    mmap_bin_files: bool = True
    """memory-map the .bin files (the default; --no-mmap-bin-files reads them with file reads instead)"""

    mock_data: bool = False
    """megatron-core's MockGPTDataset (no files)"""

    num_workers: int = field(default=0, metadata={"min": 0})
    """DataLoader worker processes per rank"""

    eod_mask_loss: bool = False
    """leave the EOD tokens out of the loss"""

    reset_attention_mask: bool = False
    """a token attends to its own document only (local layer spec). The dense s x s mask is built per sample on
    the CPU by megatron-core's GPTDataset (use --num-workers > 0), and with it SDPA cannot use flash attention
    (auto falls back to the memory-efficient or cuDNN kernels)"""

    reset_position_ids: bool = False
    """positions restart at each document (the learned position table; with rope, together with
    --reset-attention-mask only)"""

    tokenizer_type: str
    """The tokenizer (--tokenizer-type)."""

    vocab_file: Optional[str] = None
    """GPT-2 vocab.json of GPT2BPETokenizer (--vocab-file)."""

    merge_file: Optional[str] = None
    """GPT-2 merges.txt of GPT2BPETokenizer (--merge-file)."""

    tokenizer_model: Optional[str] = None
    """tokenizer.json (or its folder), SentencePiece .model or .tiktoken rank file (--tokenizer-model)."""

    vocab_size: Optional[int] = None
    """Ids of the NullTokenizer, or of a TikTokenizer in Megatron-LM's v1/v2 layout (--vocab-size); beside a
    tokenizer with files, the model's vocabulary (at least the tokenizer's ids). The embedding's rows are
    ``model.padded_vocab_size``."""

    tiktoken_pattern: str = "o200k"
    """Pre-tokenisation pattern of a TikTokenizer (--tiktoken-pattern)."""

    tiktoken_num_special_tokens: int = 1000
    """Special-token ids before the vocabulary in Megatron-LM's v1/v2 layout (--tiktoken-num-special-tokens)."""

    tokenizer_fingerprint: Optional[Dict[str, Any]] = None
    """What identifies the tokenizer a checkpoint was trained with; None until the tokenizer is built."""

    allow_tokenizer_mismatch: bool = False
    """train on datasets, or resume a checkpoint, made with another tokenizer (warns instead of refusing)"""


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Training length, batch sizes, evaluation cadence, and the learning-rate and weight-decay schedule
    (Megatron-LM's TrainingConfig, ValidationConfig and SchedulerConfig)."""

    train_iters: Optional[int] = field(default=None, metadata={"min": 0})
    """iterations to train over all runs (or --train-samples); 0: no training step (a model to convert or
    evaluate)"""

    train_samples: Optional[int] = field(default=None, metadata={"min": 1})
    """train for this many samples (instead of --train-iters); the schedule flags are then the --lr-*-samples
    ones"""

    micro_batch_size: int = field(metadata={"min": 1})
    """Samples per data-parallel rank per micro-batch."""

    global_batch_size: int = field(metadata={"min": 1})
    """samples per iteration over all data-parallel ranks; default: micro x data-parallel size"""

    num_microbatches: int
    """Micro-batches per iteration, derived: global / (micro x data-parallel size)."""

    rampup_batch_size: Optional[List[int]] = field(
        default=None, metadata={"nargs": 3, "metavar": ("START", "INCREMENT", "SAMPLES"), "min": 0})
    """grow the global batch from START by INCREMENT to --global-batch-size over SAMPLES samples
    (megatron-core's ramp-up calculator; needs --train-samples)"""

    step_batch_size_schedule: Optional[str] = field(default=None, metadata={"metavar": "'T0:B0 T1:B1 ...'"})
    """global batch B_i from T_i tokens on (suffixes K/M/B/T; the first T is 0); the largest is the global
    batch size (megatron-core >= 0.18)"""

    eval_interval: int = field(default=1000, metadata={"min": 1})
    """Iterations between validations."""

    eval_iters: int = field(default=100, metadata={"min": 0})
    """Iterations per validation and test."""

    skip_train: bool = False
    """only evaluate (after --load)"""

    lr_decay_style: str = field(default="linear", metadata={
        "choices": ("constant", "linear", "cosine", "inverse-square-root", "WSD")})
    """Learning-rate decay."""

    lr_decay_iters: Optional[int] = field(default=None, metadata={"min": 1})
    """iterations to decay the learning rate over; default: --train-iters"""

    lr_decay_samples: Optional[int] = field(default=None, metadata={"min": 1})
    """with --train-samples: samples to decay the learning rate over (default: --train-samples)"""

    lr_wsd_decay_iters: Optional[int] = field(default=None, metadata={"min": 1})
    """Iterations of the annealing phase of --lr-decay-style WSD."""

    lr_wsd_decay_samples: Optional[int] = field(default=None, metadata={"min": 1})
    """with --train-samples: samples of the annealing phase of --lr-decay-style WSD"""

    lr_wsd_decay_style: str = field(default="exponential", metadata={
        "choices": ("exponential", "linear", "cosine", "minus_sqrt")})
    """Decay of the WSD schedule's annealing phase."""

    lr_warmup_iters: int = field(default=0, metadata={"min": 0})
    """Iterations to warm the learning rate up over."""

    lr_warmup_samples: int = field(default=0, metadata={"min": 0})
    """with --train-samples: samples to warm the learning rate up over"""

    lr_warmup_fraction: Optional[float] = field(default=None, metadata={"min": 0, "max": 1})
    """Warm-up as a fraction of the decay."""

    lr_warmup_init: float = field(default=0.0, metadata={"min": 0})
    """Learning rate at the start of the warm-up."""

    start_weight_decay: Optional[float] = field(default=None, metadata={"min": 0})
    """Weight decay at the start; default: --weight-decay."""

    end_weight_decay: Optional[float] = field(default=None, metadata={"min": 0})
    """Weight decay at the end; default: --weight-decay."""

    weight_decay_incr_style: str = field(default="constant", metadata={"choices": ("constant", "linear", "cosine")})
    """How the weight decay goes from start to end."""

    override_opt_param_scheduler: bool = False
    """Take the learning-rate and weight-decay schedule from the flags, not the checkpoint."""

    use_checkpoint_opt_param_scheduler: bool = False
    """Take the learning-rate and weight-decay schedule from the checkpoint."""


@dataclass(frozen=True, kw_only=True)
class OptimizerRunConfig:
    """The optimizer, learning rates, clipping and loss scaling (the fields of megatron-core's
    OptimizerConfig that the flags set)."""

    optimizer: str = field(default="adam", metadata={"choices": ("adam", "sgd")})
    """adam is AdamW (decoupled weight decay), as in megatron-core"""

    lr: float = field(metadata={"min": 0})
    """Peak learning rate."""

    min_lr: float = field(default=0.0, metadata={"min": 0})
    """Learning rate at the end of the decay."""

    decoupled_lr: Optional[float] = field(default=None, metadata={"min": 0})
    """learning rate of the input embedding and the output layer (with LEV: the whole input arm, i.e.
    codebooks, spline heads and projections; with every arm: its input module and the output head); the
    others follow --lr"""

    decoupled_min_lr: Optional[float] = field(default=None, metadata={"min": 0})
    """minimum learning rate of the --decoupled-lr parameters (default: --min-lr)"""

    weight_decay: float = field(default=0.01, metadata={"min": 0})
    """Weight decay."""

    adam_beta1: float = field(default=0.9, metadata={"min": 0, "below": 1})
    """Adam's first-moment coefficient."""

    adam_beta2: float = field(default=0.999, metadata={"min": 0, "below": 1})
    """Adam's second-moment coefficient."""

    adam_eps: float = field(default=1e-8, metadata={"above": 0})
    """Adam's epsilon."""

    sgd_momentum: float = field(default=0.9, metadata={"min": 0, "below": 1})
    """SGD's momentum."""

    adam_impl: str = field(default="auto", metadata={"choices": ("auto", "fused", "foreach")})
    """torch's AdamW, which megatron-core builds without Transformer Engine or Apex: fused (one kernel per
    dtype and device a step, torch's fused=True), foreach (torch's own default) or auto: fused on CUDA"""

    clip_grad: float = field(default=1.0, metadata={"min": 0})
    """gradient-norm clip (0: no clipping)"""

    use_distributed_optimizer: bool = False
    """Shard the optimizer state over the data-parallel ranks (ZeRO-1)."""

    use_precision_aware_optimizer: bool = False
    """Transformer Engine's FusedAdam with the main parameters, gradients and Adam moments in the dtypes
    below (needs --use-distributed-optimizer and --optimizer adam)"""

    main_grads_dtype: str = field(default="fp32", metadata={"choices": ("fp32", "bf16")})
    """dtype of the main gradients (bf16: needs --bf16) with --use-precision-aware-optimizer"""

    main_params_dtype: str = field(default="fp32", metadata={"choices": ("fp32", "fp16")})
    """dtype of the main parameters with --use-precision-aware-optimizer"""

    exp_avg_dtype: str = field(default="fp32", metadata={"choices": tuple(OPTIMIZER_DTYPES)})
    """dtype of the Adam's first moment with --use-precision-aware-optimizer"""

    exp_avg_sq_dtype: str = field(default="fp32", metadata={"choices": tuple(OPTIMIZER_DTYPES)})
    """dtype of the Adam's second moment with --use-precision-aware-optimizer"""

    loss_scale: Optional[float] = field(default=None, metadata={"above": 0})
    """static loss scale (fp16); default dynamic"""

    initial_loss_scale: float = field(default=2.0**32, metadata={"above": 0})
    """Dynamic loss scaling's first scale."""

    min_loss_scale: float = field(default=1.0, metadata={"above": 0})
    """Dynamic loss scaling's smallest scale."""

    # The int 1000, as Megatron-LM's flag: config.yaml has always written "loss_scale_window: 1000".
    loss_scale_window: float = field(default=1000, metadata={"min": 1})
    """Iterations without overflow before the dynamic loss scale grows."""

    hysteresis: int = field(default=2, metadata={"min": 1})
    """Overflows tolerated before the dynamic loss scale shrinks."""


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Process groups and gradient reduction (megatron-core's DistributedDataParallelConfig and the
    backend)."""

    distributed_backend: Optional[str] = field(default=None, metadata={"choices": ("nccl", "gloo")})
    """the process-group backend; default: nccl with CUDA, gloo without"""

    distributed_timeout_minutes: int = field(default=10, metadata={"min": 1})
    """Timeout of the collectives, in minutes."""

    overlap_grad_reduce: bool = False
    """Overlap the gradient reduction with the backward pass."""

    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the forward pass."""

    ddp_bucket_size: Optional[int] = field(default=None, metadata={"min": 1})
    """Gradient bucket size in elements; default: megatron-core's."""

    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and reduce gradients in float32."""

    check_for_nan_in_loss_and_grad: bool = True
    """check loss and gradients for NaN/Inf every iteration (the default; --no-check-for-nan-in-loss-and-grad:
    not every iteration, a checkpoint is still refused when the parameters hold NaN/Inf); see --nan-action"""

    no_overlap_p2p_communication: bool = False
    """interleaved schedule: batched, non-overlapped p2p (default overlaps, as Megatron-LM)"""

    num_distributed_optimizer_instances: int = field(default=1, metadata={"min": 1})
    """copies of the distributed optimizer across the data-parallel group: only 1 here"""


@dataclass(frozen=True, kw_only=True)
class CheckpointingConfig:
    """Saving, loading and resuming (Megatron-LM's CheckpointConfig)."""

    save: Optional[str] = None
    """Directory checkpoints are saved to."""

    load: Optional[str] = None
    """Directory a checkpoint is loaded from."""

    save_interval: Optional[int] = field(default=None, metadata={"min": 1})
    """Iterations between checkpoints (needs --save)."""

    no_save_optim: bool = False
    """Save without the optimizer state."""

    no_save_rng: bool = False
    """Save without the random states."""

    no_load_optim: bool = False
    """Load without the optimizer state."""

    no_load_rng: bool = False
    """Load without the random states."""

    finetune: bool = False
    """load model weights only; start at iteration 0 with fresh optimizer/scheduler"""

    dist_ckpt_optim_fully_reshardable: bool = False
    """save the distributed optimizer so that it reloads with any TP/PP (gathers on DP rank 0)"""

    ckpt_format: str = field(default="torch_dist", metadata={"metavar": "torch_dist"})
    """the only format here (megatron-core dist_checkpointing); others are refused"""

    dist_ckpt_strictness: str = field(default="assume_ok_unexpected", metadata={"choices": DIST_CKPT_STRICTNESS})
    """on --load, keys of the checkpoint and of this run that do not match (megatron-core dist_checkpointing's
    strict handling): assume_ok_unexpected (the default), log_* to list them, raise_* to refuse the load,
    ignore_all"""

    exit_on_missing_checkpoint: bool = False
    """Stop when --load holds no checkpoint."""

    ckpt_fully_parallel_load: bool = False
    """on --load, each data-parallel replica reads its share of the checkpoint and the replicas exchange the
    rest (megatron-core's FullyParallelLoadStrategyWrapper), instead of every replica reading all of it"""

    ckpt_step: Optional[int] = field(default=None, metadata={"min": 0})
    """load iter_N of --load instead of the one latest_checkpointed_iteration.txt names"""

    no_ckpt_checksums: bool = False
    """saves record no checksums.json and --load checks files by size only (by default every save records
    each file's CRC32 and every load verifies them, reading the checkpoint once more, spread over the
    ranks)"""

    allow_missing_ckpt_checksums: bool = False
    """load a checkpoint whose checksums.json is missing though its save recorded one, its files checked
    for size only (a warning says so; without this flag it is refused, and the next save would record
    checksums of a state nobody verified)"""

    overwrite_checkpoints: bool = False
    """allow saving into a --save directory that holds another run's checkpoints (without it, such a run is
    refused unless --load names the same directory)"""

    debug_kill_during_save: Optional[str] = field(default=None, metadata={"hidden": True})
    """Fault injection, RANK:ITERATION: that rank is killed during that iteration's save."""

    debug_stall_during_save: Optional[str] = field(default=None, metadata={"hidden": True})
    """Fault injection, RANK:ITERATION: that rank stalls during that iteration's save."""

    debug_enospc_during_save: Optional[str] = field(default=None, metadata={"hidden": True})
    """Fault injection, RANK:ITERATION: that rank's disk is full during that iteration's save."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """The log lines, TensorBoard, wandb and the metrics file (Megatron-LM's LoggerConfig)."""

    log_interval: int = field(default=100, metadata={"min": 1})
    """Iterations between log lines."""

    logging_level: Optional[int] = field(default=None, metadata={"min": 0})
    """level of the root Python logger (10 DEBUG, 20 INFO, 30 WARNING, ...; default: $MEGATRON_LOGGING_LEVEL,
    else unchanged)"""

    quiet_config: bool = False
    """do not print the resolved config at start-up"""

    log_progress: bool = False
    """append Megatron-LM's progress.txt lines to --save: a job's start, and after each checkpoint the job's and
    the cumulative throughput, the floating-point operations and tokens so far"""

    log_params_norm: bool = False
    """the L2 norm of the parameters on the log line and to TensorBoard/wandb (params-norm)"""

    log_num_zeros_in_grad: bool = False
    """the number of zero gradient entries on the log line and to TensorBoard/wandb (num-zeros)"""

    peak_tflops_per_device: Optional[float] = field(default=None, metadata={"above": 0})
    """for MFU; default: known GPUs' dense bf16 peak, unknown (no MFU) on CPU"""

    metrics_file: Optional[str] = None
    """append one JSON line per iteration/evaluation with exact values (rank 0)"""

    tensorboard_dir: Optional[str] = None
    """TensorBoard directory."""

    tensorboard_log_interval: int = field(default=1, metadata={"min": 1})
    """Iterations between TensorBoard scalars."""

    tensorboard_queue_size: int = field(default=1000, metadata={"min": 1})
    """TensorBoard events held before they are written out"""

    log_timers_to_tensorboard: bool = False
    """the time per iteration (iteration-time, s) to TensorBoard/wandb at each --log-interval"""

    log_loss_scale_to_tensorboard: bool = True
    """the loss scale to TensorBoard/wandb (the default; --no-log-loss-scale-to-tensorboard leaves it out)"""

    log_validation_ppl_to_tensorboard: bool = False
    """the validation perplexity to TensorBoard/wandb beside the validation loss"""

    log_memory_to_tensorboard: bool = False
    """memory to TensorBoard/wandb: the CUDA allocator's mem-reserved-bytes, mem-allocated-bytes,
    mem-max-allocated-bytes, mem-allocated-count (on CPU: mem-max-rss-bytes)"""

    log_world_size_to_tensorboard: bool = False
    """the number of ranks to TensorBoard/wandb (world-size)"""

    wandb_project: Optional[str] = None
    """wandb project (logged from the last rank, as Megatron-LM; needs `pip install wandb`); none: no wandb."""

    wandb_exp_name: Optional[str] = None
    """wandb run name."""

    wandb_save_dir: Optional[str] = None
    """wandb's local directory; default: --save's wandb/."""

    wandb_entity: Optional[str] = None
    """wandb entity (the user or team the run is logged under); default: wandb's own."""


@dataclass(frozen=True, kw_only=True)
class RunControlConfig:
    """Seed, exit conditions, fault handling, garbage collection and profiling."""

    seed: int = field(default=1234, metadata={"min": 0})
    """Random seed (Megatron-LM's default; the model's initialisation seed too)."""

    exit_interval: Optional[int] = field(default=None, metadata={"min": 1})
    """stop (after saving) at an iteration multiple of N"""

    exit_duration_in_mins: Optional[float] = field(default=None, metadata={"above": 0})
    """Stop (after saving) once the run has taken this many minutes."""

    exit_signal_handler: bool = False
    """on SIGTERM: save a checkpoint at the end of the current iteration and exit 0"""

    nan_action: str = field(default="save-and-stop", metadata={"choices": ("stop", "save-and-stop", "skip")})
    """on NaN/Inf: stop; save the last good state (when --save is given) and stop; or skip the optimizer step
    and continue (counted as a nan iteration)"""

    inject_nan_at_iteration: Optional[int] = field(default=None, metadata={"min": 1, "hidden": True})
    """Fault injection: a NaN loss at this iteration."""

    manual_gc: bool = False
    """turn Python's threshold-based garbage collector off and collect at fixed points (the same on every
    rank): at start-up, around each evaluation (--manual-gc-eval) and every --manual-gc-interval iterations"""

    manual_gc_interval: int = field(default=0, metadata={"min": 0})
    """with --manual-gc: collect every N training iterations (0: never between steps)"""

    manual_gc_eval: bool = True
    """with --manual-gc: collect before and after each evaluation (the default; --no-manual-gc-eval: no
    collection around evaluations)"""

    empty_unused_memory_level: int = field(default=0, metadata={"min": 0, "choices": (0, 1, 2)})
    """release the CUDA caching allocator's unused blocks (torch.cuda.empty_cache): 1 after each step's
    backward and each evaluation step, 2 also after the optimizer step"""

    profile: bool = False
    """profile iterations --profile-step-start to --profile-step-end on --profile-ranks: with
    --use-pytorch-profiler a torch.profiler trace in --tensorboard-dir, else nsys ranges (CUDA only)"""

    use_pytorch_profiler: bool = False
    """with --profile: torch.profiler, trace written under --tensorboard-dir (TensorBoard,
    Perfetto/chrome://tracing)"""

    pytorch_profiler_collect_shapes: bool = False
    """with --use-pytorch-profiler: record each operator's input shapes and dtypes (host work per operator,
    which inflates the profiled step of an operator-heavy eager loop)"""

    profile_ranks: List[int] = field(default_factory=lambda: [0], metadata={"nargs": "+", "min": 0})
    """global ranks to profile"""

    profile_step_start: int = field(default=10, metadata={"min": 0})
    """First profiled iteration."""

    profile_step_end: int = field(default=12, metadata={"min": 1})
    """Iteration at which profiling stops."""

    record_memory_history: bool = False
    """record the CUDA caching allocator's history on the --profile-ranks and write a snapshot
    (torch.cuda.memory._dump_snapshot) to --memory-snapshot-path, one file per rank, at each --log-interval
    (CUDA only)"""

    memory_snapshot_path: str = "snapshot.pickle"
    """with --record-memory-history: the snapshot file (rank R writes NAME_R.pickle)"""


@dataclass(frozen=True, kw_only=True)
class FoldedFlagsConfig:
    """Megatron-LM's flags that validation folds into another field (``validate.FOLDED_INTO``), as given:
    nothing reads them after validation, and they are kept so that ``config.yaml`` (fed back through
    ``--config``) reproduces the command line."""

    num_layers_per_virtual_pipeline_stage: Optional[int] = field(default=None, metadata={"min": 1})
    """Layers per virtual pipeline stage, instead of --virtual-pipeline-model-parallel-size (folded into the
    layout's vpp)."""

    recompute_activations: bool = False
    """Selective recompute (--recompute-activations), folded into --recompute-granularity."""

    untie_embeddings_and_output_weights: bool = False
    """An untied output layer (--untie-embeddings-and-output-weights), folded into --input-embedding (which
    validation makes consistent with it)."""

    grad_reduce_in_bf16: bool = False
    """reduce gradients in bf16 instead of fp32 (with --bf16); folded into --accumulate-allreduce-grads-in-fp32"""

    group_query_attention: bool = False
    """Grouped-query attention (--group-query-attention), folded into --num-query-groups."""
