"""Model-level configuration: which input arm, positions, norms, activation, and the checks
that turn impossible parallel/precision settings into one-line errors naming the CLI flag.

``LevModelConfig`` holds what megatron-core's ``TransformerConfig`` does not: the vocabulary,
the input representation (``input_embedding``), the LEV knobs and the baseline widths.
``build_transformer_config`` fills a ``TransformerConfig`` with defaults that run on CPU and
match a ``LevModelConfig`` (norm, activation, biases).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from megatron_lev.lev.config import ConfigError, LEVConfig

from .params import ARMS_MATCHED, match_flat_mlp_hidden, matched_widths

# The input arms, in the order of the paper's tables; the flag's choices and the check use this tuple.
INPUT_EMBEDDINGS = ("tied", "untied") + ARMS_MATCHED + ("lev",)
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


def te_available() -> bool:
    """True when Transformer Engine can be imported (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


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


def settings_for_loading(saved: Dict[str, Any]) -> Dict[str, Any]:
    """The layer-spec and FP8 settings to rebuild a saved model with on this machine.

    Checkpoints load into either layer spec (``models.checkpoint_keys``), so a model trained with
    Transformer Engine is rebuilt with the local spec, without FP8, where TE or CUDA is missing.
    """
    impl = saved.get("transformer_impl") or "auto"
    if te_available() and torch.cuda.is_available():
        return {"transformer_impl": impl, "fp8_format": saved.get("fp8_format")}
    return {"transformer_impl": "auto" if impl == "transformer_engine" else impl, "fp8_format": None}


@dataclass
class LevModelConfig:
    """GPT model settings beyond megatron-core's TransformerConfig (one field per CLI flag)."""

    vocab_size: int
    """V: vocabulary size, already padded as Megatron pads it (flag --vocab-size / tokenizer)."""

    max_sequence_length: int
    """Longest sequence the model accepts; sizes learned absolute positions (flag --seq-length)."""

    input_embedding: str = field(default="lev", metadata={"choices": INPUT_EMBEDDINGS})
    """Input representation, one of tied, untied, albert, flat_mlp, factored_mlp, lev
    (flag --input-embedding). Every arm but ``tied`` has an untied vocab-parallel output head."""

    lev: LEVConfig = field(default_factory=LEVConfig)
    """LEV knobs; also used by factored_mlp (seed) and by the parameter matching (flags --lev-*)."""

    position_embedding_type: str = "rope"
    """"rope" (default) or "learned_absolute" (flag --position-embedding-type)."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that are rotated by RoPE (flag --rotary-percent)."""

    rotary_base: int = 10000
    """RoPE base period (flag --rotary-base)."""

    init_seed: int = 0
    """Seed of the LEV initialisation (codebooks, per-head streams, id sample) and of the factored_mlp
    codebooks (flag --seed). The same seed gives the same initial function at any TP size."""

    weights_from_checkpoint: bool = False
    """The weights are about to be loaded from a checkpoint (resume, evaluation): the LEV layer skips its
    initialisation, whose statistics pass over the whole vocabulary. Megatron's own layers still
    initialise: in megatron-core 0.16.1 ``perform_initialization=False`` also skips setting their
    tensor-parallel attributes, which the gradient norm relies on."""

    albert_dim: Optional[int] = None
    """e of the albert arm (V x e table, then e -> D); None = parameter-matched to LEV
    (flag --albert-dim)."""

    flat_mlp_dim: Optional[int] = None
    """e of the flat_mlp arm (V x e table, then MLP e -> m -> D); None = matched (flag --flat-mlp-dim)."""

    mlp_hidden: Optional[int] = None
    """m, hidden width of the flat_mlp and factored_mlp MLPs; None = matched (flag --mlp-hidden)."""

    normalization: str = "RMSNorm"
    """"RMSNorm" (default) or "LayerNorm" (flag --normalization)."""

    activation: str = "swiglu"
    """"swiglu" (gated SiLU, default) or "gelu" (flag --swiglu / --no-swiglu)."""

    add_bias_linear: bool = False
    """Biases in the transformer's linear layers (flag --add-bias-linear / --disable-bias-linear)."""

    transformer_impl: str = field(default="auto", metadata={"choices": TRANSFORMER_IMPLS})
    """"auto" (Transformer Engine when TE and CUDA are present, else local), "local", or
    "transformer_engine" (flag --transformer-impl)."""

    # ------------------------------------------------------------------ helpers

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """Only the ``tied`` arm shares the input table with the output head."""
        return self.input_embedding == "tied"

    def resolved_widths(self, hidden_size: int) -> Dict[str, int]:
        """Widths of the baseline arms: explicit values where given, else parameter-matched.

        Keys: ``albert_dim``, ``flat_mlp_dim``, ``mlp_hidden`` (flat_mlp), ``factored_mlp_hidden``.
        Only the keys of this config's arm are computed (matching can fail for other arms)."""
        arm = self.input_embedding
        out: Dict[str, int] = {}
        if arm not in ARMS_MATCHED:
            return out
        need_match = (
            (arm == "albert" and self.albert_dim is None)
            or (arm == "flat_mlp" and (self.flat_mlp_dim is None or self.mlp_hidden is None))
            or (arm == "factored_mlp" and self.mlp_hidden is None)
        )
        matched = matched_widths(self.vocab_size, hidden_size, self.lev, arms=(arm,)) if need_match else {}
        if arm == "albert":
            out["albert_dim"] = self.albert_dim if self.albert_dim is not None else matched["albert_dim"]
        elif arm == "flat_mlp":
            if self.flat_mlp_dim is not None and self.mlp_hidden is None:
                # e given, m matched to the remaining budget.
                m = match_flat_mlp_hidden(self.vocab_size, hidden_size, self.lev, self.flat_mlp_dim)
                out.update(flat_mlp_dim=self.flat_mlp_dim, mlp_hidden=m)
            else:
                out["flat_mlp_dim"] = (
                    self.flat_mlp_dim if self.flat_mlp_dim is not None else matched["flat_mlp_dim"]
                )
                out["mlp_hidden"] = self.mlp_hidden if self.mlp_hidden is not None else matched["flat_mlp_hidden"]
        else:
            out["factored_mlp_hidden"] = (
                self.mlp_hidden if self.mlp_hidden is not None else matched["factored_mlp_hidden"]
            )
        return out

    def use_transformer_engine(self) -> bool:
        return use_transformer_engine(self.transformer_impl)

    # ------------------------------------------------------------------ checks

    def validate(self, config: Any) -> None:
        """Raise ``ConfigError`` (one line: flag and fix) if this model cannot be built with ``config``
        (a megatron-core TransformerConfig)."""
        _check_choice("--input-embedding", self.input_embedding, INPUT_EMBEDDINGS)
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

        check_parallel_settings(
            tp=config.tensor_model_parallel_size,
            pp=config.pipeline_model_parallel_size,
            vpp=config.virtual_pipeline_model_parallel_size,
            num_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups,
            sequence_parallel=config.sequence_parallel,
            uneven_pipeline=(
                getattr(config, "num_layers_in_first_pipeline_stage", None) is not None
                or getattr(config, "num_layers_in_last_pipeline_stage", None) is not None
                or getattr(config, "pipeline_model_parallel_layout", None) is not None
            ),
        )
        tp = config.tensor_model_parallel_size
        if self.vocab_size % tp != 0:
            raise ConfigError(
                f"--vocab-size {self.vocab_size} is not divisible by --tensor-model-parallel-size {tp}; "
                f"pad the vocabulary (--make-vocab-size-divisible-by a multiple of {tp})"
            )
        if config.fp8:
            check_fp8(config.fp8, self.transformer_impl)
        elif self.transformer_impl == "transformer_engine":
            use_transformer_engine("transformer_engine")  # raises when TE/CUDA are missing

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

        # The LEV settings matter for lev (layer) and factored_mlp (seed), and for matching.
        if self.input_embedding in ("lev",) + ARMS_MATCHED:
            self._validate_lev(config.hidden_size, tp if self.input_embedding == "lev" else 1)
        if self.input_embedding in ARMS_MATCHED:
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


def _check_choice(flag: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)} (got {value!r})")


def check_parallel_settings(
    *, tp: int, pp: int, vpp: Optional[int], num_layers: int, num_attention_heads: int,
    num_query_groups: Optional[int] = None, sequence_parallel: bool = False, uneven_pipeline: bool = False,
) -> None:
    """One-line ``ConfigError`` for parallel layouts that cannot work."""
    if tp < 1 or pp < 1:
        raise ConfigError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if num_attention_heads % tp != 0:
        raise ConfigError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; choose a multiple of {tp}"
        )
    groups = num_query_groups if num_query_groups is not None else num_attention_heads
    if groups % tp != 0 and tp % groups != 0:
        raise ConfigError(
            f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} must divide one another"
        )
    if sequence_parallel and tp <= 1:
        raise ConfigError(
            "--sequence-parallel needs --tensor-model-parallel-size > 1; drop --sequence-parallel or raise TP"
        )
    if vpp is not None and vpp > 1 and pp <= 1:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage / virtual stages need --pipeline-model-parallel-size > 1"
        )
    stages = pp * (vpp or 1)
    if not uneven_pipeline and num_layers % stages != 0:
        what = f"--pipeline-model-parallel-size {pp}" + (f" x {vpp} virtual stages" if vpp else "")
        raise ConfigError(
            f"--num-layers {num_layers} is not divisible by {what} = {stages}; "
            f"choose --num-layers as a multiple of {stages}"
        )


def check_fp8(fp8: Optional[str], transformer_impl: str = "auto") -> None:
    """FP8 runs only through Transformer Engine on a CUDA GPU."""
    if not fp8:
        return
    if fp8 not in ("e4m3", "hybrid"):
        raise ConfigError(f"--fp8-format must be e4m3 or hybrid (got {fp8!r})")
    if transformer_impl == "local":
        raise ConfigError("--fp8-format needs --transformer-impl transformer_engine (or auto); local has no FP8")
    if not (te_available() and torch.cuda.is_available()):
        raise ConfigError(
            f"--fp8-format {fp8} needs Transformer Engine and a CUDA GPU (not found on this machine); "
            "drop --fp8-format to train in fp32/bf16"
        )


# ---------------------------------------------------------------------- TransformerConfig


def build_transformer_config(model_config: Optional[LevModelConfig] = None, **kwargs: Any):
    """A megatron-core ``TransformerConfig`` with defaults that fit ``model_config`` and this machine.

    Fills (unless given in ``kwargs``): ``normalization``; ``gated_linear_unit`` and
    ``activation_func`` for swiglu (SiLU) / gelu; ``add_bias_linear``; ``use_cpu_initialization``
    and ``batch_p2p_sync=False`` when CUDA is absent; ``pipeline_dtype = params_dtype`` (fp32 by
    default, bf16 when ``bf16=True``); fusions that need CUDA kernels off on CPU. The parallel and
    FP8 settings are checked first so errors are one line naming the flag.
    """
    from megatron.core.transformer import TransformerConfig

    kw: Dict[str, Any] = dict(kwargs)
    mc = model_config
    normalization = kw.pop("normalization", mc.normalization if mc else "RMSNorm")
    activation = mc.activation if mc else kw.pop("activation", "swiglu")
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
    kw.setdefault("add_bias_linear", mc.add_bias_linear if mc else False)
    kw.setdefault("bias_activation_fusion", False)

    cuda = torch.cuda.is_available()
    if not cuda:
        kw.setdefault("use_cpu_initialization", True)
        kw.setdefault("batch_p2p_sync", False)
        kw.setdefault("masked_softmax_fusion", False)
        kw.setdefault("bias_dropout_fusion", False)
        kw.setdefault("apply_rope_fusion", False)
        kw.setdefault("gradient_accumulation_fusion", False)
        kw.setdefault("persist_layer_norm", False)
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
    check_parallel_settings(
        tp=kw.get("tensor_model_parallel_size", 1),
        pp=pp,
        vpp=kw.get("virtual_pipeline_model_parallel_size"),
        num_layers=kw["num_layers"],
        num_attention_heads=kw["num_attention_heads"],
        num_query_groups=kw.get("num_query_groups"),
        sequence_parallel=kw.get("sequence_parallel", False),
        uneven_pipeline=kw.get("num_layers_in_first_pipeline_stage") is not None
        or kw.get("num_layers_in_last_pipeline_stage") is not None,
    )
    if kw.get("fp8"):
        check_fp8(kw["fp8"], mc.transformer_impl if mc else "auto")
    try:
        return TransformerConfig(**kw)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"TransformerConfig: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
