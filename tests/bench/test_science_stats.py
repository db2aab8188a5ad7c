"""The statistics of the science report (bench/science_stats.py) on synthetic data whose answer is known:
t quantiles, t intervals' coverage, the document bootstrap, and the sentences they allow."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def st():
    return load_bench("science_stats")


@pytest.mark.parametrize("df, q", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantiles_match_the_tables(st, df, q):
    assert st.t_quantile(0.975, df) == pytest.approx(q, abs=1e-4)


def test_t_interval_is_mean_plus_minus_t_sd_over_root_n_and_covers_about_95_percent(st):
    iv = st.t_interval([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.hi - iv.mean == pytest.approx(4.3027 * 1.0 / math.sqrt(3), abs=1e-3)
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(400):
        x = rng.normal(0.3, 1.0, size=5)
        iv = st.t_interval(x)
        hits += iv.lo <= 0.3 <= iv.hi
    assert 0.91 <= hits / 400 <= 0.99, hits


def test_one_seed_has_no_interval_and_no_statement(st):
    iv = st.t_interval([-0.05])
    assert iv.lo is None and iv.excludes_zero is None
    line = st.verdict("lev", "tied", "validation", iv, None)
    assert "one seed: no interval" in line and "better" not in line and "worse" not in line


def test_document_bootstrap_is_paired_and_token_weighted(st):
    rng = np.random.default_rng(2)
    tokens = rng.integers(50, 500, size=200)
    base = rng.normal(5.0, 1.0, size=200)  # documents differ a lot: only a paired bootstrap sees 0.02 clearly
    a = np.stack([(base - 0.02 + rng.normal(0, 0.01, 200)) * tokens for _ in range(3)])
    b = np.stack([base * tokens for _ in range(3)])
    iv = st.document_bootstrap(a, b, tokens)
    assert iv.mean == pytest.approx(float((a - b).mean(axis=0).sum() / tokens.sum()))
    assert iv.lo < -0.02 < iv.hi and iv.hi < 0
    same = st.document_bootstrap(b, b, tokens)
    assert same.lo == same.hi == 0.0
    with pytest.raises(ValueError, match="documents"):
        st.document_bootstrap(a, b, tokens[:10])


@pytest.mark.parametrize("seeds, docs, words", [
    ([-0.03, -0.02, -0.025, -0.035, -0.02], (-0.03, -0.04, -0.01), "lev is better than tied (both intervals below 0)"),
    ([0.03, 0.02, 0.025, 0.035, 0.02], (0.03, 0.01, 0.04), "lev is worse than tied (both intervals above 0)"),
    ([-0.03, 0.02, -0.025, 0.035, -0.02], (-0.03, -0.04, -0.01), "no difference shown (an interval contains 0)"),
    ([-0.03, -0.02, -0.025, -0.035, -0.02], (-0.03, -0.06, 0.001), "no difference shown (an interval contains 0)"),
])
def test_a_sentence_claims_only_what_both_intervals_show(st, seeds, docs, words):
    line = st.verdict("lev", "tied", "validation", st.t_interval(seeds), st.Interval(*docs, n=5))
    assert line.endswith(words + "."), line
    assert "over 5 seeds" in line and "%" in line and "nats" in line


def test_percent_is_the_perplexity_change(st):
    assert st.pct(math.log(0.9)) == pytest.approx(-10.0)
    assert st.fmt_interval(st.Interval(math.log(1.1), 0.0, math.log(1.21), 3)) == \
        "+0.0953 [+0.0000, +0.1906] nats (+10.00% [+0.00%, +21.00%])"
