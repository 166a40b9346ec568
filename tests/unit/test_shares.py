"""Binomial intervals for shares and the paired comparison of two students' shares on the same trials."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from dofla.report.shares import (counts, digits, mcnemar_exact, newcombe_paired, paired_counts, paired_share_interval,
                                 share_interval, wilson)

Z = stats.norm.ppf(0.975)


def wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    """Wilson's score interval from its closed form: (p + z²/2n ± z √(p(1−p)/n + z²/4n²)) / (1 + z²/n)."""
    p = k / n
    centre, spread = p + Z ** 2 / (2 * n), Z * math.sqrt(p * (1 - p) / n + Z ** 2 / (4 * n ** 2))
    return (centre - spread) / (1 + Z ** 2 / n), (centre + spread) / (1 + Z ** 2 / n)


@pytest.mark.parametrize("k, n", [(0, 300), (9, 300), (62, 100), (99, 100), (100, 100)])
def test_the_wilson_interval_is_the_closed_form(k, n):
    assert wilson(k, n) == pytest.approx(wilson_by_hand(k, n), abs=1e-12)


def test_none_of_300_has_a_width_and_no_share_interval_goes_below_0():
    none = share_interval(torch.zeros(3, 100))
    assert (none.hits, none.trials, none.low) == (0, 300, 0.0)
    assert none.high == pytest.approx(Z ** 2 / (300 + Z ** 2))  # Wilson's upper end at 0 of n
    assert str(none) == "0.00 [0.00, 0.01]"
    nine = share_interval(torch.tensor([[1.0] * 3 + [0.0] * 97] * 3))
    assert str(nine) == "0.03 [0.02, 0.06]" and nine.low > 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        hits = (torch.rand(2, 40, generator=gen) < 0.05).double()
        got = share_interval(hits)
        assert 0.0 <= got.low <= got.share <= got.high <= 1.0


def test_an_exact_binomial_table_value():
    """Clopper–Pearson's exact upper end at 0 of 10 is 0.3085 (1 − 0.025^(1/10)): scipy's exact interval,
    beside which Wilson's is narrower at 0 of n."""
    exact = stats.binomtest(0, 10).proportion_ci(method="exact")
    assert exact.high == pytest.approx(0.3085, abs=1e-4) == pytest.approx(1 - 0.025 ** 0.1, abs=1e-4)
    assert wilson(0, 10)[1] < exact.high


def test_mqar_shares_count_their_queries():
    """An MQAR example at T = 64 holds 16 queries: its share is a count out of 16, pooled over examples."""
    got = share_interval([[0.0, 0.0625, 0.25]], per_value=16)
    assert (got.hits, got.trials) == (5, 48)
    with pytest.raises(ValueError, match="whole counts"):
        counts([[0.3]], per_value=16)
    with pytest.raises(ValueError, match="whole counts"):
        counts([[2.0]])


def test_mcnemar_exact_is_the_binomial_test_of_the_discordant_trials():
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 2 ** 10)  # P(X ≤ 1) both tails, X ~ Bin(10, 1/2)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(5, 5) == 1.0


def test_newcombes_paired_interval_matches_the_published_example():
    """Cavo et al. (2012), complete response before and after consolidation therapy, as worked in
    Fagerland, Lydersen and Laake's "Statistical Analysis of Contingency Tables" (chapter 8): 59 both,
    6 before only, 16 after only, 80 neither gives −0.0621 (−0.1186 to −0.0046)."""
    low, high = newcombe_paired(59, 6, 16, 80)
    assert (low, high) == (pytest.approx(-0.1186, abs=1e-4), pytest.approx(-0.0046, abs=1e-4))


def test_the_paired_cells_are_counted_trial_by_trial():
    a = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0]])
    b = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]])
    assert paired_counts(a, b) == (2, 3, 1, 4)
    got = paired_share_interval(a, b)
    assert got.difference == pytest.approx(0.2) and got.low < 0.2 < got.high
    assert got.p_value == pytest.approx(mcnemar_exact(3, 1))
    with pytest.raises(ValueError, match="same trials"):
        paired_counts(a, b[:1])


def test_shares_of_several_queries_pair_only_where_the_cells_are_known():
    """Per-example shares fix the paired cells only where one model hit none or all of the example's queries."""
    assert paired_counts([[0.25, 0.0]], [[0.0, 0.0]], per_value=4) == (0, 1, 0, 7)
    assert paired_counts([[1.0, 0.5]], [[0.25, 0.0]], per_value=4) == (1, 5, 0, 2)
    assert paired_share_interval([[0.5]], [[0.25]], per_value=4) is None


def test_the_paired_interval_covers_the_true_difference_about_95_percent_of_the_time():
    gen = torch.Generator().manual_seed(3)
    trials, covered = 400, 0
    for _ in range(trials):
        shared = torch.rand(120, generator=gen)  # correlated trials: a hard prompt is hard for both
        a, b = (shared < 0.3).double(), (torch.rand(120, generator=gen) * 0.5 + shared * 0.5 < 0.2).double()
        got = paired_share_interval(a, b)
        covered += got.low <= truth(0.3, 0.2) <= got.high
    assert 0.91 <= covered / trials <= 0.99


def truth(p_a: float, q: float) -> float:
    """P(shared < p_a) − P((u + shared)/2 < q) with u, shared uniform: the simulated difference of shares."""
    return p_a - 2 * q ** 2  # P(u + s < 2q) for 2q ≤ 1 is (2q)²/2


def test_a_narrow_interval_near_0_prints_enough_digits_to_show_its_width():
    assert digits(0.0, 0.0019) == 3 and digits(0.016, 0.056) == 2 and digits(0.0002, 0.0055) == 4
    assert str(share_interval(torch.zeros(1, 2048))) == "0.000 [0.000, 0.002]"
