"""Model-level configuration: which input arm, positions, norms, activation, and the checks
that turn impossible parallel/precision settings into one-line errors naming the CLI flag.

``LevModelConfig`` holds what megatron-core's ``TransformerConfig`` does not: the vocabulary,
the input representation (``input_embedding``), the LEV knobs and the baseline widths.
``build_transformer_config`` fills a ``TransformerConfig`` with defaults that match a
``LevModelConfig`` (norm, activation, biases) and this machine: CPU-capable settings without CUDA,
Megatron-LM's fusion defaults where CUDA and each fusion's kernel are present (``fusion_defaults``).

What is available is read from megatron-core's own flags (its ``HAVE_TE``, its fused RoPE function, its
gradient-accumulation-fusion flag), so this module and megatron agree on what will run.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_lev.distributed.layout import ParallelLayout
from megatron_lev.kernels import refuse_unbuildable_triton, triton_build_missing
from megatron_lev.lev.config import ConfigError, LEVConfig

from . import rope
from .moe import check_moe_settings, check_te_only_moe_flags
from .arms import InputArm, arm_names, find_arm, get_arm

# The input arms (the registry's names, models.arms); the flag's choices and the check read it.
INPUT_EMBEDDINGS = arm_names()
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute", "none")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
FP8_FORMATS = ("e4m3", "hybrid")

# TransformerConfig fields that pretrain_lev.py's flags generated from TransformerConfig set
# (arguments.model); models.factory passes each one that is set.
TRANSFORMER_FLAG_FIELDS = ("layernorm_zero_centered_gamma", "attention_softmax_in_fp32", "masked_softmax_fusion",
                           "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
                           "attention_backend", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo",
                           "disable_bf16_reduced_precision_matmul", "recompute_modules", "qk_layernorm",
                           "use_cpu_initialization")

# Transformer Engine versions megatron-core 0.16.1's get_fp8_recipe needs per recipe (it raises otherwise).
FP8_RECIPE_MIN_TE = {"delayed": "1.0", "mxfp8": "2.1.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0"}


# ---------------------------------------------------------------------- what this machine has


def te_available() -> bool:
    """True when megatron-core can use Transformer Engine: its own ``HAVE_TE`` flags (the TE extension
    and the GPT layer specs), which need TE's imports to succeed. An installed TE that fails to import
    (a torch ABI mismatch, missing CUDA libraries) is not available, so "auto" picks the local spec."""
    try:
        from megatron.core.extensions import transformer_engine as te_ext
        from megatron.core.models.gpt import gpt_layer_specs
    except Exception:  # megatron catches only ImportError; a TE missing a shared library raises OSError
        return False
    return bool(te_ext.HAVE_TE and gpt_layer_specs.HAVE_TE)


def te_version():
    """Transformer Engine's version (``packaging.version.Version``, as megatron-core reads it), or None."""
    if not te_available():
        return None
    from megatron.core.utils import get_te_version

    return get_te_version()


def triton_available() -> bool:
    """Whether torch.compile has its GPU backend: Triton imports, and Triton can build its launcher at run
    time (``kernels.triton_build_missing``: a C compiler and Python's headers; without them the first
    compiled call fails). megatron's ``jit_fuser`` (torch.compile) builds the bias-dropout-add and
    bias-activation fusions with it, and LEV's Triton kernel is registered under the same rule. Asks no
    device: configs are built before each rank selects its GPU."""
    try:
        from torch.utils._triton import has_triton_package
    except ImportError:
        return False
    return has_triton_package() and triton_build_missing() is None


def check_lev_basis(basis: str) -> None:
    """``--lev-basis triton`` refused in one line on a CUDA machine where Triton cannot build its launcher."""
    refuse_unbuildable_triton(basis, "cuda" if torch.cuda.is_available() else "cpu")


def apex_softmax_available() -> bool:
    """Whether apex's fused masked-softmax kernels import (megatron's ``FusedScaleMaskSoftmax`` calls them
    when ``masked_softmax_fusion`` is on; it has no flag of its own for them)."""
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
    except Exception:  # a broken extension raises OSError as well as ImportError
        return False
    return True


def cuda_capability() -> Optional[Tuple[int, int]]:
    """Compute capability of this rank's CUDA device (``LOCAL_RANK``: configs are built before the rank
    selects its GPU), None without CUDA; asked only where a setting needs it: FP8, or TP without
    CUDA_DEVICE_MAX_CONNECTIONS=1."""
    if not torch.cuda.is_available():
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    return tuple(torch.cuda.get_device_capability(device))


def use_transformer_engine(transformer_impl: str = "auto") -> bool:
    """Whether the Transformer Engine spec is used for ``transformer_impl`` on this machine."""
    if transformer_impl == "local":
        return False
    have = te_available() and torch.cuda.is_available()
    if transformer_impl == "transformer_engine" and not have:
        raise ConfigError(
            "--transformer-impl transformer_engine needs Transformer Engine and a CUDA GPU "
            "(not found); use --transformer-impl local or auto"
        )
    return have


def settings_for_loading(transformer_impl: Optional[str]) -> Dict[str, Any]:
    """The layer-spec and FP8 settings to rebuild a saved model with on this machine (``transformer_impl``:
    the saved ``--transformer-impl``, None in a file written before the flag).

    Checkpoints load into either layer spec (``models.checkpoint_keys``), so a model trained with
    Transformer Engine is rebuilt with the local spec where TE or CUDA is missing. FP8 is never kept:
    megatron-core enters the FP8 context in evaluation too, and TE's FP8 GEMMs need tokens divisible
    by 8 (32 for mxfp8) while an evaluation batch has whatever length its longest sequence has (the
    note of megatron-core's ``prepare_model_for_fp8_inference``). The weights FP8 training saves are
    the bf16/fp32 ones, so the model evaluates in its ``--bf16``/``--fp16`` precision.
    """
    if transformer_impl is not None and not isinstance(transformer_impl, str):
        raise TypeError(f"settings_for_loading takes the saved --transformer-impl, not {type(transformer_impl).__name__}")
    impl = transformer_impl or "auto"
    if impl == "transformer_engine" and not (te_available() and torch.cuda.is_available()):
        impl = "auto"
    return {"transformer_impl": impl, "fp8_format": None}


def check_cuda_device_max_connections(tp: int) -> None:
    """Tensor parallelism on a GPU before Blackwell wants ``CUDA_DEVICE_MAX_CONNECTIONS=1``: megatron-core
    issues each TP collective before the GEMM it overlaps with, and only one hardware queue keeps that
    order (a speed matter, not correctness, in megatron-core's words). Megatron-LM refuses to start
    without it; so does this, so a launch script behaves the same under both."""
    if tp <= 1 or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return
    cc = cuda_capability()
    if cc is not None and cc[0] < 10:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} on this GPU (compute capability {cc[0]}.{cc[1]}) needs "
            "CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment to overlap TP communication with compute (as "
            "Megatron-LM requires); export CUDA_DEVICE_MAX_CONNECTIONS=1 before the launch "
            "(examples/pile/train.sh does)"
        )


# ---------------------------------------------------------------------- the loss


def linear_cross_entropy_on(config: Any) -> bool:
    """Whether the loss is the linear cross-entropy (``parallel.linear_cross_entropy``): Megatron-LM's
    ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear``."""
    return bool(getattr(config, "cross_entropy_loss_fusion", False)) and \
        getattr(config, "cross_entropy_fusion_impl", None) == "linear"


def check_linear_cross_entropy(config: Any, chunk_size: Optional[int]) -> None:
    """The settings the linear cross-entropy cannot honour, refused in one line naming the flag."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ConfigError(f"--linear-cross-entropy-chunk-size must be a positive integer (got {chunk_size!r})")
    if not linear_cross_entropy_on(config):
        return
    # TransformerConfig fields no flag of pretrain_lev.py sets (a model built through the API).
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ConfigError("--cross-entropy-fusion-impl linear computes the head's weight gradient in its own "
                          "backward: build the TransformerConfig with defer_embedding_wgrad_compute=False")
    if getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        raise ConfigError("--cross-entropy-fusion-impl linear does not scale the logits by MuP's output "
                          "multiplier: use --cross-entropy-fusion-impl native with use_mup")


# ---------------------------------------------------------------------- LEV compute mode


def tokens_per_data_parallel_rank(*, global_batch_size: int, seq_length: int, data_parallel_size: int) -> int:
    """Tokens one data-parallel rank (one TP x PP model replica) trains on per optimizer step."""
    if global_batch_size % data_parallel_size:
        raise ConfigError(
            f"--global-batch-size {global_batch_size} is not divisible by the data-parallel size "
            f"{data_parallel_size}; choose a multiple of {data_parallel_size}"
        )
    return global_batch_size // data_parallel_size * seq_length


def lev_compute_mode_for(*, vocab_size: int, tokens_per_rank_per_step: int) -> str:
    """The LEV compute mode that evaluates fewer ids per data-parallel rank and step.

    ``table`` evaluates G on all V ids on every data-parallel rank once per step, whatever the batch;
    ``unique`` evaluates the distinct ids of each micro-batch, at most the rank's tokens of the step.
    So ``table`` only when V <= tokens per rank per step (small vocabularies, large local batches),
    else ``unique``. ``token`` never evaluates fewer ids than ``unique``.
    """
    return "table" if vocab_size <= tokens_per_rank_per_step else "unique"


@dataclass
class LevModelConfig:
    """GPT model settings beyond megatron-core's TransformerConfig (one field per CLI flag)."""

    vocab_size: int
    """V: vocabulary size, already padded as Megatron pads it (flag --vocab-size / tokenizer)."""

    max_sequence_length: int
    """Longest sequence the model accepts; sizes learned absolute positions (flag --seq-length)."""

    input_embedding: str = field(default="lev", metadata={"choices": INPUT_EMBEDDINGS})
    """Input representation, one of the registered input arms (models.arms: tied, untied, albert, flat_mlp,
    factored_mlp, lev; flag --input-embedding). Every arm but ``tied`` has an untied vocab-parallel output head."""

    lev: LEVConfig = field(default_factory=LEVConfig)
    """LEV knobs; also used by factored_mlp (seed) and by the parameter matching (flags --lev-*)."""

    position_embedding_type: str = field(default="learned_absolute", metadata={"choices": POSITION_EMBEDDING_TYPES})
    """Positions: "learned_absolute" (a learned table; the default, as Megatron-LM's), "rope" or "none"
    (no positions; flag --position-embedding-type)."""

    rotary_percent: float = field(default=1.0, metadata={"above": 0, "max": 1})
    """Fraction of each head's channels that are rotated by RoPE (flag --rotary-percent)."""

    rotary_base: int = field(default=10000, metadata={"min": 1})
    """RoPE base period (flag --rotary-base)."""

    use_rope_scaling: bool = False
    """Llama 3.1's RoPE scaling of the low frequencies (megatron-core's ``rope_scaling``: low/high frequency
    factors 1 and 4 over an original context of 8192 positions; flag --use-rope-scaling)."""

    rope_scaling_factor: float = field(default=8.0, metadata={"min": 1})
    """The factor of --use-rope-scaling that divides the low frequencies (Llama 3.1 and 3.3: 8, Llama 3.2: 32;
    flag --rope-scaling-factor)."""

    init_seed: int = 1234
    """Seed of the LEV initialisation (codebooks, per-head streams, id sample) and of the factored_mlp
    codebooks (flag --seed, whose default, Megatron-LM's, this is). The same seed gives the same initial
    function at any TP size."""

    weights_from_checkpoint: bool = False
    """The weights are about to be loaded from a checkpoint (resume, evaluation): the LEV layer skips its
    initialisation, whose statistics pass over the whole vocabulary. Megatron's own layers still
    initialise: in megatron-core 0.16.1 ``perform_initialization=False`` also skips setting their
    tensor-parallel attributes, which the gradient norm relies on."""

    albert_dim: Optional[int] = field(default=None, metadata={"min": 1})
    """e of the albert arm (V x e table, then e -> D); None = parameter-matched to LEV
    (flag --albert-dim)."""

    flat_mlp_dim: Optional[int] = field(default=None, metadata={"min": 1})
    """e of the flat_mlp arm (V x e table, then MLP e -> m -> D); None = matched (flag --flat-mlp-dim)."""

    mlp_hidden: Optional[int] = field(default=None, metadata={"min": 1})
    """m, hidden width of the flat_mlp and factored_mlp MLPs; None = matched (flag --mlp-hidden)."""

    normalization: str = field(default="LayerNorm", metadata={"choices": NORMALIZATIONS})
    """"LayerNorm" (the default, as Megatron-LM's) or "RMSNorm" (flag --normalization)."""

    activation: str = "gelu"
    """"gelu" (the default, as Megatron-LM's) or "swiglu" (gated SiLU; flag --swiglu / --no-swiglu)."""

    add_bias_linear: bool = True
    """Biases in the transformer's linear layers (default on, as Megatron-LM's; flag --disable-bias-linear
    turns them off)."""

    transformer_impl: str = field(default="auto", metadata={"choices": TRANSFORMER_IMPLS})
    """"auto" (Transformer Engine when TE and CUDA are present, else local), "local", or
    "transformer_engine" (flag --transformer-impl)."""

    linear_cross_entropy_chunk_size: Optional[int] = field(default=None, metadata={"min": 1})
    """Tokens per chunk of the linear cross-entropy (``--cross-entropy-fusion-impl linear``); None =
    ``parallel.linear_cross_entropy.tiling``'s default for the device (flag --linear-cross-entropy-chunk-size)."""

    # ------------------------------------------------------------------ helpers

    @property
    def arm(self) -> InputArm:
        """The registry's entry of ``input_embedding`` (``ConfigError`` for a name it does not hold)."""
        return get_arm(self.input_embedding)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """Only an arm that ties its table to the head (``tied``) shares the input table with the output head."""
        return self.arm.ties_output_head

    def resolved_widths(self, hidden_size: int) -> Dict[str, int]:
        """Widths of this config's arm: explicit values where given, else parameter-matched
        (``InputArm.widths``: albert ``albert_dim``; flat_mlp ``flat_mlp_dim``, ``mlp_hidden``;
        factored_mlp ``factored_mlp_hidden``; none for the other arms). Only this arm's are computed
        (matching can fail for other arms)."""
        arm = find_arm(self.input_embedding)
        return arm.widths(self, hidden_size) if arm is not None else {}

    def use_transformer_engine(self) -> bool:
        return use_transformer_engine(self.transformer_impl)

    # ------------------------------------------------------------------ checks

    def validate(self, config: Any) -> None:
        """Raise ``ConfigError`` (one line: flag and fix) if this model cannot be built with ``config``
        (a megatron-core TransformerConfig)."""
        get_arm(self.input_embedding)  # one line: --input-embedding's choices, and how an arm of one's own is added
        _check_choice("--position-embedding-type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        _check_choice("--normalization", self.normalization, NORMALIZATIONS)
        _check_choice("--swiglu/--no-swiglu (activation)", self.activation, ACTIVATIONS)
        _check_choice("--transformer-impl", self.transformer_impl, TRANSFORMER_IMPLS)
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ConfigError(f"--vocab-size must be an integer >= 2 (got {self.vocab_size!r})")
        if not isinstance(self.max_sequence_length, int) or self.max_sequence_length < 1:
            raise ConfigError(f"--seq-length must be a positive integer (got {self.max_sequence_length!r})")
        if not (0.0 < float(self.rotary_percent) <= 1.0):
            raise ConfigError(f"--rotary-percent must be in (0, 1] (got {self.rotary_percent!r})")
        for flag, value in (("--albert-dim", self.albert_dim), ("--flat-mlp-dim", self.flat_mlp_dim),
                            ("--mlp-hidden", self.mlp_hidden)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag} must be a positive integer or unset (got {value!r})")

        check_config_parallel(vars(config))
        tp = config.tensor_model_parallel_size
        if self.vocab_size % tp != 0:
            raise ConfigError(
                f"--vocab-size {self.vocab_size} is not divisible by --tensor-model-parallel-size {tp}; "
                f"pad the vocabulary (--make-vocab-size-divisible-by a multiple of {tp})"
            )
        if config.fp8:
            check_fp8(config.fp8, self.transformer_impl, config.fp8_recipe)
            check_fp8_widths(config)
        elif self.transformer_impl == "transformer_engine":
            use_transformer_engine("transformer_engine")  # raises when TE/CUDA are missing
        check_moe_settings(config, use_transformer_engine=self.use_transformer_engine())
        check_linear_cross_entropy(config, self.linear_cross_entropy_chunk_size)

        # Consistency between the two configs (build_transformer_config keeps them in step).
        if config.normalization != self.normalization:
            raise ConfigError(
                f"--normalization: TransformerConfig has {config.normalization!r} but the model config "
                f"{self.normalization!r}; build the TransformerConfig with build_transformer_config"
            )
        gated = self.activation == "swiglu"
        if bool(config.gated_linear_unit) != gated:
            raise ConfigError(
                f"--swiglu: activation {self.activation!r} needs gated_linear_unit={gated} in the "
                "TransformerConfig; build it with build_transformer_config"
            )
        if bool(config.add_bias_linear) != bool(self.add_bias_linear):
            raise ConfigError(
                "--add-bias-linear/--disable-bias-linear: TransformerConfig and model config disagree; "
                "build the TransformerConfig with build_transformer_config"
            )
        if self.position_embedding_type == "rope" and config.kv_channels * self.rotary_percent < 2:
            raise ConfigError("--rotary-percent leaves fewer than 2 rotated channels per head; raise it")
        check_rope_scaling(self.position_embedding_type, self.use_rope_scaling, self.rope_scaling_factor)

        # The LEV settings matter for lev (layer) and factored_mlp (seed), and for matching.
        arm = self.arm
        if arm.lev_layer or arm.matched:
            self._validate_lev(config.hidden_size, tp if arm.lev_layer else 1)
        if arm.matched:
            self.resolved_widths(config.hidden_size)  # raises ConfigError when matching is impossible

    def _validate_lev(self, hidden_size: int, tp: int) -> None:
        lev = self.lev
        lev.validate(self.vocab_size, hidden_size, tp_size=tp)
        b = lev.resolved_base(self.vocab_size)
        k = lev.num_digits
        if k > 1 and b ** (k - 1) >= self.vocab_size:
            raise ConfigError(
                f"--vocab-size {self.vocab_size} is too small for --lev-base {b} with --lev-digits {k}: "
                f"the leading digit is always 0 (b^(k-1) = {b ** (k - 1)} >= V); "
                "use fewer --lev-digits or a smaller --lev-base"
            )


def model_field_default(name: str) -> Any:
    """The default of ``LevModelConfig.<name>``: where each model default is written (the command-line flags
    of these fields and the readers of saved arguments take theirs from it)."""
    f = LevModelConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _check_choice(flag: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)} (got {value!r})")


def check_mtp_stage(input_embedding: str, mtp_num_layers: Optional[int], pp: int) -> None:
    """One-line ``ConfigError`` for an MTP block this layout cannot hold: megatron-core puts it on the
    last pipeline stage, and an input arm of ours (LEV, the matched baselines) embeds its shifted tokens,
    which only the first stage can do (megatron's own tied/untied table is shared across stages)."""
    if mtp_num_layers and pp > 1 and not get_arm(input_embedding).megatron_embedding:
        raise ConfigError(
            f"--mtp-num-layers with --input-embedding {input_embedding} needs the MTP block on the first pipeline "
            "stage (it embeds the shifted tokens with the input arm, which lives there); use "
            "--pipeline-model-parallel-size 1 or --input-embedding tied/untied")


# TransformerConfig fields that place the layers on the pipeline stages themselves (no even split then).
_UNEVEN_PIPELINE_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                           "pipeline_model_parallel_layout")


def check_config_parallel(fields: Dict[str, Any]) -> None:
    """:func:`check_parallel_settings` on a megatron-core TransformerConfig's fields (a config's ``vars``, or
    the keyword arguments it is about to be built from), against the smallest layout of its sizes."""
    check_parallel_settings(
        ParallelLayout.from_fields(fields), num_layers=fields["num_layers"],
        num_attention_heads=fields["num_attention_heads"], num_query_groups=fields.get("num_query_groups"),
        num_moe_experts=fields.get("num_moe_experts"), sequence_parallel=bool(fields.get("sequence_parallel")),
        uneven_pipeline=any(fields.get(name) is not None for name in _UNEVEN_PIPELINE_FIELDS))


def check_parallel_settings(
    layout: ParallelLayout, *, num_layers: int, num_attention_heads: int, num_query_groups: Optional[int] = None,
    num_moe_experts: Optional[int] = None, sequence_parallel: bool = False, uneven_pipeline: bool = False,
) -> None:
    """One-line ``ConfigError`` for a model that ``layout`` cannot hold, by megatron-core's rules: attention
    heads, query groups and experts against TP and EP, sequence parallelism against TP, layers against the
    pipeline's model chunks. The layout's own rules are :class:`ParallelLayout`'s; the LEV heads against TP
    are ``LEVConfig.validate_settings``'s (lev/ checks the layer it defines)."""
    tp, pp, vpp, ep = layout.tp, layout.pp, layout.vpp, layout.ep
    if num_attention_heads % tp != 0:
        raise ConfigError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; choose a multiple of {tp}"
        )
    groups = num_query_groups if num_query_groups is not None else num_attention_heads
    # megatron-core's attention gives each group heads / groups queries (its TransformerConfig does not check
    # it: an uneven split fails at the first forward, reshaping the fused QKV projection).
    if num_attention_heads % groups != 0:
        raise ConfigError(
            f"--num-attention-heads {num_attention_heads} is not divisible by --num-query-groups {groups}; "
            f"choose --num-query-groups among the divisors of {num_attention_heads}"
        )
    # megatron-core's TransformerConfig: the groups split over the TP ranks, or, fewer, are replicated.
    if groups % tp != 0 and tp % groups != 0:
        raise ConfigError(
            f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} must divide one another; "
            f"choose --num-query-groups as a multiple or a divisor of {tp}"
        )
    if not num_moe_experts:
        if ep > 1:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} needs --num-experts; set --num-experts or drop EP")
    elif num_moe_experts % ep:
        raise ConfigError(
            f"--num-experts {num_moe_experts} is not divisible by --expert-model-parallel-size {ep}; "
            f"choose a multiple of {ep}")
    if sequence_parallel and tp <= 1:
        raise ConfigError(
            "--sequence-parallel needs --tensor-model-parallel-size > 1; drop --sequence-parallel or raise TP"
        )
    stages = layout.stages
    if not uneven_pipeline and num_layers % stages != 0:
        what = f"--pipeline-model-parallel-size {pp}" + (f" x {vpp} virtual stages" if vpp else "")
        raise ConfigError(
            f"--num-layers {num_layers} is not divisible by {what} = {stages}; "
            f"choose --num-layers as a multiple of {stages}"
        )


def check_fp8(fp8: Optional[str], transformer_impl: str = "auto", recipe: Optional[str] = "delayed") -> None:
    """FP8 runs only through Transformer Engine on a CUDA GPU that has FP8 GEMMs, with a recipe that this
    TE version and this GPU provide (what megatron-core's ``get_fp8_recipe`` and TE would refuse at the
    first forward, refused here at start-up)."""
    if not fp8:
        return
    if fp8 not in FP8_FORMATS:
        raise ConfigError(f"--fp8-format must be {' or '.join(FP8_FORMATS)} (got {fp8!r})")
    if transformer_impl == "local":
        raise ConfigError("--fp8-format needs --transformer-impl transformer_engine (or auto); local has no FP8")
    if not (te_available() and torch.cuda.is_available()):
        raise ConfigError(
            f"--fp8-format {fp8} needs Transformer Engine and a CUDA GPU (not found on this machine); "
            "drop --fp8-format to train in fp32/bf16"
        )
    cc = cuda_capability()
    if cc < (8, 9):
        raise ConfigError(
            f"--fp8-format {fp8}: this GPU (compute capability {cc[0]}.{cc[1]}) has no FP8 GEMMs, which need "
            "compute capability >= 8.9 (Ada, Hopper or newer); drop --fp8-format"
        )
    recipe = recipe or "delayed"
    if recipe not in FP8_RECIPE_MIN_TE:
        raise ConfigError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPE_MIN_TE)} (got {recipe!r})")
    from packaging.version import Version

    have = te_version()
    need = FP8_RECIPE_MIN_TE[recipe]
    if have is not None and Version(str(have)) < Version(need):
        raise ConfigError(
            f"--fp8-recipe {recipe} needs Transformer Engine >= {Version(need).base_version} (found {have}); "
            "upgrade Transformer Engine or use --fp8-recipe delayed"
        )
    if recipe == "mxfp8" and cc[0] < 10:
        raise ConfigError(
            f"--fp8-recipe mxfp8 runs on Blackwell GPUs only (compute capability >= 10.0; this GPU is "
            f"{cc[0]}.{cc[1]}); use --fp8-recipe delayed, tensorwise or blockwise"
        )


def fp8_multiple(recipe: Optional[str]) -> Tuple[int, int]:
    """(tokens, width) multiples TE's FP8 GEMMs need: 8 x 16 (``assert_dim_for_fp8_exec``); mxfp8 scales
    blocks of 32 along both dimensions, so 32 x 32."""
    return (32, 32) if recipe == "mxfp8" else (8, 16)


def check_fp8_widths(config: Any) -> None:
    """The widths of the FP8 GEMMs on one tensor-parallel rank divide TE's multiple: the hidden size, the
    MLP width / TP, and the query and QKV widths / TP (``config``: a megatron-core TransformerConfig)."""
    if not config.fp8:
        return
    m = fp8_multiple(config.fp8_recipe)[1]
    why = f"FP8 GEMMs{' with --fp8-recipe mxfp8' if m == 32 else ''} need widths divisible by {m}"
    tp = config.tensor_model_parallel_size
    D, F = config.hidden_size, config.ffn_hidden_size
    a, g = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    dh = config.kv_channels
    if D % m:
        raise ConfigError(f"--hidden-size {D}: {why}; choose a multiple of {m}")
    if F % (tp * m):
        raise ConfigError(
            f"--ffn-hidden-size {F} / --tensor-model-parallel-size {tp} = {F / tp:g} per rank: {why}; "
            f"choose --ffn-hidden-size as a multiple of {tp * m}"
        )
    for what, width in (("query", a * dh), ("QKV", (a + 2 * g) * dh)):
        if width % (tp * m):
            raise ConfigError(
                f"the {what} projection is {width} wide ({a} --num-attention-heads, {g} --num-query-groups, "
                f"--kv-channels {dh}), {width / tp:g} per rank at --tensor-model-parallel-size {tp}: {why}; "
                f"choose --kv-channels (or the head counts) so that its width is a multiple of {tp * m}"
            )


def check_fp8_tokens(fp8: Optional[str], recipe: Optional[str], *, micro_batch_size: int, seq_length: int,
                     tp: int = 1, sequence_parallel: bool = False) -> None:
    """The tokens of one micro-batch (one TP rank's share under sequence parallelism, where each rank casts
    its slice to FP8) divide TE's multiple: 8, 32 for mxfp8."""
    if not fp8:
        return
    m = fp8_multiple(recipe)[0]
    tokens = micro_batch_size * seq_length
    per_rank = tokens / tp if sequence_parallel else tokens
    if per_rank % m:
        where = f", {per_rank:g} per tensor-parallel rank under --sequence-parallel" if sequence_parallel else ""
        mult = m * tp if sequence_parallel else m
        raise ConfigError(
            f"--micro-batch-size {micro_batch_size} x --seq-length {seq_length} = {tokens} tokens per "
            f"micro-batch{where}: FP8 GEMMs{' with --fp8-recipe mxfp8' if m == 32 else ''} need a multiple of "
            f"{m}; choose them so that micro-batch-size x seq-length is a multiple of {mult}"
        )


def check_rope_scaling(position_embedding_type: str, use_rope_scaling: bool, rope_scaling_factor: float) -> None:
    """--use-rope-scaling needs RoPE, and --rope-scaling-factor needs --use-rope-scaling (a factor without it
    would be accepted and ignored)."""
    if use_rope_scaling and position_embedding_type != "rope":
        raise ConfigError(f"--use-rope-scaling scales RoPE; this model has --position-embedding-type "
                          f"{position_embedding_type}: add --position-embedding-type rope or drop it")
    if not use_rope_scaling and float(rope_scaling_factor) != 8.0:
        raise ConfigError(f"--rope-scaling-factor {rope_scaling_factor} applies only with --use-rope-scaling; "
                          "add it or drop the factor")


# ---------------------------------------------------------------------- TransformerConfig


def fusion_defaults(*, activation: str, add_bias_linear: bool, position_embedding_type: str,
                    megatron_ddp: bool = False) -> Dict[str, bool]:
    """megatron-core's fusion flags as Megatron-LM defaults them, on where CUDA and the kernel are present.

    - ``bias_dropout_fusion``, ``bias_activation_fusion``: megatron's torch.compile'd functions (CUDA with
      Triton); bias-activation for SwiGLU, and for GeLU only with biases (megatron refuses bias-GeLU without
      a bias; Megatron-LM turns it off there);
    - ``apply_rope_fusion``: megatron's ``fused_apply_rotary_pos_emb``, Transformer Engine's fused RoPE or,
      without TE, ``models.rope`` (compiled with Triton; bit for bit megatron's unfused RoPE otherwise);
    - ``gradient_accumulation_fusion``: the weight-gradient GEMM accumulates into megatron DDP's fp32
      ``main_grad`` instead of writing a ``param.grad`` that DDP then adds. TE's layers do it themselves,
      but megatron's local linear layers (the output head in every spec) call apex's
      ``fused_weight_gradient_mlp_cuda``, so it needs apex (megatron's own flag), and ``megatron_ddp``:
      only megatron's DistributedDataParallel gives the parameters ``main_grad``;
    - ``masked_softmax_fusion``: apex's fused softmax (read only by megatron's DotProductAttention).

    ``cross_entropy_loss_fusion`` keeps megatron's default, off: Megatron-LM leaves it opt-in too.
    """
    cuda = torch.cuda.is_available()
    compiled = cuda and triton_available()
    from megatron.core.tensor_parallel import layers

    return {
        "bias_dropout_fusion": compiled,
        "bias_activation_fusion": compiled and (activation == "swiglu" or bool(add_bias_linear)),
        "apply_rope_fusion": cuda and position_embedding_type == "rope",
        "gradient_accumulation_fusion": cuda and megatron_ddp and bool(layers._grad_accum_fusion_available),
        "masked_softmax_fusion": cuda and apex_softmax_available(),
    }


def build_transformer_config(model_config: Optional[LevModelConfig] = None, *, megatron_ddp: bool = False,
                             **kwargs: Any):
    """A megatron-core ``TransformerConfig`` with defaults that fit ``model_config`` and this machine.

    Fills (unless given in ``kwargs``): ``normalization``; ``gated_linear_unit`` and
    ``activation_func`` for swiglu (SiLU) / gelu; ``add_bias_linear``; ``use_cpu_initialization``
    and ``batch_p2p_sync=False`` when CUDA is absent; ``pipeline_dtype = params_dtype`` (fp32 by
    default, bf16 when ``bf16=True``); the fusions of ``fusion_defaults`` (all off on CPU).
    ``megatron_ddp``: the model will be wrapped in megatron-core's DistributedDataParallel (training),
    which gradient-accumulation fusion needs. The parallel and FP8 settings are checked first so errors
    are one line naming the flag.
    """
    from megatron.core.transformer import TransformerConfig

    kw: Dict[str, Any] = dict(kwargs)
    mc = model_config
    normalization = kw.pop("normalization", mc.normalization if mc else model_field_default("normalization"))
    activation = mc.activation if mc else kw.pop("activation", model_field_default("activation"))
    kw.pop("activation", None)
    _check_choice("--normalization", normalization, NORMALIZATIONS)
    _check_choice("--swiglu/--no-swiglu (activation)", activation, ACTIVATIONS)
    kw["normalization"] = normalization
    if activation == "swiglu":
        kw.setdefault("gated_linear_unit", True)
        kw.setdefault("activation_func", torch.nn.functional.silu)
    else:
        kw.setdefault("gated_linear_unit", False)
        kw.setdefault("activation_func", torch.nn.functional.gelu)
    kw.setdefault("add_bias_linear", mc.add_bias_linear if mc else model_field_default("add_bias_linear"))
    fusions = fusion_defaults(activation=activation, add_bias_linear=kw["add_bias_linear"],
                              position_embedding_type=mc.position_embedding_type if mc
                              else model_field_default("position_embedding_type"),
                              megatron_ddp=megatron_ddp)
    for name, on in fusions.items():
        kw.setdefault(name, on)
    if kw["apply_rope_fusion"]:
        rope.install()  # megatron's fused RoPE without TE: models.rope's (TransformerConfig asks for one)

    if not torch.cuda.is_available():
        kw.setdefault("use_cpu_initialization", True)
        kw.setdefault("batch_p2p_sync", False)
    if kw.get("bf16"):
        kw.setdefault("params_dtype", torch.bfloat16)
    elif kw.get("fp16"):
        kw.setdefault("params_dtype", torch.float16)
    kw.setdefault("params_dtype", torch.float32)
    pp = kw.get("pipeline_model_parallel_size", 1)
    if pp > 1:
        kw.setdefault("pipeline_dtype", kw["params_dtype"])

    for required in ("num_layers", "hidden_size", "num_attention_heads"):
        if required not in kw:
            raise ConfigError(f"--{required.replace('_', '-')} is required")
    check_config_parallel(kw)
    if kw.get("fp8"):
        check_fp8(kw["fp8"], mc.transformer_impl if mc else "auto", kw.get("fp8_recipe", "delayed"))
    check_te_only_moe_flags(kw, use_transformer_engine=use_transformer_engine(mc.transformer_impl if mc else "auto"))
    try:
        config = TransformerConfig(**kw)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"TransformerConfig: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    check_fp8_widths(config)  # on megatron's resolved widths (ffn_hidden_size, kv_channels, query groups)
    return config
