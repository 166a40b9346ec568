"""Seed groups and paired comparisons as table rows: report.csv columns, report.md and rich tables."""
from __future__ import annotations

import math

SEED_KEYS = ("seed",)
GROUP_METRICS = ("mean_dim", "cost", "eval/student_ppl", "eval/ppl_ratio", "eval/attn_error/mean",
                 "tasks/student/avg_acc", "tasks/acc_gap", "finetuned/student/avg_acc")
PAIRED_METRICS = {"loss_diff": "Δ held-out loss (policy − fix)", "ppl_diff": "Δ ppl (policy − fix)",
                  "gap_closed": "fix→teacher loss gap closed"}
GROUP_CAPTION = ("Across seeds: mean ± half-width of the two-sided 95 % Student-t interval over the seeds "
                 "of each setting, t(0.975, n−1)·s/√n (s: sample standard deviation); n=1: the single value, "
                 "no interval. cost = mean feature dim / budget.")
PAIRED_CAPTION = ("Paired against `fix` at the same seed and budget (same data order and initial features): "
                  "per-seed differences, then mean ± 95 % Student-t interval over the seeds. Loss = ln(held-out "
                  "perplexity); negative Δ: the policy is better. Gap closed = (loss_fix − loss) / "
                  "(loss_fix − loss_teacher) per seed.")


def fmt_stat(stat, n_group: int | None = None) -> str:
    """``(mean, half, n)`` as "mean ± half", or "mean (n=1)" without an interval; n is also shown
    when fewer than the group's ``n_group`` runs measured the metric."""
    if stat is None:
        return ""
    mean, half, n = stat
    if half is None:
        return f"{mean:.4g} (n={n})"
    if math.isfinite(half) and half <= 1e-9 * abs(mean):  # equal values up to float rounding
        half = 0.0
    return f"{mean:.4g} ± {half:.2g}" + (f" (n={n})" if n_group is not None and n != n_group else "")


def group_label(group: dict, keys: list[str]) -> dict[str, str]:
    """The group's values of the distinguishing override keys, seed left out."""
    given = dict(o.partition("=")[::2] for o in group["runs"][0]["overrides"])
    return {k: given.get(k, "<default>") for k in keys if k not in SEED_KEYS}


def group_rows(groups: list[dict], keys: list[str]) -> tuple[list[dict], list[str]]:
    """One display row per seed group, and its columns (only metrics some group has)."""
    rows = []
    for group in groups:
        row = {**group_label(group, keys), "policy": group["policy"], "n_seeds": len(group["runs"]),
               "seeds": ",".join(str(s) for s in group["seeds"])}
        row.update({m: fmt_stat(group["stats"].get(m), len(group["runs"])) for m in GROUP_METRICS})
        rows.append(row)
    label_cols = [k for k in keys if k not in SEED_KEYS]
    metrics = [m for m in GROUP_METRICS if any(g["stats"].get(m) for g in groups)]
    return rows, [*label_cols, "policy", "n_seeds", "seeds", *metrics]


def paired_rows(paired: list[dict], keys: list[str]) -> tuple[list[dict], list[str]]:
    """One display row per policy group with ``fix`` twins: its cost and paired statistics."""
    rows = []
    for pair in paired:
        row = {**group_label(pair["group"], keys), "policy": pair["policy"], "n_pairs": len(pair["per_seed"]),
               "cost": fmt_stat(pair["group"]["stats"].get("cost"))}
        n = len(pair["per_seed"])
        row.update({title: fmt_stat(pair["stats"].get(k), n) for k, title in PAIRED_METRICS.items()})
        rows.append(row)
    return rows, [*(k for k in keys if k not in SEED_KEYS), "policy", "n_pairs", "cost", *PAIRED_METRICS.values()]


def csv_columns(run: dict, group: dict | None, pair: dict | None) -> dict:
    """The run's report.csv columns from its seed group (``n_seeds``, ``<metric>_mean``,
    ``<metric>_ci95``) and, for a policy with a fix twin, the paired ``vs_fix/...`` columns."""
    out: dict = {}
    if group is not None:
        out["n_seeds"] = len(group["runs"])
        for metric, (mean, half, _) in group["stats"].items():
            out[f"{metric}_mean"], out[f"{metric}_ci95"] = mean, half
    if pair is not None:
        seed = run["record"].get("seed", run["record"].get("config", {}).get("seed"))
        out["vs_fix/n_pairs"] = len(pair["per_seed"])
        for metric in PAIRED_METRICS:
            if seed in pair["per_seed"] and metric in pair["per_seed"][seed]:
                out[f"vs_fix/{metric}"] = pair["per_seed"][seed][metric]
            if metric in pair["stats"]:
                mean, half, _ = pair["stats"][metric]
                out[f"vs_fix/{metric}_mean"], out[f"vs_fix/{metric}_ci95"] = mean, half
    return out
