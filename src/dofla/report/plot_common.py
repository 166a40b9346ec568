"""What every report plot shares: the headless backend, error-bar widths, saving."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, ax, path: Path, legend: bool = True) -> Path:
    """Legend, layout, PNG, close: the end of every plot here."""
    if legend:  # outside the axes, so it never hides a curve
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _yerr(halves: list) -> list[float]:
    """Error-bar half-widths, 0 where there is no interval (a single seed)."""
    return [0.0 if h is None else h for h in halves]
