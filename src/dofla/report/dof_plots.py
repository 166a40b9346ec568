"""Plots of Algorithm 1's degrees of freedom: per (layer, head), per layer with its spread over
seeds and J-samples, and beside the ``measured`` policy's sensitivity."""
from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import MaxNLocator

from dofla.report.plot_common import _save, _yerr, plt
from dofla.report.stats import mean_ci


def plot_dof_heatmap(runs: list[dict], path: Path) -> Path | None:
    """Per-(layer, head) degrees of freedom from Algorithm 1 (first run that has them)."""
    table = next((r["dof"]["per_head"] for r in runs if r["dof"].get("per_head")), None)
    if table is None:
        return None
    width = max(len(heads) for heads in table if heads)  # a layer Algorithm 1 skipped: a blank row
    table = [heads if heads else [float("nan")] * width for heads in table]
    fig, ax = plt.subplots(figsize=(6, 0.25 * len(table) + 1.5))
    image = ax.imshow(table, aspect="auto", cmap="viridis")
    ax.set(xlabel="head", ylabel="layer", title="degrees of freedom per (layer, head)")
    fig.colorbar(image, ax=ax)
    return _save(fig, ax, path, legend=False)


def _dof_sets(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """Distinct Algorithm 1 results (dof.json) grouped by their settings less seed and cache:
    (label, one dof dict per seed). Runs of one seed share one dof.json, so it counts once."""
    sets: dict[str, dict] = {}
    for run in runs:
        if run["dof"].get("layer_dof"):
            s = {k: v for k, v in (run["dof"].get("settings") or {}).items() if k not in ("seed", "cache_key")}
            label = ", ".join([f"J={s.get('num_samples', '?')}", f"{s.get('head_aggregate') or 'max'} over heads",
                               f"λ={s.get('lambda', '?')}", str(s.get("gram_norm", "?"))]
                              + [f"{s['num_tokens']} tokens"] * bool(s.get("num_tokens"))
                              + [f"mean of {s.get('resamples')} J-samples"] * ((s.get("resamples") or 1) > 1)
                              + [f"+{s.get('spread_samples')} J-samples"] * bool(s.get("spread_samples"))
                              ) if s else "layer DoF"
            seed = (run["dof"].get("settings") or {}).get("seed", run["record"].get("seed"))
            sets.setdefault(label, {}).setdefault(seed, run["dof"])
    return [(f"{label} ({len(d)} seed{'s' * (len(d) > 1)})", list(d.values())) for label, d in sets.items()]


def dof_band(dofs: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Per layer: the mean of the seeds' layer DoF, and the lowest and highest estimate over
    seeds and J-samples (each seed's own value and its dof.json ``spread`` values)."""
    nan = float("nan")  # a layer Algorithm 1 skipped (no features): a gap in the plot
    layers = range(len(dofs[0]["layer_dof"]))
    if any(dofs[0]["layer_dof"][i] is None for i in layers):
        skipped = {i for i in layers if dofs[0]["layer_dof"][i] is None}
        kept = [i for i in layers if i not in skipped]
        dofs = [{**d, "layer_dof": [d["layer_dof"][i] for i in kept],
                 "spread": [d["spread"][i] for i in kept] if d.get("spread") else None} for d in dofs]
        means, low, high = dof_band(dofs)
        full = [iter(means), iter(low), iter(high)]
        return tuple([nan if i in skipped else next(part) for i in layers] for part in full)
    means = [sum(d["layer_dof"][i] for d in dofs) / len(dofs) for i in layers]
    estimates = [[d["layer_dof"][i] for d in dofs] + [v for d in dofs if d.get("spread")
                                                       for v in d["spread"][i]["values"]] for i in layers]
    return means, [min(e) for e in estimates], [max(e) for e in estimates]


def plot_dof_profile(runs: list[dict], path: Path) -> Path | None:
    """Per-layer DoF as each run aggregated it: per DoF setting, the mean over seeds, with bars
    from the lowest to the highest estimate over seeds and J-samples (:func:`dof_band`)."""
    sets = _dof_sets(runs)
    if not sets:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    bars = False
    for label, dofs in sets:
        means, lo, hi = dof_band(dofs)
        bars |= lo != hi
        ax.errorbar(range(len(means)), means, yerr=[[m - a for m, a in zip(means, lo)],
                                                    [b - m for m, b in zip(means, hi)]],
                    marker="o", ms=3, capsize=2, label=label)
    ylabel = "layer DoF (mean over seeds)" + ("\nbars: min–max over seeds × J-samples" if bars else "")
    ax.set(xlabel="layer", ylabel=ylabel, title="degrees of freedom per layer (Algorithm 1 or its variant: settings in the legend)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, ax, path)


def _mean_interval(ax, xs: list[int], per_seed: list[list[float]], label: str) -> None:
    """Mean over seeds per x with the 95 % t interval as error bars (none for one seed)."""
    stats = [mean_ci([row[i] for row in per_seed]) for i in range(len(xs))]
    ax.errorbar(xs, [m for m, _ in stats], yerr=_yerr([h for _, h in stats]), marker="o", ms=3, capsize=2,
                label=label)


def plot_dof_vs_sensitivity(groups: list[dict], path: Path) -> Path | None:
    """Two panels on one layer axis: left the layer DoF, right the measured sensitivity (loss at
    the smallest M minus at the largest) of every seed group of ``measured`` runs, as mean over
    seeds ± 95 % t CI; the Spearman ρ between them is the mean over the group's seeds."""
    series = []
    for group in groups:
        runs = [r for r in group["runs"] if r["allocation"].get("sensitivity") and r["allocation"].get("layer_dof")]
        if runs:
            series.append((group, runs))
    if not series:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), sharex=True)
    titles = []
    for group, runs in series:
        alloc = [r["allocation"] for r in runs]
        layers = alloc[0].get("linear_layers") or list(range(len(alloc[0]["sensitivity"])))
        rhos = [a["dof_sensitivity_spearman"] for a in alloc if a.get("dof_sensitivity_spearman") is not None]
        rho = f"ρ={sum(rhos) / len(rhos):.2f}" if rhos else "ρ n/a"
        label = f"{group.get('label') or group['policy']}: {rho}"
        titles.append(rho)
        _mean_interval(left, layers, [[a["layer_dof"][i] for i in layers] for a in alloc], label)
        _mean_interval(right, layers, [a["sensitivity"] for a in alloc], label)
    left.set(xlabel="layer", ylabel="layer DoF", title="DoF as the run estimated it (mean ± 95 % t CI over seeds)")
    right.set(xlabel="layer", ylabel="loss(smallest M) − loss(largest M)", title="measured sensitivity")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    counts = sorted({len(runs) for _, runs in series})
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    seeds = "" if counts == [1] else f" (mean over {n} seeds)"
    fig.suptitle(f"DoF vs measured sensitivity: Spearman {', '.join(titles)}{seeds}")
    return _save(fig, right, path, legend=len(series) > 1)
