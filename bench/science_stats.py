"""Seed-paired differences between input arms, with their 95% intervals, and the sentences that state them.

Used by ``bench/reproduce.py``'s report. Every run of a seed shares the transformer body's initial weights,
the data order and the schedule with the other arms of that seed, so a contrast A - B is taken per seed
(paired) and then over seeds:

- **t over seeds**: the mean of the per-seed differences d_s and ``mean +/- t(0.975, n-1) * sd / sqrt(n)``;
  it carries the run-to-run noise (initialisation of the input side, the arm's own training noise). One
  seed has no interval.
- **document bootstrap**: the evaluation set resampled by document (paired: every arm scores the same
  documents), the seed-mean difference of the token-weighted mean NLL recomputed per resample, percentile
  interval; it carries how much the answer depends on which documents were scored.

Differences are in nats per token (mean NLL, A - B: negative = A better) and as a perplexity change in %
(``exp(d) - 1``, the interval mapped the same way). A sentence that says one arm is better is written only
when both intervals exclude 0 on the same side.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def _t_density(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int) -> float:
    """Student's t distribution function (Simpson's rule on the density from 0; |x| beyond 1e4 is 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom {df}: expected >= 1")
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    x = min(x, 1e4)
    # The density falls slowly for small df: integrate in u = atan(t), where it is smooth and bounded.
    steps = 2000
    a, b = 0.0, math.atan(x)
    h = (b - a) / steps
    f = lambda u: _t_density(math.tan(u), df) / math.cos(u) ** 2  # noqa: E731
    s = f(a) + f(b) + sum((4 if i % 2 else 2) * f(a + i * h) for i in range(1, steps))
    return 0.5 + s * h / 3


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``)."""
    if not 0.5 <= p < 1:
        raise ValueError(f"quantile {p}: expected 0.5 <= p < 1")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


class Interval(NamedTuple):
    mean: float
    lo: Optional[float]
    hi: Optional[float]
    n: int

    @property
    def excludes_zero(self) -> Optional[int]:
        """-1: entirely below 0, +1: entirely above, 0: contains 0, None: no interval."""
        if self.lo is None or self.hi is None:
            return None
        return -1 if self.hi < 0 else (1 if self.lo > 0 else 0)


def t_interval(diffs: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of the per-seed differences and its t interval (no interval from one seed)."""
    d = np.asarray(list(diffs), dtype=np.float64)
    if d.size == 0:
        raise ValueError("no paired seeds")
    mean = float(d.mean())
    if d.size < 2:
        return Interval(mean, None, None, 1)
    half = t_quantile(0.5 + level / 2, d.size - 1) * float(d.std(ddof=1)) / math.sqrt(d.size)
    return Interval(mean, mean - half, mean + half, int(d.size))


def document_bootstrap(nll_a: np.ndarray, nll_b: np.ndarray, tokens: np.ndarray, level: float = 0.95,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Interval:
    """Percentile interval of the seed-mean difference of token-weighted mean NLL, documents resampled.

    ``nll_a``, ``nll_b``: [seeds, documents] summed NLL per document of arm A and B (the same documents);
    ``tokens``: [documents] targets per document."""
    a, b = np.atleast_2d(np.asarray(nll_a, dtype=np.float64)), np.atleast_2d(np.asarray(nll_b, dtype=np.float64))
    tok = np.asarray(tokens, dtype=np.float64)
    if a.shape != b.shape or a.shape[1] != tok.size:
        raise ValueError(f"per-document sums of shapes {a.shape} and {b.shape} for {tok.size} documents")
    diff = (a - b).mean(axis=0)  # per document, seed-averaged: each seed's token weights are the same
    mean = float(diff.sum() / tok.sum())
    if tok.size < 2:
        return Interval(mean, None, None, a.shape[0])
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(tok.size, np.full(tok.size, 1.0 / tok.size), size=resamples).astype(np.float64)
    stats = (weights @ diff) / (weights @ tok)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(stats, [tail, 100 - tail])
    return Interval(mean, float(lo), float(hi), a.shape[0])


def pct(nats: Optional[float]) -> Optional[float]:
    """A difference of mean NLL as the change of perplexity, in %."""
    return None if nats is None else 100.0 * math.expm1(nats)


def fmt_interval(iv: Interval, digits: int = 4) -> str:
    """``-0.0123 [-0.0200, -0.0046] nats (-1.22% [-1.98%, -0.46%])``; one seed: its value and "one seed"."""
    if iv.lo is None:
        return f"{iv.mean:+.{digits}f} nats ({pct(iv.mean):+.2f}%; one seed: no interval)"
    return (f"{iv.mean:+.{digits}f} [{iv.lo:+.{digits}f}, {iv.hi:+.{digits}f}] nats "
            f"({pct(iv.mean):+.2f}% [{pct(iv.lo):+.2f}%, {pct(iv.hi):+.2f}%])")


def verdict(a: str, b: str, what: str, seeds: Interval, documents: Optional[Interval]) -> str:
    """One sentence on A - B that claims no more than the intervals show."""
    if seeds.lo is None:
        return (f"- {what}, {a} - {b}: {seeds.mean:+.4f} nats ({pct(seeds.mean):+.2f}%); one seed: no interval, "
                "no statement.")
    sides = {seeds.excludes_zero, documents.excludes_zero if documents is not None else seeds.excludes_zero}
    head = f"- {what}, {a} - {b} over {seeds.n} seeds: {fmt_interval(seeds)}"
    doc = f"; document bootstrap {fmt_interval(documents)}" if documents is not None and documents.lo is not None else ""
    if sides == {-1}:
        return head + doc + f": {a} is better than {b} (both intervals below 0)."
    if sides == {1}:
        return head + doc + f": {a} is worse than {b} (both intervals above 0)."
    return head + doc + ": no difference shown (an interval contains 0)."


def contrast(per_seed_a: Dict[int, float], per_seed_b: Dict[int, float]) -> List[float]:
    """The paired differences over the seeds both arms have."""
    return [per_seed_a[s] - per_seed_b[s] for s in sorted(set(per_seed_a) & set(per_seed_b))]
