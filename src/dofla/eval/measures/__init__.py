"""The eval stage's own measurements, each a registered :class:`~dofla.eval.measures.base.Measurement`
(its name, the metric names it writes, when a run enables it, the settings that key its stored result,
what it computes).

The order of the imports below is the order the eval stage takes them in: the measurements every
torchrun process takes together first (perplexity, attention error), then, after the lm-eval tasks,
rank 0's (the ablation reads the full student's perplexity and attention error, so it comes after
them). A new measurement is one module here and its import, say a module ``mine.py``::

    def settings(run, who):                     # what its stored result is keyed by
        return {"model": run.who_settings[who], "n": run.cfg.eval.mine_n}

    def compute(run, who, model):               # scalars, and per-sequence lists under seq/
        return {f"mine/{who}": ..., f"seq/mine/{who}": [...]}

    register(Measurement("mine", ("mine/", "seq/mine/"), lambda cfg: cfg.eval.mine_n > 0, settings, compute))

with its option in :class:`~dofla.eval.config.EvalConfig` (off by default, so no earlier run's result
changes) and its checks in :mod:`dofla.eval.checks`.
"""
from dofla.eval.measures.base import MEASURES, EvalRun, Measurement, enabled, register, take
from dofla.eval.measures import perplexity  # noqa: F401 - registers
from dofla.eval.measures import attention_error  # noqa: F401 - registers
from dofla.eval.measures import ablate_linear  # noqa: F401 - registers
from dofla.eval.measures import window_mass  # noqa: F401 - registers
from dofla.eval.measures import memory  # noqa: F401 - registers
from dofla.eval.measures import position  # noqa: F401 - registers
from dofla.eval.measures import passkey  # noqa: F401 - registers
from dofla.eval.measures import mqar  # noqa: F401 - registers
from dofla.eval.measures import agreement  # noqa: F401 - registers

__all__ = ["MEASURES", "EvalRun", "Measurement", "enabled", "register", "take"]
