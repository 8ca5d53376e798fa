"""One line plot of several runs for the examples (matplotlib, no display needed)."""

from __future__ import annotations


def save_curves(curves: dict, path: str, *, xlabel: str, ylabel: str, title: str) -> None:
  """Plots ``{label: (xs, ys)}`` as marked lines with a grid and a legend into ``path`` (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for label, (xs, ys) in curves.items():
    ax.plot(xs, ys, marker="o", ms=3, label=label)
  ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
