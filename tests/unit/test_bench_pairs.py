"""benchmarks.common.paired_ratio: the two sides alternate call by call, and the ratio is the
median of the pairs' ratios (not a ratio of two separately taken medians)."""
from __future__ import annotations

import time

from benchmarks.common import paired_ratio


def test_pairs_alternate_and_the_ratio_is_the_median_pair():
    calls, durations = [], iter([0.03, 0.01, 0.06, 0.01, 0.02, 0.01])

    def side(name):
        def run():
            calls.append(name)
            time.sleep(next(durations))
        return run

    slow, fast, ratio, ratios = paired_ratio(side("slow"), side("fast"), repeats=3)
    assert calls == ["slow", "fast"] * 3
    assert len(ratios) == 3 and ratios == sorted(ratios)
    assert ratio == ratios[1]
    assert 2.2 < ratio < 4.5  # the pairs' ratios are about 3, 6 and 2: the middle one
    assert ratios[0] < 2.5 and ratios[2] > 4.5
    assert slow >= 0.03 and 0.01 <= fast < 0.03
