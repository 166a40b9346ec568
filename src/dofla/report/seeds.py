"""Runs that differ only in their seed, summarised: mean ± Student-t interval, and paired
differences of each allocation policy against ``fix`` at the same seed and budget.

A run here is the dict ``tables.load_run`` returns (``record`` holds the resolved config).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict

from dofla.config import ADDED_SECTIONS, LEGACY_VALUES
from dofla.feature_maps.blocks import mean_dim
from dofla.report.stats import gap_closed, mean_ci, paired_differences

# Config keys that name, place, log or measure a run, or read its data ahead, but do not change the
# student it trains: a seed run with other evaluation settings (say, MMLU left out) still counts as
# a seed; each metric's statistics are over the runs that measured it.
UNMEASURED = ("experiment", "logger", "eval", "stages", "prefetch", "preflight", "memory_limit_gb")
# How a budget is spread over layers (not what the budget is), the DoF estimate included, which
# `fix` ignores: dropped to find a run's fix twin.
SPREAD_KEYS = ("policy", "head_quantum", "head_blocks", "lam", "num_samples", "gram_norm", "num_tokens",
               "head_aggregate", "resamples", "spread_samples", "measured_dims", "measured_steps")
# Config keys added after runs were recorded without them, with the value that reproduces what those
# runs did: filled in before comparing, so an older run still groups with its newer seeds.
LEGACY_DEFAULTS: dict[str, dict] = {}
for (_section, _key), _value in LEGACY_VALUES.items():
    LEGACY_DEFAULTS.setdefault(_section, {})[_key] = _value


def _with_legacy_defaults(config: dict) -> dict:
    config = {**{name: asdict(section()) for name, section in ADDED_SECTIONS.items()}, **config}
    for key, value in LEGACY_DEFAULTS.get("run", {}).items():
        config.setdefault(key, value)
    for section, defaults in LEGACY_DEFAULTS.items():
        if isinstance(config.get(section), dict):
            config[section] = {**defaults, **config[section]}
    return config


def _strip(node, drop: tuple[str, ...]):
    if isinstance(node, dict):
        return {k: _strip(v, drop) for k, v in node.items() if "dir" not in k and k not in drop}
    return node


def settings_key(config: dict) -> str:
    """The run's settings without its seed, paths and what only names, logs or measures it: equal
    for runs whose students differ only in their seed (JSON, keys sorted)."""
    return json.dumps(_strip(_with_legacy_defaults(config), ("seed", *UNMEASURED)), sort_keys=True, default=str)


def settings_hash(config: dict) -> str:
    """A short stable name for ``settings_key`` (8 hex digits)."""
    return hashlib.sha256(settings_key(config).encode()).hexdigest()[:8]


def twin_key(config: dict) -> str:
    """The run's configuration without its allocation policy, paths and what only measures or
    logs: runs with equal keys (seed included) differ only in how the budget was spread."""
    config = _strip(config, UNMEASURED)
    for key in SPREAD_KEYS:
        config.get("allocation", {}).pop(key, None)
    return json.dumps(config, sort_keys=True, default=str)


def distinguishing_overrides(runs: list[dict]) -> list[str]:
    """Override keys whose value differs between runs (what a reader needs to tell them apart)."""
    values: dict[str, set] = {}
    for run in runs:
        for item in run["overrides"]:
            key, _, value = item.partition("=")
            values.setdefault(key, set()).add(value)
    for run in runs:
        keys = {o.partition("=")[0] for o in run["overrides"]}
        for key in values:
            if key not in keys:
                values[key].add("<default>")
    return sorted(k for k, v in values.items() if len(v) > 1 or len(runs) == 1)


def run_seed(run: dict):
    """The run's seed (from its record; older records: from its config)."""
    return run["record"].get("seed", run["record"].get("config", {}).get("seed"))


def run_policy(run: dict) -> str | None:
    """The run's allocation policy (``fix``, ``dof``, ...), None when neither file names one."""
    return run["record"].get("config", {}).get("allocation", {}).get("policy") or run["allocation"].get("policy")


def run_values(run: dict) -> dict[str, float]:
    """Every numeric metric of the run, plus ``mean_dim`` and ``cost`` (mean dim / budget)."""
    values = {k: float(v) for k, v in run["metrics"].items()
              if isinstance(v, (int, float)) and not isinstance(v, bool)}
    dims, budget = run["allocation"].get("dims"), run["allocation"].get("budget")
    if dims:
        values["mean_dim"] = mean_dim(dims)
        if budget:
            values["cost"] = values["mean_dim"] / float(budget)
    return values


def seed_groups(runs: list[dict]) -> tuple[list[dict], list[str]]:
    """Runs grouped by ``settings_key``, in first-seen order, and notes on what was left out.

    Each group: ``runs`` (one per seed, sorted by seed), ``seeds``, ``policy`` and ``stats``:
    metric -> (mean, half-width of the 95 % t interval or None, n). A second run with a seed
    already in its group is left out (it would shrink the interval) and named in a note.
    """
    grouped: dict[str, list[dict]] = {}
    for run in runs:
        config = run["record"].get("config")
        grouped.setdefault(settings_key(config) if config else str(run["dir"]), []).append(run)
    groups, notes = [], []
    for key, members in grouped.items():
        by_seed: dict = {}
        for run in members:
            if run_seed(run) in by_seed:
                notes.append(f"{run['dir']} repeats seed {run_seed(run)} of {by_seed[run_seed(run)]['dir']}; "
                             "left out of the statistics")
                continue
            by_seed[run_seed(run)] = run
        ordered = [by_seed[s] for s in sorted(by_seed, key=lambda s: (s is None, s))]
        groups.append({"key": key, "runs": ordered, "seeds": [run_seed(r) for r in ordered],
                       "policy": run_policy(ordered[0]), "stats": summarize([run_values(r) for r in ordered])})
    return groups, notes


def summarize(per_run: list[dict[str, float]]) -> dict[str, tuple[float, float | None, int]]:
    """metric -> (mean, 95 % t half-width or None, n) over the runs that have the metric."""
    keys = dict.fromkeys(k for values in per_run for k in values)
    out = {}
    for key in keys:
        xs = [v[key] for v in per_run if key in v and math.isfinite(v[key])]
        if xs:
            out[key] = (*mean_ci(xs), len(xs))
    return out


def paired_vs_fix(groups: list[dict]) -> list[dict]:
    """Per non-``fix`` group: per-seed differences against the ``fix`` run of the same twin key
    (same seed, budget and everything else), and their means with 95 % t intervals.

    Per seed s: ``loss_diff`` = ln ppl − ln ppl_fix, ``ppl_diff`` = ppl − ppl_fix (negative: the
    policy is better), ``gap_closed`` = (loss_fix − loss) / (loss_fix − loss_teacher), losses being
    held-out ln perplexities.
    """
    fix = {}
    for group in groups:
        if group["policy"] == "fix":
            for run in group["runs"]:
                if "eval/student_ppl" in run["metrics"] and _twin(run):
                    fix[_twin(run)] = run
    out = []
    for group in groups:
        if group["policy"] in (None, "fix"):
            continue
        pairs = {run_seed(r): (r["metrics"], fix[_twin(r)]["metrics"])
                 for r in group["runs"] if "eval/student_ppl" in r["metrics"] and _twin(r) in fix}
        if pairs:
            per_seed = _paired(pairs)
            out.append({"group": group, "policy": group["policy"], "per_seed": per_seed,
                        "stats": summarize(list(per_seed.values()))})
    return out


def _twin(run: dict) -> str | None:
    config = run["record"].get("config")
    return twin_key(config) if config else None


def _paired(pairs: dict) -> dict:
    """seed -> {loss_diff, ppl_diff, gap_closed} from seed -> (policy metrics, fix metrics)."""
    ppl = {s: m["eval/student_ppl"] for s, (m, _) in pairs.items()}
    ppl_fix = {s: f["eval/student_ppl"] for s, (_, f) in pairs.items()}
    loss, loss_fix = ({s: math.log(v) for s, v in d.items()} for d in (ppl, ppl_fix))
    loss_diff, ppl_diff = paired_differences(loss, loss_fix), paired_differences(ppl, ppl_fix)
    out = {}
    for s in loss_diff:
        out[s] = {"loss_diff": loss_diff[s], "ppl_diff": ppl_diff[s]}
        teacher = pairs[s][0].get("eval/teacher_ppl")
        closed = gap_closed(loss_fix[s], loss[s], math.log(teacher)) if teacher else None
        if closed is not None:
            out[s]["gap_closed"] = closed
    return out
