"""benchmarks.common.paired_ratio: the two sides alternate call by call, and the ratio is the
median of the pairs' ratios (not a ratio of two separately taken medians)."""
from __future__ import annotations

from benchmarks import common
from benchmarks.common import paired_ratio


def test_pairs_alternate_and_the_ratio_is_the_median_pair(monkeypatch):
    # a clock that each call advances by its scripted duration: the logic is tested, not the machine's sleep
    clock, calls, durations = [0.0], [], iter([0.03, 0.01, 0.06, 0.03, 0.02, 0.02])
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

    def side(name):
        def run():
            calls.append(name)
            clock[0] += next(durations)
        return run

    slow, fast, ratio, ratios = paired_ratio(side("slow"), side("fast"), repeats=3)
    assert calls == ["slow", "fast"] * 3
    assert ratios == sorted(ratios) and [round(r, 9) for r in ratios] == [1.0, 2.0, 3.0]
    assert ratio == ratios[1]  # the middle pair's 2.0, not median(slow) / median(fast) = 1.5
    assert round(slow, 9) == 0.03 and round(fast, 9) == 0.02
