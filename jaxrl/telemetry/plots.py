"""Reward curves and lag histograms as PNG files or as Figures a notebook can show.

Figures are built from `matplotlib.figure.Figure` and drawn with `FigureCanvasAgg` rather than
through pyplot, so writing a PNG neither switches nor leaks into a notebook's inline backend."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

FIGSIZE = (6.4, 4.0)  # inches; at DPI this is a 640 x 400 pixel PNG
DPI = 100


def figure_reward_curves(curves: dict[str, tuple[Sequence[float], Sequence[float]]], *,
                         xlabel: str = "wall time (s)", ylabel: str = "reward",
                         title: str | None = None) -> Figure:
    """One line per label, e.g. {"async": (times, rewards), "sync": (times, rewards)}."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax = fig.add_subplot()
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if curves:
        ax.legend()
    ax.grid(alpha=0.3)
    return fig


def figure_lag_histogram(lags: Sequence[int], *, title: str | None = None) -> Figure:
    """Samples per lag: optimizer steps between the weights that generated a sample and the
    weights it trained. One bar per integer lag."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax = fig.add_subplot()
    lags = np.asarray(lags, dtype=np.int64)
    if lags.size:
        edges = np.arange(lags.min(), lags.max() + 2) - 0.5
        ax.hist(lags, bins=edges, rwidth=0.9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("lag (optimizer steps)")
    ax.set_ylabel("samples")
    if title:
        ax.set_title(title)
    return fig


def figure_lengths(rows: Sequence[dict], *, title: str | None = None) -> Figure:
    """The output-length distribution over training, from rows with completion_len_p10/p50/
    p90/max (jaxrl/trainer/rl.py logs them every step): the median, the 10-90% band and the
    longest sample of each step, on a log scale (long-tailed tasks span orders of magnitude)."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax = fig.add_subplot()
    rows = [r for r in rows if r.get("completion_len_p50") is not None]
    if rows:
        steps = [r["step"] for r in rows]
        ax.fill_between(steps, [r["completion_len_p10"] for r in rows],
                        [r["completion_len_p90"] for r in rows], alpha=0.3, label="10-90%")
        ax.plot(steps, [r["completion_len_p50"] for r in rows], label="median")
        ax.plot(steps, [r["completion_len_max"] for r in rows], ".", markersize=3,
                label="longest")
        ax.set_yscale("log")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("completion tokens")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    return fig


def reward_curves(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path, *,
                  xlabel: str = "wall time (s)", ylabel: str = "reward",
                  title: str | None = None) -> Path:
    return save_png(figure_reward_curves(curves, xlabel=xlabel, ylabel=ylabel, title=title), path)


def lag_histogram(lags: Sequence[int], path, *, title: str | None = None) -> Path:
    return save_png(figure_lag_histogram(lags, title=title), path)


def save_run_plots(run_dir, rows: list[dict], lags: Sequence[int]) -> dict[str, Path]:
    """`<run_dir>/plots/reward.png` from the rows that have both "time_s" and "reward" (as
    `read_metrics` returns them), `<run_dir>/plots/lag.png`, and `<run_dir>/plots/lengths.png`
    (the output-length distribution per step)."""
    plots = Path(run_dir) / "plots"
    points = [(r["time_s"], r["reward"]) for r in rows
              if r.get("time_s") is not None and r.get("reward") is not None]
    times, rewards = [t for t, _ in points], [r for _, r in points]
    return {"reward": reward_curves({Path(run_dir).name: (times, rewards)}, plots / "reward.png"),
            "lag": lag_histogram(lags, plots / "lag.png"),
            "lengths": save_png(figure_lengths(rows), plots / "lengths.png")}


def save_png(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))
    return path
