"""Dense -> LEV: fit a LEV layer to a trained input table, and write a checkpoint whose input arm is lev.

The fit (:func:`fit_lev`) minimises the (optionally frequency-weighted) relative squared error

    err = sum_i w_i ||G(i) - E[i]||^2 / sum_i w_i ||E[i]||^2

over the LEV parameters of :class:`megatron_lev.lev.LEVEmbedding`, initialised as the spec says
(codebooks, projections and Delta drawn from the init streams of ``seed``; W rescaled so each
coordinate of G has the model's ``init_method_std`` over the vocabulary; c centring G). Choices of
ours (the paper does not convert tables):

- Weights: uniform without token counts; with counts, w_i = (count_i + 1) ** ``count_power``
  (1 = the token distribution of the counts, add-one so unseen ids still count; 0 = uniform).
- Optimiser: Adam on mini-batches of ``batch_size`` ids drawn with probability proportional to w
  (all ids, in order, when the batch covers the vocabulary and the weights are uniform), learning
  rate ``lr`` with a cosine decay to ``lr/10`` over ``max_steps``.
- Stopping rule: every ``eval_interval`` steps the error over the whole table is measured; the fit
  stops when it is below ``target_error``, when it has not improved by a relative ``min_improvement``
  for ``patience`` evaluations, or after ``max_steps``. The best parameters seen are kept.

The report (:class:`FitReport`) gives the error overall and per frequency bucket (the paper's edges,
:data:`megatron_lev.evaluation.PAPER_EDGES`, when counts are given), the parameter counts and the time.

:func:`to_lev` does the checkpoint side: the source (tied or untied arm, any layout) is read on one
CPU process at TP=1, its input table fitted (CPU or GPU), and a checkpoint with ``--input-embedding
lev`` written at the source's layout, carrying every other weight; the output head is the source's
(a tied source's table becomes the untied head). Iteration, consumed samples and scheduler state are
kept; there is no optimizer state (Adam starts afresh).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from megatron_lev.distributed import set_seed
from megatron_lev.kernels import register_default_kernels
from megatron_lev.lev import ConfigError, LEVConfig, LEVEmbedding, lev_param_count
from megatron_lev.models.arms import find_arm

from .source import ConversionError, disk_full_is_one_line, open_checkpoint, save_target, saved_config


@dataclass
class FitConfig:
    """How the LEV layer is fitted to a table (see the module docstring)."""

    lr: float = 3e-3
    """Peak Adam learning rate (cosine decay to lr/10 over max_steps)."""
    batch_size: int = 4096
    """Ids per optimisation step."""
    max_steps: int = 2000
    """Upper bound on optimisation steps."""
    eval_interval: int = 50
    """Steps between measurements of the error over the whole table (the stopping rule's clock)."""
    patience: int = 4
    """Stop after this many measurements without a relative improvement of min_improvement."""
    min_improvement: float = 0.01
    """Relative decrease of the error that counts as an improvement."""
    target_error: float = 0.0
    """Stop as soon as the relative error is at most this (0: never)."""
    count_power: float = 1.0
    """Weights w_i = (count_i + 1) ** count_power when token counts are given."""
    seed: int = 0
    """Seed of the LEV initialisation and of the id sampling."""
    device: str = "cpu"
    """Where to fit: "cpu", "cuda" or "cuda:N"."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def validate(self) -> None:
        for name in ("batch_size", "max_steps", "eval_interval", "patience"):
            if int(getattr(self, name)) < 1:
                raise ConversionError(f"--fit-{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if not self.lr > 0:
            raise ConversionError(f"--fit-lr must be > 0 (got {self.lr})")
        if self.count_power < 0:
            raise ConversionError(f"--count-power must be >= 0 (got {self.count_power})")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConversionError(f"--device {self.device}: CUDA is not available on this machine; use --device cpu")


@dataclass
class FitReport:
    """What the fit achieved."""

    relative_error: float
    """sum ||G - E||^2 / sum ||E||^2 over all ids (unweighted)."""
    weighted_relative_error: Optional[float]
    """The same with the fit's weights (None without token counts)."""
    initial_relative_error: float
    """The unweighted error of the spec's initialisation."""
    buckets: List[Dict[str, Any]]
    """Per frequency bucket: label, ids, relative error (empty without token counts)."""
    lev_params: int
    table_params: int
    steps: int
    seconds: float
    stopped_because: str
    history: List[Dict[str, float]] = field(default_factory=list)
    """(step, relative error, weighted relative error) at each measurement."""

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def format(self) -> str:
        lines = [f"LEV fit: relative error {self.relative_error:.4f} (initialisation {self.initial_relative_error:.4f})"
                 + (f", frequency-weighted {self.weighted_relative_error:.4f}"
                    if self.weighted_relative_error is not None else ""),
                 f"  parameters: LEV {self.lev_params:,} vs table {self.table_params:,} "
                 f"({self.lev_params / self.table_params:.2%}); {self.steps} steps in {self.seconds:.1f} s "
                 f"(stopped: {self.stopped_because})"]
        for b in self.buckets:
            err = "-" if b["relative_error"] is None else f"{b['relative_error']:.4f}"
            lines.append(f"  bucket {b['bucket']:>16}: {b['vocab_ids']:>7} ids, relative error {err}")
        return "\n".join(lines)


def fit_weights(counts: Optional[np.ndarray], vocab_size: int, count_power: float) -> Optional[torch.Tensor]:
    """Per-id weights [V] (fp64) from token counts, or None (uniform). Counts shorter than V (the
    tokenizer's ids without Megatron's padding) are extended with zeros; longer ones are refused."""
    if counts is None:
        return None
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    if counts.size > vocab_size:
        raise ConversionError(f"--token-counts has {counts.size} entries but the table only {vocab_size} rows")
    if (counts < 0).any() or not np.isfinite(counts).all():
        raise ConversionError("--token-counts: counts must be finite and >= 0")
    full = np.zeros(vocab_size, dtype=np.float64)
    full[: counts.size] = counts
    return torch.from_numpy((full + 1.0) ** float(count_power))


@torch.no_grad()
def _row_errors(emb: LEVEmbedding, table: torch.Tensor, chunk: int) -> torch.Tensor:
    """||G(i) - E[i]||^2 for every id, [V] fp64."""
    out = []
    for start in range(0, table.shape[0], chunk):
        ids = torch.arange(start, min(table.shape[0], start + chunk), device=table.device)
        out.append((emb.compute(ids).double() - table[ids].double()).pow(2).sum(-1))
    return torch.cat(out)


def bucket_errors(row_err: torch.Tensor, row_norm: torch.Tensor, counts: np.ndarray,
                  edges=None) -> List[Dict[str, Any]]:
    """Relative error per frequency bucket of the ids (relative frequency from ``counts``)."""
    from megatron_lev.evaluation.perplexity import PAPER_EDGES, bucket_labels, relative_frequencies

    edges = tuple(edges or PAPER_EDGES)
    freq = relative_frequencies(counts, row_err.numel())
    bucket = np.searchsorted(np.asarray(edges), freq, side="right")
    err, norm = row_err.cpu().numpy(), row_norm.cpu().numpy()
    out = []
    for b, label in enumerate(bucket_labels(edges)):
        sel = bucket == b
        den = float(norm[sel].sum())
        out.append({"bucket": label, "vocab_ids": int(sel.sum()),
                    "relative_error": float(err[sel].sum()) / den if sel.any() and den > 0 else None})
    return out


def fit_lev(table: torch.Tensor, lev_config: LEVConfig, *, init_method_std: float = 0.02,
            counts: Optional[np.ndarray] = None, fit: Optional[FitConfig] = None):
    """Fit a :class:`LEVEmbedding` (TP=1, fp32) to ``table`` [V, D]; return ``(embedding, FitReport)``."""
    from tqdm.auto import tqdm

    fit = fit or FitConfig()
    fit.validate()
    if table.dim() != 2:
        raise ConversionError(f"the input table must be [V, D], got shape {list(table.shape)}")
    V, D = table.shape
    try:
        lev_config.validate(int(V), int(D))
    except ValueError as e:
        raise ConversionError(str(e)) from None
    register_default_kernels()  # so basis "auto" (and "triton") finds the fused kernels on fit.device
    device = torch.device(fit.device)
    t0 = time.time()
    target = table.detach().to(device=device, dtype=torch.float32)
    emb = LEVEmbedding(int(V), int(D), dataclasses.replace(lev_config), init_method_std=init_method_std,
                       init_seed=fit.seed, device=device, dtype=torch.float32)
    weights = fit_weights(counts, int(V), fit.count_power)
    w_dev = None if weights is None else weights.to(device)
    row_norm = target.double().pow(2).sum(-1)
    den = float(row_norm.sum())
    wden = None if w_dev is None else float((w_dev * row_norm).sum())
    chunk = int(lev_config.chunk_size)

    def measure():
        r = _row_errors(emb, target, chunk)
        return r, float(r.sum()) / den, (None if w_dev is None else float((w_dev * r).sum()) / wden)

    _, err0, werr0 = measure()
    best = (werr0 if werr0 is not None else err0)
    best_state = {k: v.detach().clone() for k, v in emb.state_dict().items()}
    history = [{"step": 0, "relative_error": err0, "weighted_relative_error": werr0}]
    opt = torch.optim.Adam(emb.parameters(), lr=fit.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, fit.max_steps) / fit.max_steps)))
    gen = torch.Generator(device="cpu").manual_seed(int(fit.seed) + 1)
    probs = None if weights is None else (weights / weights.sum()).float()
    full_batch = probs is None and fit.batch_size >= V
    scale = den / V  # mean ||E_i||^2: the loss is a relative error
    stale, stopped, step = 0, "max_steps", 0
    bar = tqdm(total=fit.max_steps, desc="fitting LEV", unit="step", disable=not fit.progress)
    for step in range(1, fit.max_steps + 1):
        if full_batch:
            ids = torch.arange(V, device=device)
        elif probs is None:
            ids = torch.randint(0, V, (fit.batch_size,), generator=gen).to(device)
        else:
            ids = torch.multinomial(probs, fit.batch_size, replacement=True, generator=gen).to(device)
        loss = (emb.compute(ids) - target[ids]).pow(2).sum(-1).mean() / scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.update(1)
        if step % fit.eval_interval == 0 or step == fit.max_steps:
            _, err, werr = measure()
            cur = werr if werr is not None else err
            history.append({"step": step, "relative_error": err, "weighted_relative_error": werr})
            bar.set_postfix(rel_err=f"{cur:.4f}")
            if cur < best * (1 - fit.min_improvement):
                stale = 0
            else:
                stale += 1
            if cur < best:
                best = cur
                best_state = {k: v.detach().clone() for k, v in emb.state_dict().items()}
            if best <= fit.target_error:
                stopped = f"relative error <= target {fit.target_error}"
                break
            if stale >= fit.patience:
                stopped = f"no {fit.min_improvement:.0%} improvement in {fit.patience} measurements"
                break
    bar.close()
    emb.load_state_dict(best_state)
    rows, err, werr = measure()
    buckets = [] if counts is None else bucket_errors(rows, row_norm, np.asarray(counts))
    report = FitReport(relative_error=err, weighted_relative_error=werr, initial_relative_error=err0,
                       buckets=buckets, lev_params=sum(p.numel() for p in emb.parameters()),
                       table_params=int(V) * int(D), steps=step, seconds=time.time() - t0,
                       stopped_because=stopped, history=history)
    assert report.lev_params == lev_param_count(int(V), int(D), emb.config)
    return emb, report


# -------------------------------------------------------------------------------- checkpoint side


def lev_config_for(a: Dict[str, Any], overrides: Dict[str, Any]) -> LEVConfig:
    """The LEV config of the converted model: the source's saved ``--lev-*`` values, then ``overrides``
    (LEVConfig field -> value; None = keep)."""
    unknown = set(overrides) - {f.name for f in dataclasses.fields(LEVConfig)}
    if unknown:
        raise ConversionError(f"unknown LEV setting {sorted(unknown)[0]!r}")
    return dataclasses.replace(LEVConfig.from_args(a), **{k: v for k, v in overrides.items() if v is not None})


def _read_table_rank(src_path: str, a: Dict[str, Any], out_file: str) -> Dict[str, Any]:
    """Load the dense model at TP=1 and write its input table to ``out_file`` (safetensors)."""
    from safetensors.torch import save_file

    from megatron_lev.models import materialize_input_embedding

    from .model_io import build_model, load_model_weights

    chunks, _c, _m = build_model(a)
    load_model_weights(chunks, src_path)
    table = materialize_input_embedding(chunks[0]).float().contiguous()
    save_file({"table": table}, out_file)
    return {"shape": list(table.shape)}


def _write_lev_rank(src_path: str, src_a: Dict[str, Any], dst: str, iteration: int, a: Dict[str, Any],
                    common: Dict[str, Any], lev_file: str, progress: bool) -> Dict[str, Any]:
    """Build the dense source and the lev model at TP=1, carry every weight but the input table, put the
    fitted LEV parameters in the arm and save the lev checkpoint."""
    from safetensors.torch import load_file

    from megatron_lev.models import lev_modules

    from .model_io import build_model, load_model_weights, save_model_checkpoint

    set_seed(saved_config(a).run.seed)
    src_chunks, _c, _m = build_model(src_a)
    load_model_weights(src_chunks, src_path)
    src = src_chunks[0].state_dict()
    chunks, _c, _m = build_model(a)
    model = chunks[0]
    lev = list(lev_modules(model))[0]
    fitted = load_file(lev_file)
    own = {k: v for k, v in lev.state_dict().items() if not k.endswith("_extra_state")}
    if set(own) != set(fitted):
        raise ConversionError(f"the fitted LEV parameters do not match the lev arm ({sorted(set(own) ^ set(fitted))[0]})")
    head = src.get("output_layer.weight")
    if head is None:  # tied source: its table is the output head
        head = src["embedding.word_embeddings.weight"]
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(fitted[k].to(v.dtype))
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or k.endswith("_extra_state") or k.startswith("embedding."):
                continue
            w = head if k == "output_layer.weight" else src.get(k)
            if w is None or tuple(w.shape) != tuple(v.shape):
                raise ConversionError(f"the dense checkpoint has no tensor {k} of shape {list(v.shape)}")
            v.copy_(w.to(v.dtype))
    save_model_checkpoint(chunks, dst, iteration, a, common, log=print if progress else (lambda m: None))
    return {"params": int(sum(p.numel() for p in model.parameters()))}


def load_counts(path: Optional[str]) -> Optional[np.ndarray]:
    if path is None:
        return None
    from megatron_lev.evaluation.perplexity import DataFormatError, load_token_counts

    if not os.path.isfile(path):
        raise ConversionError(f"--token-counts {path}: no such file")
    try:
        return load_token_counts(path)
    except DataFormatError as e:
        raise ConversionError(str(e)) from None


def to_lev(src: str, dst: str, *, lev: Optional[Dict[str, Any]] = None, token_counts: Optional[str] = None,
           fit: Optional[FitConfig] = None, iteration: Optional[int] = None, report_file: Optional[str] = None,
           progress: bool = True, allow_missing_checksums: bool = False) -> FitReport:
    """Fit LEV to the input table of the dense checkpoint ``src`` and write a lev checkpoint root ``dst``
    (at the source's TP/PP layout). ``lev``: LEVConfig overrides (``--lev-*``). ``token_counts``: a
    ``.npy`` of counts per id (frequency weighting and per-bucket errors). ``report_file``: also write
    the report as JSON. Returns the :class:`FitReport`."""
    import json

    from .launch import run_ranks
    from .model_io import layout_args
    from .reshard import reshard_checkpoint

    log = print if progress else (lambda m: None)
    fit = fit or FitConfig(progress=progress)
    fit.validate()
    source = open_checkpoint(src, iteration, allow_missing_checksums=allow_missing_checksums)
    a = source.args
    rc = saved_config(source)
    arm = find_arm(rc.model.input_embedding)
    if arm is None or not arm.megatron_embedding:
        raise ConversionError(f"{source.path}: --input-embedding is {rc.model.input_embedding}; to-lev needs a "
                              "dense input table (tied or untied)")
    dst = save_target(dst, source.root)
    counts = load_counts(token_counts)
    V, D = int(rc.model.padded_vocab_size), int(rc.model.hidden_size)
    lev_cfg = lev_config_for(a, lev or {})
    tp, pp = rc.layout.tp, rc.layout.pp
    try:
        lev_cfg.validate(V, D, tp)
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    if counts is not None and counts.size > V:
        raise ConversionError(f"--token-counts {token_counts}: {counts.size} entries but the model has {V} ids")
    lev_a = dict(a, input_embedding="lev", untie_embeddings_and_output_weights=True,
                 **lev_cfg.to_args())
    log(f"converting {source.path} ({rc.model.input_embedding}, V={V}, D={D}, iteration {source.iteration}) to lev "
        f"-> {dst}")
    with disk_full_is_one_line(dst, "the LEV checkpoint"):
        os.makedirs(dst, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".to-lev-", dir=dst)
        try:
            table_file = os.path.join(work, "table.safetensors")
            run_ranks(_read_table_rank, tp=1, pp=1, args=(source.path, layout_args(a, 1, 1), table_file))
            from safetensors.torch import load_file, save_file

            table = load_file(table_file)["table"]
            emb, report = fit_lev(table, lev_cfg, init_method_std=float(rc.model.init_method_std),
                                  counts=counts, fit=fit)
            log(report.format())
            lev_file = os.path.join(work, "lev.safetensors")
            save_file({k: v.detach().cpu().contiguous() for k, v in emb.state_dict().items()}, lev_file)
            common = {k: source.common.get(k) for k in ("consumed_train_samples", "counters", "opt_param_scheduler")}
            direct = tp == 1 and pp == 1
            first = dst if direct else os.path.join(work, "tp1")
            run_ranks(_write_lev_rank, tp=1, pp=1,
                      args=(source.path, layout_args(a, 1, 1), first, source.iteration, layout_args(lev_a, 1, 1),
                            common, lev_file, progress))
            if not direct:
                reshard_checkpoint(first, dst, tp=tp, pp=pp, progress=progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if report_file:
        with open(report_file, "w", encoding="utf-8") as f:
            json.dump(report.as_dict(), f, indent=2)
    log(f"done: {dst} (lev input arm, iteration {source.iteration}). Continue with pretrain_lev.py --config "
        f"{dst}/iter_{source.iteration:07d}/config.yaml --load {dst} ...")
    return report
