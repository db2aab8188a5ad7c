"""Configuration of the LEV input-embedding layer, and its parameter count.

One dataclass holds every knob of the layer (spec: ``shared/spec/lev.md``). Each field maps to a
``--lev-*`` command-line flag; error messages name the flag so a user knows what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

COMPUTE_MODES = ("token", "unique", "table")
BASIS_KINDS = ("auto", "dense", "sparse", "fused", "triton")
MIN_INIT_SAMPLE_SIZE = 4096


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

    num_digits: int = 3
    """k: number of digits of the compositional index of a token id (flag --lev-digits)."""

    base: Optional[int] = None
    """b: base of the digits; None selects the smallest integer with b**k >= V (flag --lev-base)."""

    seed_dim: int = 128
    """d_s: width of each codebook row, i.e. of the seed z(i) (flag --lev-seed-dim)."""

    num_knots: int = 16
    """kappa: uniform knots of each univariate quadratic B-spline, >= 3 (flag --lev-knots)."""

    rank: int = 64
    """r: rank of the separable tensor product, i.e. modes per head (flag --lev-rank)."""

    num_heads: int = 8
    """h: parallel heads; must be divisible by the tensor-parallel size (flag --lev-heads)."""

    compute_mode: str = "unique"
    """How G is evaluated per micro-batch: "token" (every position), "unique" (once per distinct id),
    or "table" (all V ids once per optimizer step) (flag --lev-compute-mode)."""

    basis: str = "auto"
    """Spline-basis evaluation: "dense" (kappa-wide einsum), "sparse" (gather of the 3 non-zero knots),
    "fused" (a registered fused kernel for the device, e.g. ``megatron_lev.kernels``' numba kernel on
    CPU or Triton kernel on CUDA; falls back to the eager form where none is registered or for fp64
    inputs), "triton" (the fused Triton kernel; an error where it is not available), or "auto" (triton
    on CUDA where Triton imports, else fused where registered, else dense on CPU and sparse on CUDA)
    (flag --lev-basis)."""

    log_eps: float = 1e-30
    """Floor on |phi| before the log in the stable product; far below 1 (flag --lev-log-eps)."""

    chunk_size: int = 4096
    """Ids per chunk for the initialisation statistics, materialize() and the table mode
    (flag --lev-chunk-size)."""

    product_chunk: int = 16
    """Seed dimensions per chunk inside the separable-product kernel; bounds its peak memory to
    N*h*product_chunk*r values (flag --lev-product-chunk)."""

    init_sample_size: Optional[int] = None
    """Ids used for the initialisation statistics: None = all V ids, otherwise a fixed-seed uniform
    sample of this many ids (at least 4096) (flag --lev-init-sample-size)."""

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
        """Raise ValueError (one line naming the flag and the fix) for an unusable configuration."""

        def fail(msg: str) -> None:
            raise ValueError(f"LEV config: {msg}")

        if not isinstance(vocab_size, int) or vocab_size < 1:
            fail(f"vocabulary size must be a positive integer (got {vocab_size!r})")
        if hidden_size is not None and (not isinstance(hidden_size, int) or hidden_size < 1):
            fail(f"hidden size must be a positive integer (got {hidden_size!r}); check --hidden-size")
        for flag, value in (
            ("--lev-digits", self.num_digits),
            ("--lev-seed-dim", self.seed_dim),
            ("--lev-rank", self.rank),
            ("--lev-heads", self.num_heads),
            ("--lev-chunk-size", self.chunk_size),
            ("--lev-product-chunk", self.product_chunk),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"{flag} must be a positive integer (got {value!r})")
        if not isinstance(self.num_knots, int) or self.num_knots < 3:
            fail(
                f"--lev-knots must be an integer >= 3 for a quadratic B-spline (got {self.num_knots!r}); "
                "use e.g. --lev-knots 16"
            )
        if self.base is not None:
            if not isinstance(self.base, int) or self.base < 1:
                fail(f"--lev-base must be a positive integer or unset (got {self.base!r})")
            if self.base**self.num_digits < vocab_size:
                need = smallest_base(vocab_size, self.num_digits)
                fail(
                    f"--lev-base {self.base} with --lev-digits {self.num_digits} covers only "
                    f"{self.base ** self.num_digits} ids < vocabulary size {vocab_size}; "
                    f"use --lev-base >= {need}, more --lev-digits, or leave --lev-base unset"
                )
        if not isinstance(tp_size, int) or tp_size < 1:
            fail(f"tensor-parallel size must be a positive integer (got {tp_size!r})")
        if self.num_heads % tp_size != 0:
            fail(
                f"--lev-heads {self.num_heads} is not divisible by the tensor-parallel size {tp_size}; "
                f"choose --lev-heads as a multiple of {tp_size}"
            )
        if self.compute_mode not in COMPUTE_MODES:
            fail(f"--lev-compute-mode must be one of {', '.join(COMPUTE_MODES)} (got {self.compute_mode!r})")
        if self.basis not in BASIS_KINDS:
            fail(f"--lev-basis must be one of {', '.join(BASIS_KINDS)} (got {self.basis!r})")
        if not (0.0 < float(self.log_eps) < 1e-6):
            fail(f"--lev-log-eps must be in (0, 1e-6), far below 1 (got {self.log_eps!r}); default 1e-30")
        if self.init_sample_size is not None:
            if not isinstance(self.init_sample_size, int) or self.init_sample_size < MIN_INIT_SAMPLE_SIZE:
                fail(
                    f"--lev-init-sample-size must be unset (all ids) or >= {MIN_INIT_SAMPLE_SIZE} "
                    f"(got {self.init_sample_size!r})"
                )


def lev_param_count(
    vocab_size: int, hidden_size: int, config: Optional[LEVConfig] = None, base: Optional[int] = None
) -> int:
    """P_LEV = k b d_s + h (d_s^2 + d_s + 2 d_s + d_s kappa r + r D) + D (spec, "Parameter count")."""
    config = config if config is not None else LEVConfig()
    k = config.num_digits
    b = int(base) if base is not None else config.resolved_base(vocab_size)
    ds, kappa, r, h, D = config.seed_dim, config.num_knots, config.rank, config.num_heads, hidden_size
    return k * b * ds + h * (ds * ds + ds + 2 * ds + ds * kappa * r + r * D) + D
