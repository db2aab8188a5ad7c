"""The LEV input embedding as plain torch modules (spec: ``shared/spec/lev.md``).

G(i) = sum_l W_l M_l(i) + c with
  z(i)      = sum_m C_m[i_m]                                  (LEVSeed: k codebooks of b x d_s)
  x_l(i)    = sigmoid(LayerNorm_l(A_l z + a_l))               (LEVHeads.coordinates)
  M_l(i)    = prod_d sum_j Bhat_j(x_{l,d}) S_l[d, j, :]        (functional.separable_product)
  S_l       = 1 + Delta_l.

Design choices (the first four are the spec's, the rest are ours where the paper is silent):
- S is stored as 1 + Delta and Delta is learned, so weight decay pulls every factor towards 1.
- The product over the d_s seed dimensions runs in fp32 (fp64 if the inputs are fp64) in a
  (sign, log-magnitude) form, by a custom autograd function that walks the seed dimensions in chunks of
  ``product_chunk`` and recomputes each chunk's factors in the backward pass: the N x h x d_s x r tensor
  of factors is never held. ids are processed in chunks of ``chunk_size`` for the initialisation
  statistics, materialize() and the table mode.
- Precision on a GPU, chosen from ``bench/lev_precision.py`` (paper defaults, V = 50,304, D = 2048, at
  init; errors in units of rounding G itself to bf16 once): the coordinate GEMM A_l z stays true fp32
  (TF32 inputs would add 0.89 units, for a GEMM of 1/8 of the projection's size), the projection
  sum_l W_l M_l stays true fp32 (TF32 would add 0.26 units; a bf16 GEMM 1.5 where W is a bf16
  parameter already, 2.1 with W rounded too; its FLOPs are about 0.1% of a 1.2B model's), and the
  tensor-parallel reduction of the partial sums is fp32 (bf16 partials would
  add 1.5 units at TP=2; it is one activation-sized all-reduce per micro-batch beside the transformer's
  four per layer). torch's default (no TF32 for fp32 matmuls) is left as it is.
- Each head's LayerNorm normalises over the d_s seed dimensions with eps = 1e-5 (torch's default),
  with its own affine gamma (ones) and beta (zeros).
- W_l is initialised N(0, 0.02^2) and then rescaled per output coordinate: row j of every W_l is
  multiplied by init_method_std / std_j, where std_j is the population standard deviation of coordinate j
  of sum_l W_l M_l over the vocabulary (all V ids, or a fixed-seed sample). This is a linear rescaling of W
  that makes every coordinate's std equal init_method_std exactly (a single global scale would only make
  the average right). Then c = -(vocabulary mean), so G starts centred.
- Random initialisation is reproducible per head: head l (global index) draws its A, Delta and W from
  its own generator seeded by (seed, l), the codebooks from (seed, stream 0). A tensor-parallel layout
  that holds heads p*h/t .. (p+1)*h/t - 1 therefore builds the same initial function for the same seed.
- Parameters of the heads keep the head dimension first, so a TP wrapper can shard them on dim 0.
- LayerNorm parameters, the projection bias and the offset are not weight-decayed; Delta, A, W and the
  codebooks are (``no_weight_decay``). These LayerNorm/bias parameters are 2-D ([h, d_s]), so a
  "1-D means no decay" rule would decay them: use ``no_weight_decay``.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import LEVConfig
from .functional import separable_product, token_digits

__all__ = [
    "LEVSeed",
    "LEVHeads",
    "LEVEmbedding",
    "LN_EPS",
    "NO_WEIGHT_DECAY_PARAMS",
    "no_weight_decay",
    "lev_weight_decay_groups",
    "lev_init_generator",
    "lev_init_sample_ids",
    "lev_init_statistics",
    "lev_init_scale",
    "apply_lev_init",
    "initialize_lev_parameters",
    "check_token_ids",
    "compute_table",
    "table_backward",
    "ComputeModes",
]

LN_EPS = 1e-5
"""LayerNorm eps of each head (the paper is silent; torch's default)."""

CODEBOOK_STD = 0.02
PROJ_STD = 0.02
DELTA_STD = 0.1
OUT_STD = 0.02  # before the vocabulary-statistics rescaling

NO_WEIGHT_DECAY_PARAMS = ("norm_weight", "norm_bias", "proj_bias", "offset")


def no_weight_decay(name: str) -> bool:
    """True for LEV parameters that are not weight-decayed (LayerNorm gamma/beta, the bias a, the offset c)."""
    return name.rsplit(".", 1)[-1] in NO_WEIGHT_DECAY_PARAMS


def lev_weight_decay_groups(module: nn.Module, weight_decay: float) -> List[dict]:
    """Two optimizer param groups for a module holding LEV parameters: decayed and not decayed."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if no_weight_decay(name) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# ----------------------------------------------------------------------------------------------------
# Reproducible random initialisation


def lev_init_generator(seed: int, stream: int) -> torch.Generator:
    """CPU generator for one init stream: 0 = codebooks, 1 + l = head l, -1 = the init id sample."""
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 1_000_003 + int(stream) + 7919) % (2**62))
    return g


def _normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
        param.copy_(values.to(device=param.device, dtype=param.dtype))


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


class LEVSeed(nn.Module):
    """z(i) = sum_m C_m[i_m]: k codebooks of b x d_s held as one parameter ``codebooks`` [k, b, d_s]."""

    def __init__(
        self,
        vocab_size: int,
        config: LEVConfig,
        *,
        base: Optional[int] = None,
        device=None,
        dtype: Optional[torch.dtype] = None,
        initialize: bool = True,
    ):
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.num_digits = int(config.num_digits)
        self.base = int(base) if base is not None else config.resolved_base(vocab_size)
        self.seed_dim = int(config.seed_dim)
        self.codebooks = nn.Parameter(
            torch.empty(self.num_digits, self.base, self.seed_dim, device=device, dtype=dtype)
        )
        if initialize and not _is_meta(self.codebooks):
            self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        """C ~ N(0, 0.02^2) from the codebook stream of ``seed``."""
        _normal_(self.codebooks, CODEBOOK_STD, lev_init_generator(seed, 0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] (in [0, V), unchecked here) -> z [..., d_s], summed in max(fp32, parameter dtype)."""
        powers, offsets = self._digit_constants(ids.device)
        # Row of digit m in the stacked codebooks: i_m + m b (token_digits' digits, constants built once).
        # The ids are flattened first: elementwise ops keep a transposed [s, b] input's strides, which no
        # view to [N, k] could follow (reshape copies the ids only where they are not contiguous).
        flat = torch.div(ids.long().reshape(-1, 1), powers, rounding_mode="floor").remainder_(self.base).add_(offsets)
        table = self.codebooks.view(self.num_digits * self.base, self.seed_dim)
        if table.dtype in (torch.float32, torch.float64):
            # Gather and sum in one op (forward and backward); its sum is in the table's dtype.
            z = F.embedding_bag(flat, table, mode="sum")
        else:
            z = F.embedding(flat, table).sum(dim=-2, dtype=torch.float32)
        return z.view(*ids.shape, self.seed_dim)

    def _digit_constants(self, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(b^(k-1-m), m b) for m < k on ``device``, built on the first call there (no per-call launches)."""
        cached = self.__dict__.get("_digit_cache")
        if cached is None or cached[0].device != device:
            k, b = self.num_digits, self.base
            # Built by kernels on the device (a copy of host data would be a host sync).
            m = torch.arange(k, dtype=torch.long, device=device)
            cached = (torch.pow(b, (k - 1) - m), m * b)
            self.__dict__["_digit_cache"] = cached
        return cached


class LEVHeads(nn.Module):
    """h heads (all of them, or a tensor-parallel shard): z [N, d_s] -> partial sum_l W_l M_l, [N, D].

    ``head_offset`` is the global index of the first local head; it only selects the init streams.
    No offset c here: it is added once, after the sum over all heads.
    """

    def __init__(
        self,
        config: LEVConfig,
        hidden_size: int,
        num_heads: Optional[int] = None,
        *,
        head_offset: int = 0,
        device=None,
        dtype: Optional[torch.dtype] = None,
        initialize: bool = True,
    ):
        super().__init__()
        self.config = config
        self.hidden_size = int(hidden_size)
        self.num_heads = int(num_heads if num_heads is not None else config.num_heads)
        self.head_offset = int(head_offset)
        h, ds, kappa, r, D = self.num_heads, config.seed_dim, config.num_knots, config.rank, self.hidden_size
        kw = dict(device=device, dtype=dtype)
        self.proj_weight = nn.Parameter(torch.empty(h, ds, ds, **kw))  # A_l (out, in)
        self.proj_bias = nn.Parameter(torch.empty(h, ds, **kw))  # a_l
        self.norm_weight = nn.Parameter(torch.empty(h, ds, **kw))  # LayerNorm gamma
        self.norm_bias = nn.Parameter(torch.empty(h, ds, **kw))  # LayerNorm beta
        self.delta = nn.Parameter(torch.empty(h, ds, kappa, r, **kw))  # Delta_l, S_l = 1 + Delta_l
        self.out_weight = nn.Parameter(torch.empty(h, D, r, **kw))  # W_l
        if initialize and not _is_meta(self.delta):
            self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        """A ~ N(0, 0.02^2), a = 0, gamma = 1, beta = 0, Delta ~ N(0, 0.1^2), W ~ N(0, 0.02^2) per head."""
        with torch.no_grad():
            self.proj_bias.zero_()
            self.norm_weight.fill_(1.0)
            self.norm_bias.zero_()
            for i in range(self.num_heads):
                g = lev_init_generator(seed, 1 + self.head_offset + i)
                _normal_(self.proj_weight[i], PROJ_STD, g)
                _normal_(self.delta[i], DELTA_STD, g)
                _normal_(self.out_weight[i], OUT_STD, g)

    def coordinates(self, z: torch.Tensor) -> torch.Tensor:
        """x = sigmoid(LayerNorm_l(A_l z + a_l)): z [N, d_s] -> x [N, h, d_s] in (0, 1).

        Computed in max(fp32, parameter dtype): x feeds the spline basis and a product over d_s factors,
        where bf16 rounding of x would be amplified (the cost, N h d_s^2, is small).
        """
        dt = torch.promote_types(self.proj_weight.dtype, torch.float32)
        h, ds = self.num_heads, self.config.seed_dim
        # All heads' projections as one GEMM with the bias (rows h*ds of A stacked), and each head's
        # LayerNorm with its own gamma, beta as a group norm with h groups of d_s channels: 2 ops, not 6.
        y = torch.addmm(self.proj_bias.to(dt).view(h * ds), z.to(dt), self.proj_weight.to(dt).view(h * ds, ds).t())
        y = F.group_norm(y, h, self.norm_weight.to(dt).view(h * ds), self.norm_bias.to(dt).view(h * ds), eps=LN_EPS)
        return torch.sigmoid(y).view(-1, h, ds)

    def modes(self, z: torch.Tensor) -> torch.Tensor:
        """M [N, h, r] (fp32, or fp64 for fp64 parameters)."""
        cfg = self.config
        x = self.coordinates(z)
        return separable_product(
            x,
            self.delta,
            cfg.num_knots,
            basis=cfg.resolved_basis(x.device.type),
            product_chunk=cfg.product_chunk,
            log_eps=cfg.log_eps,
        )

    def forward(self, z: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """z [..., d_s] -> sum over these heads of W_l M_l (plus ``bias`` [D], added in the same GEMM),
        [..., D], in max(fp32, parameter dtype).

        The projection and the sum over heads stay in at least fp32: the offset c added afterwards
        nearly cancels the vocabulary mean of this sum, so rounding it to bf16 first would cost about
        ten times a bf16 rounding of G itself. The caller rounds G once, after adding c.
        """
        lead = z.shape[:-1]
        m = self.modes(z.reshape(-1, z.shape[-1]))
        h, r = m.shape[1:]
        # One GEMM over (head, mode) pairs: W as [D, h r] (a copy of W, D h r elements, far below N D).
        w = self.out_weight.to(m.dtype).permute(1, 0, 2).reshape(self.hidden_size, h * r)
        out = F.linear(m.view(-1, h * r), w, None if bias is None else bias.to(m.dtype))
        return out.view(*lead, self.hidden_size)


# ----------------------------------------------------------------------------------------------------
# Initialisation statistics (reusable by a tensor-parallel wrapper)


def lev_init_sample_ids(vocab_size: int, sample_size: Optional[int], seed: int = 0) -> Optional[torch.Tensor]:
    """The ids used for the init statistics: None (= all V ids) or a sorted fixed-seed uniform sample."""
    if sample_size is None or sample_size >= vocab_size:
        return None
    perm = torch.randperm(vocab_size, generator=lev_init_generator(seed, -1))
    return perm[:sample_size].sort().values


def _id_chunks(vocab_size: int, chunk_size: int, ids: Optional[torch.Tensor], device) -> Iterable[torch.Tensor]:
    if ids is None:
        for start in range(0, vocab_size, chunk_size):
            yield torch.arange(start, min(vocab_size, start + chunk_size), device=device)
    else:
        ids = ids.to(device)
        for start in range(0, ids.numel(), chunk_size):
            yield ids[start : start + chunk_size]


@torch.no_grad()
def lev_init_statistics(
    seed_module: nn.Module,
    heads_module: nn.Module,
    vocab_size: int,
    chunk_size: int,
    sample_ids: Optional[torch.Tensor] = None,
    reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Raw sums over the vocabulary of the pre-offset output y = sum_l W_l M_l: (sum y, sum y^2, count).

    Sums are per coordinate, [D], in fp64. ``reduce_fn`` is applied to each chunk's partial output
    [chunk, D] before accumulating: a tensor-parallel wrapper passes an all-reduce over its TP group so the
    statistics are those of the full sum over all heads (every rank then holds the same sums).
    """
    device = heads_module.out_weight.device
    sum_x = torch.zeros(heads_module.hidden_size, dtype=torch.float64, device=device)
    sum_x2 = torch.zeros_like(sum_x)
    count = 0
    for ids in _id_chunks(vocab_size, chunk_size, sample_ids, device):
        y = heads_module(seed_module(ids))
        if reduce_fn is not None:
            y = reduce_fn(y)
        y = y.double()
        sum_x += y.sum(dim=0)
        sum_x2 += (y * y).sum(dim=0)
        count += ids.numel()
    return sum_x, sum_x2, count


def lev_init_scale(
    sum_x: torch.Tensor, sum_x2: torch.Tensor, count: int, init_method_std: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale [D], mean [D]) from the raw sums: scale_j = init_method_std / std_j (population std)."""
    mean = sum_x / count
    var = (sum_x2 / count - mean * mean).clamp_min(0.0)
    std = var.sqrt()
    scale = torch.where(std > 0, init_method_std / std.clamp_min(1e-300), torch.ones_like(std))
    return scale, mean


@torch.no_grad()
def apply_lev_init(heads_module: nn.Module, scale) -> None:
    """Multiply W (out_weight [h, D, r]) by ``scale``: a float, or [D] per output coordinate (rows of W_l)."""
    w = heads_module.out_weight
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=w.device, dtype=torch.float64).view(1, -1, 1)
        w.copy_((w.double() * scale).to(w.dtype))
    else:
        w.mul_(float(scale))


@torch.no_grad()
def initialize_lev_parameters(
    seed_module: nn.Module,
    heads_module: nn.Module,
    offset: Optional[torch.Tensor],
    vocab_size: int,
    config: LEVConfig,
    init_method_std: float,
    *,
    init_seed: int = 0,
    statistics: bool = True,
    reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> None:
    """The whole initialisation of one LEV layer (or of one tensor-parallel shard of its heads), in place.

    Random draws from the per-stream generators of ``init_seed``, c = 0, then (``statistics``) W rescaled
    and c set from the vocabulary statistics, computed on the parameters' device. Low-precision (bf16,
    fp16) parameters are initialised through fp32 copies and rounded once, as megatron-core initialises
    its own low-precision weights: the result is exactly the fp32 initialisation cast to that dtype.
    """
    low = heads_module.out_weight.dtype not in (torch.float32, torch.float64)
    seed_w, heads_w, offset_w = seed_module, heads_module, offset
    if low:
        seed_w = copy.deepcopy(seed_module).float()
        heads_w = copy.deepcopy(heads_module).float()
        offset_w = None if offset is None else torch.zeros_like(offset, dtype=torch.float32)
    seed_w.reset_parameters(init_seed)
    heads_w.reset_parameters(init_seed)
    if offset_w is not None:
        offset_w.zero_()
    if statistics:
        sample = lev_init_sample_ids(vocab_size, config.init_sample_size, init_seed)
        sums = lev_init_statistics(seed_w, heads_w, vocab_size, config.chunk_size, sample, reduce_fn)
        scale, mean = lev_init_scale(*sums, init_method_std)
        apply_lev_init(heads_w, scale)
        if offset_w is not None:
            offset_w.copy_((-(scale * mean)).to(device=offset_w.device, dtype=offset_w.dtype))
    if low:
        for dst, src in zip(list(seed_module.parameters()) + list(heads_module.parameters()),
                            list(seed_w.parameters()) + list(heads_w.parameters())):
            dst.copy_(src)
        if offset is not None:
            offset.copy_(offset_w)


# ----------------------------------------------------------------------------------------------------
# Id checks and the table mode (reusable by a tensor-parallel wrapper)


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Reject ids outside [0, vocab_size) (never clamps).

    On the CPU: a ValueError naming the id. On an accelerator the check is an asynchronous device
    assert (no host sync in the forward pass); the data pipeline checks the largest id of every dataset
    against the vocabulary at start-up, so this only guards against a corrupted batch.
    """
    if ids.numel() == 0:
        return
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"LEV embedding: token ids must be an integer tensor, got {ids.dtype}")
    if ids.device.type != "cpu":
        torch._assert_async(
            ((ids >= 0) & (ids < vocab_size)).all(),
            f"LEV embedding: a token id lies outside [0, {vocab_size}); check the tokenizer and the padded "
            "vocabulary size",
        )
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"LEV embedding: token id {bad} outside [0, {vocab_size}) (vocabulary size {vocab_size}); "
            "check the tokenizer and the padded vocabulary size"
        )


@torch.no_grad()
def compute_table(
    compute_fn: Callable[[torch.Tensor], torch.Tensor], vocab_size: int, chunk_size: int, device
) -> torch.Tensor:
    """G over all V ids, [V, D], in chunks of ``chunk_size`` ids, without autograd."""
    parts = [compute_fn(ids) for ids in _id_chunks(vocab_size, chunk_size, None, device)]
    return torch.cat(parts, dim=0)


def table_backward(
    compute_fn: Callable[[torch.Tensor], torch.Tensor],
    table_grad: Optional[torch.Tensor],
    chunk_size: int,
    params: Sequence[torch.Tensor],
    rows: Optional[torch.Tensor] = None,
) -> None:
    """Push accumulated row gradients [V, D] back through G into ``params`` (the parameters of G).

    For each chunk of rows, G is recomputed with autograd and the chunk's gradient with respect to
    ``params`` is accumulated (in at least fp32); then the sums are delivered to the parameters in ONE
    backward call. So every parameter's gradient hooks fire exactly once per optimizer step, whatever
    the number of chunks: megatron DDP with ``overlap_grad_reduce`` counts those hooks to decide when a
    bucket is complete. ``table_grad`` None (no row used) delivers zeros, keeping that count fixed.

    ``rows`` defaults to the rows whose gradient is not all zero (the ids that occurred). A wrapper whose
    ranks must run the same collectives passes the same ``rows`` on every rank. A parameter with a
    megatron ``main_grad`` gets the fp32 sum added there directly (see the delivery below).
    """
    params = [p for p in params if p.requires_grad]
    sums: List[Optional[torch.Tensor]] = [None] * len(params)
    if table_grad is not None:
        if rows is None:
            rows = (table_grad != 0).any(dim=-1).nonzero().squeeze(-1)
        rows = rows.to(table_grad.device)
        for start in range(0, rows.numel(), chunk_size):
            ids = rows[start : start + chunk_size]
            with torch.enable_grad():
                out = compute_fn(ids)
                grads = torch.autograd.grad(out, params, table_grad[ids].to(out.dtype), allow_unused=True)
            for i, g in enumerate(grads):
                if g is None:
                    continue
                g = g.to(torch.promote_types(g.dtype, torch.float32))
                sums[i] = g if sums[i] is None else sums[i].add_(g)
    grads = []
    for p, s in zip(params, sums):
        main = getattr(p, "main_grad", None)
        if s is not None and main is not None:
            # megatron DDP: the step's fp32 sum goes straight into the main grad, not through a
            # param.grad rounded to a bf16 parameter's dtype (as megatron's gradient-accumulation fusion
            # does for its weights); the hook still fires on the zeros below and skips its own add.
            main.add_(s)
            p.grad_added_to_main_grad = True
            s = None
        grads.append(torch.zeros_like(p) if s is None else s.to(p.dtype))
    with torch.enable_grad():
        # view_as keeps each parameter's own AccumulateGrad node (and the hooks on it) as the target.
        torch.autograd.backward([p.view_as(p) for p in params], grads)


class ComputeModes:
    """The compute modes of one LEV layer: the one implementation behind the pure layer and its
    tensor-parallel wrapper.

    The layer passes its function F to every call (``fn(ids [N]) -> [N, D]``, with autograd): the pure
    ``LEVEmbedding`` passes G itself, ``LEVParallelEmbedding`` the partial sum of its shard of heads, which
    it then reduces over the tensor-parallel group. So this object holds no module and does no
    communication; F does whatever its layer needs (the wrapper's F routes the seed through its
    tensor-parallel copy, whose backward all-reduces the codebook gradient).

    ``__call__`` checks the ids and evaluates F at each of them in ``config.compute_mode``:
    - "token": F at every position;
    - "unique": F once per distinct id, gathered with the inverse index;
    - "table": rows of a table of F over all V ids, evaluated once per optimizer step. The first call with
      grad enabled starts the step (``begin``). ``begin`` evaluates F over all ids (no autograd) into a
      table held in at least fp32; the micro-batches' row gradients are added (``index_add_``, rows seen
      only) into one fp32 buffer ``table_grad`` as megatron accumulates main grads, so no V x D gradient
      is built per micro-batch; rows are returned in F's own dtype. ``finish`` pushes
      the rows' gradients back through F once (``table_backward``: one gradient delivery per parameter,
      as megatron DDP's overlapped grad reduce expects) and frees the table. The rows pushed back are the
      ids seen, so tensor-parallel ranks that saw the same batch run the same chunks (and collectives).
      Without grad and without a table (evaluation), F is evaluated as in "unique" and no table is built.
      Memory while a table is active: V x D x 4 bytes for the table and as much for its gradient.
    """

    def __init__(self, vocab_size: int, config: LEVConfig):
        self.vocab_size = int(vocab_size)
        self.config = config
        self.table: Optional[torch.Tensor] = None
        self.table_grad: Optional[torch.Tensor] = None
        """The step's accumulated gradient of the table rows (fp32, V x D) while a table is active."""
        self._seen: Optional[torch.Tensor] = None
        self._anchor: Optional[torch.Tensor] = None
        self._dtype: Optional[torch.dtype] = None

    @property
    def active(self) -> bool:
        return self.table is not None

    def __call__(self, ids: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], device) -> torch.Tensor:
        """F at every id of ``ids`` (any shape) as [ids.numel(), D] rows; ``device`` holds a new table."""
        check_token_ids(ids, self.vocab_size)
        flat = ids.reshape(-1)
        mode = self.config.compute_mode
        if mode == "table" and (self.active or torch.is_grad_enabled()):
            if not self.active:
                self.begin(fn, device)  # first micro-batch of the step
            return self.lookup(flat)
        if mode == "token":
            return fn(flat)
        # "unique", and "table" outside training (no grad, no table)
        # One host sync per forward: the number of distinct ids sizes F's evaluation.
        uniq, inverse = torch.unique(flat, return_inverse=True)
        return F.embedding(inverse, fn(uniq))

    @torch.no_grad()
    def begin(self, fn: Callable[[torch.Tensor], torch.Tensor], device) -> torch.Tensor:
        """Evaluate F over all V ids into a fresh table (at least fp32) and its zeroed gradient; return it."""
        table = compute_table(fn, self.vocab_size, self.config.chunk_size, device)
        self._dtype = table.dtype
        self.table = table.to(torch.promote_types(table.dtype, torch.float32))
        self.table_grad = torch.zeros_like(self.table)
        self._seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=table.device)
        # An input that requires grad, so that autograd runs _TableRows.backward.
        self._anchor = torch.zeros((), device=table.device, requires_grad=True)
        return self.table

    def lookup(self, flat_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table at ``flat_ids`` (F's dtype); their gradient is added into ``table_grad``.

        The ids are numbered by group of equal ids (a sort; no host sync): the rows of the N groups are
        gathered and expanded with F.embedding, whose backward sums the gradient of each group into an
        N x D tensor (deterministic), and those N rows are added into ``table_grad`` with distinct
        indices. The extra memory is N x D per micro-batch, never V x D.
        """
        # index_fill_ with a Python scalar: ``seen[ids] = True`` would copy a CPU scalar tensor to the
        # device and synchronise on every micro-batch.
        self._seen.index_fill_(0, flat_ids, True)
        sorted_ids, order = torch.sort(flat_ids)
        starts = torch.ones_like(sorted_ids, dtype=torch.bool)
        starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
        group_sorted = torch.cumsum(starts, 0) - 1
        group = torch.empty_like(group_sorted).scatter_(0, order, group_sorted)
        # Groups past the last one keep a placeholder id and receive a zero gradient (adding 0 changes no
        # value); spread over distinct rows so that their adds do not all contend for one row.
        placeholder = torch.arange(sorted_ids.numel(), device=sorted_ids.device) % self.vocab_size
        group_ids = placeholder.scatter_(0, group_sorted, sorted_ids)
        rows = _TableRows.apply(self._anchor, self.table, self.table_grad, group_ids)
        return F.embedding(group, rows).to(self._dtype)

    def finish(self, fn: Callable[[torch.Tensor], torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """Push the table's accumulated gradient back through F into ``params``, then free the table."""
        table_grad, seen = self.table_grad, self._seen
        active = self.table is not None
        self.table = self.table_grad = self._seen = self._anchor = None
        if not active:
            return
        # One host sync per step: the ids seen decide how many chunks go back through F.
        rows = torch.nonzero(seen, as_tuple=False).squeeze(1)
        table_backward(fn, table_grad, self.config.chunk_size, params, rows=rows)


class _TableRows(torch.autograd.Function):
    """table[ids] forward; backward adds the rows' gradient into the step's ``table_grad`` buffer.

    ``ids`` are distinct except for placeholder groups whose gradient is zero, so ``index_add_`` sums no
    two non-zero rows into one (its result does not depend on the order of atomic adds)."""

    @staticmethod
    def forward(ctx, anchor, table, table_grad, ids):
        ctx.table_grad = table_grad
        ctx.save_for_backward(ids)
        return table.index_select(0, ids)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        (ids,) = ctx.saved_tensors
        ctx.table_grad.index_add_(0, ids, grad_rows.to(ctx.table_grad.dtype))
        return None, None, None, None


# ----------------------------------------------------------------------------------------------------


class LEVEmbedding(nn.Module):
    """G: ids [...] -> [..., D] (tensor-parallel size 1): codebooks seed + all h heads + offset c.

    ``init_statistics=False`` skips the vocabulary statistics (W stays N(0, 0.02^2), c = 0): for
    parameter counting, or when a checkpoint is loaded right after; ``initialize=False`` skips the whole
    initialisation (parameters allocated only). Built on the meta device, nothing is initialised.
    ``device`` and ``dtype`` place the parameters; bf16/fp16 parameters are initialised in fp32 and
    rounded once, and the separable product always runs in at least fp32.

    Compute modes (config.compute_mode), all with the same values and gradients: "token", "unique" and
    "table" (``ComputeModes``, with F = G). In "table" mode the first forward with grad enabled starts
    the step (``begin_table_step()`` may be called explicitly instead), and ``finish_table_step()`` after
    the last backward, before the optimizer step, pushes the accumulated row gradients through G and
    frees the table.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        config: Optional[LEVConfig] = None,
        *,
        init_method_std: float = 0.02,
        init_seed: int = 0,
        init_statistics: bool = True,
        initialize: bool = True,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.config = config if config is not None else LEVConfig()
        self.config.validate(vocab_size, hidden_size)
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)
        self.init_method_std = float(init_method_std)
        self.init_seed = int(init_seed)
        self.base = self.config.resolved_base(vocab_size)
        kw = dict(device=device, dtype=dtype, initialize=False)
        self.seed = LEVSeed(vocab_size, self.config, base=self.base, **kw)
        self.heads = LEVHeads(self.config, hidden_size, self.config.num_heads, **kw)
        self.offset = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))  # c
        self._modes = ComputeModes(self.vocab_size, self.config)
        if initialize and not _is_meta(self.offset):
            self.reset_parameters(init_statistics=init_statistics)

    def reset_parameters(self, init_statistics: bool = True) -> None:
        initialize_lev_parameters(
            self.seed, self.heads, self.offset, self.vocab_size, self.config, self.init_method_std,
            init_seed=self.init_seed, statistics=init_statistics,
        )

    def compute(self, ids: torch.Tensor) -> torch.Tensor:
        """G for a flat tensor of (valid) ids, [N] -> [N, D], with autograd, in the parameters' dtype
        (rounded once, after the offset is added)."""
        return self.heads(self.seed(ids), bias=self.offset).to(self.offset.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._modes(ids, self.compute, self.offset.device).view(*ids.shape, self.hidden_size)

    @torch.no_grad()
    def materialize(self) -> torch.Tensor:
        """The dense [V, D] table of the current G (for inference / export)."""
        return compute_table(self.compute, self.vocab_size, self.config.chunk_size, self.offset.device)

    # table mode ---------------------------------------------------------------------------------------
    @property
    def table(self) -> Optional[torch.Tensor]:
        """The active [V, D] table (a leaf with requires_grad) between begin/finish_table_step, else None."""
        return self._modes.table

    def begin_table_step(self) -> torch.Tensor:
        """Evaluate G over all V ids into a fresh leaf table; micro-batch gradients accumulate in its .grad."""
        return self._modes.begin(self.compute, self.offset.device)

    def finish_table_step(self) -> None:
        """Push the table's accumulated gradient back through G (ids that occurred), then free the table."""
        self._modes.finish(self.compute, list(self.parameters()))
