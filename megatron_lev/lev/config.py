"""Configuration of the LEV input-embedding layer, and its parameter count.

One dataclass holds every knob of the layer (spec: ``shared/spec/lev.md``). Each field is one
``--lev-*`` command-line flag (``lev_flag``): the training parser generates the flags from the fields
(type, default, choices, help from the field docstring), and error messages name the flag so a user
knows what to change. ``ConfigError``, the one error class of every configuration check in the
project, lives here, in the lowest layer, so that every package above can raise and catch it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional

COMPUTE_MODES = ("token", "unique", "table")
BASIS_KINDS = ("auto", "dense", "sparse", "fused", "triton")
MIN_INIT_SAMPLE_SIZE = 4096


class ConfigError(ValueError):
    """An impossible or inconsistent configuration; the message is one line naming the flag and the fix."""


def smallest_base(vocab_size: int, num_digits: int) -> int:
    """Smallest integer ``b >= 1`` with ``b ** num_digits >= vocab_size`` (exact integer arithmetic)."""
    if vocab_size <= 1:
        return 1
    b = max(1, int(round(vocab_size ** (1.0 / num_digits))))
    # The float root is only a starting point; correct it with exact integer powers.
    while b > 1 and (b - 1) ** num_digits >= vocab_size:
        b -= 1
    while b**num_digits < vocab_size:
        b += 1
    return b


@dataclass
class LEVConfig:
    """Hyperparameters of the LEV embedding G: {0..V-1} -> R^D (see the spec's table)."""

    num_digits: int = field(default=3, metadata={"flag": "--lev-digits", "min": 1})
    """k: number of digits of the compositional index of a token id."""

    base: Optional[int] = field(default=None, metadata={"min": 1})
    """b: base of the digits; None selects the smallest integer with b**k >= V."""

    seed_dim: int = field(default=128, metadata={"min": 1})
    """d_s: width of each codebook row, i.e. of the seed z(i)."""

    num_knots: int = field(default=16, metadata={"flag": "--lev-knots", "min": 3})
    """kappa: uniform knots of each univariate quadratic B-spline, >= 3."""

    rank: int = field(default=64, metadata={"min": 1})
    """r: rank of the separable tensor product, i.e. modes per head."""

    num_heads: int = field(default=8, metadata={"flag": "--lev-heads", "min": 1})
    """h: parallel heads; must be divisible by the tensor-parallel size."""

    compute_mode: str = field(default="unique", metadata={"choices": COMPUTE_MODES})
    """How G is evaluated per micro-batch: "token" (every position), "unique" (once per distinct id),
    or "table" (all V ids once per optimizer step)."""

    basis: str = field(default="auto", metadata={"choices": BASIS_KINDS})
    """Spline-basis evaluation: "dense" (kappa-wide einsum), "sparse" (gather of the 3 non-zero knots),
    "fused" (a registered fused kernel for the device, e.g. ``megatron_lev.kernels``' numba kernel on
    CPU or Triton kernel on CUDA; falls back to the eager form where none is registered or for fp64
    inputs), "triton" (the fused Triton kernel; an error where it is not available), or "auto" (triton
    on CUDA where its kernel is registered: Triton imports and can build its launcher, see
    ``megatron_lev.kernels``; else fused where registered, else dense on CPU and sparse on CUDA)."""

    log_eps: float = field(default=1e-30, metadata={"above": 0.0, "below": 1e-6})
    """Floor on |phi| before the log in the stable product; far below 1."""

    chunk_size: int = field(default=4096, metadata={"min": 1})
    """Ids per chunk for the initialisation statistics, materialize() and the table mode."""

    product_chunk: int = field(default=16, metadata={"min": 1})
    """Seed dimensions per chunk inside the separable-product kernel; bounds its peak memory to
    N*h*product_chunk*r values."""

    init_sample_size: Optional[int] = field(default=None, metadata={"min": MIN_INIT_SAMPLE_SIZE})
    """Ids used for the initialisation statistics: None = all V ids, otherwise a fixed-seed uniform
    sample of this many ids (at least 4096)."""

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "LEVConfig":
        """The config from flat arguments (``{"lev_digits": 3, ...}``: parsed flags or a checkpoint's saved
        arguments); a missing or None value keeps the field's default."""
        return cls(**{f.name: args[lev_arg(f.name)] for f in fields(cls) if args.get(lev_arg(f.name)) is not None})

    def to_args(self) -> Dict[str, Any]:
        """The flat arguments of this config (inverse of :meth:`from_args`)."""
        return {lev_arg(f.name): getattr(self, f.name) for f in fields(self)}

    def resolved_base(self, vocab_size: int) -> int:
        """The base b in use for ``vocab_size``: ``base`` if given, else the smallest b with b**k >= V."""
        if self.base is not None:
            return int(self.base)
        return smallest_base(int(vocab_size), int(self.num_digits))

    def resolved_basis(self, device_type: str) -> str:
        """The basis "auto" stands for on a device type ("cpu", "cuda", ...); others as given."""
        if self.basis != "auto":
            return self.basis
        from .functional import has_fused_product

        if device_type == "cuda" and has_fused_product(device_type, "triton"):
            return "triton"
        if has_fused_product(device_type):
            return "fused"
        return "sparse" if device_type == "cuda" else "dense"

    def validate(self, vocab_size: int, hidden_size: Optional[int] = None, tp_size: int = 1) -> None:
        """Raise ConfigError (one line naming the flag and the fix) for an unusable configuration.

        The one check of every LEV setting: :meth:`validate_settings`, then what depends on the
        vocabulary and the hidden size."""
        self.validate_settings(tp_size)
        if not isinstance(vocab_size, int) or vocab_size < 1:
            _fail(f"vocabulary size must be a positive integer (got {vocab_size!r})")
        if hidden_size is not None and (not isinstance(hidden_size, int) or hidden_size < 1):
            _fail(f"hidden size must be a positive integer (got {hidden_size!r}); check --hidden-size")
        if self.base is not None and self.base**self.num_digits < vocab_size:
            need = smallest_base(vocab_size, self.num_digits)
            _fail(
                f"--lev-base {self.base} with --lev-digits {self.num_digits} covers only "
                f"{self.base ** self.num_digits} ids < vocabulary size {vocab_size}; "
                f"use --lev-base >= {need}, more --lev-digits, or leave --lev-base unset"
            )

    def validate_settings(self, tp_size: int = 1) -> None:
        """The checks that need no vocabulary (run when the flags are parsed): ranges, choices, and the
        heads' divisibility by the tensor-parallel size ``tp_size``."""
        for f in fields(self):  # the ranges of the fields' metadata (the flags' ranges too)
            value, low = getattr(self, f.name), f.metadata.get("min")
            if low is not None and not (value is None and f.default is None):
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    unset = " or unset" if f.default is None else ""
                    _fail(f"{lev_flag(f.name)} must be an integer >= {low}{unset} (got {value!r})")
        if not isinstance(tp_size, int) or tp_size < 1:
            _fail(f"tensor-parallel size must be a positive integer (got {tp_size!r})")
        if self.num_heads % tp_size != 0:
            _fail(
                f"--lev-heads {self.num_heads} is not divisible by the tensor-parallel size {tp_size} "
                f"(--tensor-model-parallel-size); choose --lev-heads as a multiple of {tp_size}"
            )
        for name in ("compute_mode", "basis"):
            choices = _FIELDS[name].metadata["choices"]
            if getattr(self, name) not in choices:
                _fail(f"{lev_flag(name)} must be one of {', '.join(choices)} (got {getattr(self, name)!r})")
        eps = _FIELDS["log_eps"].metadata
        if not (eps["above"] < float(self.log_eps) < eps["below"]):
            _fail(f"--lev-log-eps must be in ({eps['above']:g}, {eps['below']:g}), far below 1 (got {self.log_eps!r}); "
                  "default 1e-30")


def _fail(msg: str) -> None:
    raise ConfigError(f"LEV config: {msg}")


def lev_flag(name: str) -> str:
    """The command-line flag of ``LEVConfig`` field ``name``: its ``flag`` metadata, else ``--lev-<name>``."""
    return _FIELDS[name].metadata.get("flag", "--lev-" + name.replace("_", "-"))


def lev_arg(name: str) -> str:
    """The argument name (argparse ``dest``, saved-config key) of ``LEVConfig`` field ``name``."""
    return lev_flag(name)[2:].replace("-", "_")


_FIELDS = {f.name: f for f in fields(LEVConfig)}


def lev_param_count(
    vocab_size: int, hidden_size: int, config: Optional[LEVConfig] = None, base: Optional[int] = None
) -> int:
    """P_LEV = k b d_s + h (d_s^2 + d_s + 2 d_s + d_s kappa r + r D) + D (spec, "Parameter count")."""
    config = config if config is not None else LEVConfig()
    k = config.num_digits
    b = int(base) if base is not None else config.resolved_base(vocab_size)
    ds, kappa, r, h, D = config.seed_dim, config.num_knots, config.rank, config.num_heads, hidden_size
    return k * b * ds + h * (ds * ds + ds + 2 * ds + ds * kappa * r + r * D) + D
