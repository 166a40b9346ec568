"""What a registered measurement is, and how the eval stage takes the ones a run enables.

A :class:`Measurement` is one of the project's own probes: its name, when a run enables it, the
settings that key its stored result (:class:`~dofla.eval.store.Measurements`: a stored result is reused
only under the same settings) and how it computes its metrics (scalars go to ``metrics.json``, lists
under ``seq/`` to ``eval_sequences.json`` and from there to the run records). A measurement of each
model is stored once per model (``<name>/teacher``, ``<name>/student``); one that compares the two
(``models=()``) once, under its name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from dofla.registry import Registry

if TYPE_CHECKING:  # the run's config is only read here; dofla.config composes this package's section
    from dofla.config import RunConfig
    from dofla.eval.store import Measurements


@dataclass
class EvalRun:
    """What every measurement reads: the run's config, the two models, the settings that name them in
    a key (:func:`~dofla.eval.store.model_settings`), the held-out tokens (S, L), the tokenizer, and
    ``metrics``: what the measurements taken so far returned (the ablation reads the full student's)."""

    cfg: RunConfig
    teacher: Any
    student: Any
    who_settings: dict
    heldout: Any
    tokenizer: Any = None
    open_source: Callable[[], Any] | None = None  # the opened data the long held-out text is read from
    metrics: dict = field(default_factory=dict)
    _made: dict = field(default_factory=dict)

    def model(self, who: str):
        return self.teacher if who == "teacher" else self.student

    def once(self, name: str, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per run (inputs that several measurements read)."""
        if name not in self._made:
            self._made[name] = make()
        return self._made[name]


@dataclass(frozen=True)
class Measurement:
    """One registered measurement.

    ``writes``: the prefixes of the metric names it writes (scalars into ``metrics.json``; ``seq/`` ones,
    one value per sequence or prompt, into ``eval_sequences.json`` and the run records), checked on every
    result. ``settings(run, who)`` is what keys its stored result (``who``: "teacher"/"student", None for one
    comparing the two); ``compute(run, who, model)`` returns its metrics. ``shared``: the teacher's
    result is the same for every run of a sweep (kept in the teacher's shared store). ``every_rank``:
    taken by every torchrun process together (before the lm-eval tasks); the others are rank 0's (after
    them). ``combine(metrics)``: metrics derived from both models' (e.g. the perplexity ratio).
    """

    name: str
    writes: tuple[str, ...]
    enabled: Callable[[RunConfig], bool]
    settings: Callable[[EvalRun, str | None], dict]
    compute: Callable[[EvalRun, str | None, Any], dict]
    models: tuple[str, ...] = ("teacher", "student")
    shared: bool = False
    every_rank: bool = False
    combine: Callable[[dict], dict] | None = None


# registration order is the order the eval stage takes them in (dofla.eval.measures imports them in it)
MEASURES: Registry[Measurement] = Registry("measurement")


def register(measurement: Measurement) -> Measurement:
    return MEASURES.register(measurement.name)(measurement)


def enabled(cfg: RunConfig, every_rank: bool) -> list[Measurement]:
    """The registered measurements ``cfg`` enables, of one group, in the fixed order."""
    return [m for m in MEASURES.in_order() if m.every_rank == every_rank and m.enabled(cfg)]


def stored_name(measurement: Measurement, who: str | None) -> str:
    return measurement.name if who is None else f"{measurement.name}/{who}"


def check_writes(measurement: Measurement, metrics: dict) -> dict:
    """``metrics``, once every name in it is one ``measurement`` declares (a new measurement whose names
    its registration does not list fails at its first result, not in a page that misses them)."""
    stray = sorted(k for k in metrics if not k.startswith(measurement.writes))
    if stray:
        raise ValueError(f"measurement {measurement.name!r} wrote {', '.join(stray)}, which its registration's "
                         f"writes={measurement.writes} does not declare; add their prefix to it")
    return metrics


def _checked(measurement: Measurement, run: EvalRun, who: str | None, model) -> dict:
    return check_writes(measurement, measurement.compute(run, who, model))


def take(run: EvalRun, store: Measurements, every_rank: bool) -> dict:
    """Every enabled measurement of the group, stored or computed (``store``), in order; their metrics
    (also added to ``run.metrics``)."""
    out = {}
    for measurement in enabled(run.cfg, every_rank):
        got = {}
        for who in measurement.models or (None,):
            model = None if who is None else run.model(who)
            compute = partial(_checked, measurement, run, who, model)
            got.update(store.get(stored_name(measurement, who), measurement.settings(run, who), compute,
                                 share=measurement.shared and who == "teacher"))
        if measurement.combine is not None:
            got.update(check_writes(measurement, measurement.combine(got)))
        run.metrics.update(got)
        out.update(got)
    return out
