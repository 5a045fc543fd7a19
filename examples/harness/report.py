"""Markdown tables and figures."""

import math
import statistics
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from pyro_ngvi import metrics  # noqa: E402

from .train import History  # noqa: E402


def markdown_table(rows: Sequence[Dict], columns: Sequence[Tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec); a missing or None value prints as ``-``."""
    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    lines = [header, rule]
    for row in rows:
        cells = ["-" if row.get(key) is None else format(row[key], spec) for key, _, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def publish(text: str, results, out_md: Optional[str] = None, out_json: Optional[str] = None) -> None:
    """Print a benchmark's report; write it (markdown) and its raw results (JSON) where asked."""
    import json

    print()
    print(text)
    if out_md:
        with open(out_md, "w") as f:
            f.write(text)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(results, f)


def mean_sd(values: Sequence[Optional[float]], spec: str = ".3f") -> str:
    """``mean ± sd`` over seeds (one value alone; ``—`` for none, ``diverged`` for a NaN)."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if any(math.isnan(v) for v in values):
        return "diverged"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{statistics.mean(values):{spec}} ± {statistics.stdev(values):{spec}}"


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mean_over_runs(rows: Sequence[Sequence[float]]) -> list:
    return [statistics.mean(column) for column in zip(*rows)]


def plot_training(runs: Dict[str, Sequence[History]], metric: str, metric_label: str, path: Path,
                  num_data: int = 1, target: Optional[float] = None, title: Optional[str] = None) -> Path:
    """
    2 x 2 panels: negative ELBO (divided by ``num_data``) and the test ``metric``
    against epochs and against training time (log scale), each the mean over a
    method's runs (seeds). Runs without an ELBO (MAP) appear in the metric panels
    only; ``target`` is a dashed line in the ELBO panels.
    """
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    elbo_label = "negative ELBO" if num_data == 1 else f"-ELBO / {num_data} (train)"
    for k, (name, histories) in enumerate(runs.items()):
        style = dict(label=name, color=f"C{k}", marker=".")  # one colour per method in every panel
        epochs = histories[0].epoch
        seconds = _mean_over_runs([h.time for h in histories])
        timed = [i for i, e in enumerate(epochs) if e > 0]  # (epoch 0 is at time 0: off a log axis)
        for row, key, sign in ((0, "elbo", -1 / num_data), (1, metric, 1)):
            if key in histories[0].scores:
                values = [sign * v for v in _mean_over_runs([h.scores[key] for h in histories])]
                axes[row, 0].plot(epochs, values, **style)
                axes[row, 1].plot([seconds[i] for i in timed], [values[i] for i in timed], **style)
    positive = all(v > 0 for histories in runs.values() for h in histories for v in h.scores.get(metric, []))
    for ax, x_label, y_label in zip(axes.flat, ("epoch", "training time [s]") * 2,
                                    (elbo_label, elbo_label, metric_label, metric_label)):
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
    for ax in axes[:, 1]:
        ax.set_xscale("log")
    for ax in axes[0]:
        ax.set_yscale("log")
        if target is not None:
            ax.axhline(target, color="0.5", linestyle="--", linewidth=0.8)
    for ax in axes[1]:
        ax.set_yscale("log" if positive else "linear")
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def plot_elbo_curves(curves: Dict[str, Tuple[Sequence[float], Sequence[float]]], path: Path,
                     best: Optional[float] = None, x_label: str = "step") -> Path:
    """Negative ELBO against steps (log-log), one line per method; the optimum as a line."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    floor = best if best is not None else min(min(-v for v in values) for _, values in curves.values())
    for name, (steps, values) in curves.items():
        ax.plot(steps, [floor - v + 1.0 for v in values], label=name)
    ax.axhline(2.0, color="gray", lw=0.8, ls="--", label="1 nat from the best")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel("best ELBO - ELBO + 1  [nats]")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_reliability(probs_by_method: Dict[str, torch.Tensor], y: torch.Tensor, path: Path,
                     num_bins: int = 15) -> Path:
    """Reliability diagrams side by side, ECE (same bins as the tables) in each title."""
    names = list(probs_by_method)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        probs = probs_by_method[name]
        confidence, accuracy, count = (t.numpy() for t in metrics.reliability_diagram_data(probs, y, num_bins))
        centres = (torch.arange(num_bins).numpy() + 0.5) / num_bins
        filled = count > 0
        ax.bar(centres[filled], accuracy[filled], width=1.0 / num_bins, edgecolor="k", alpha=0.7,
               label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.plot(confidence[filled], accuracy[filled], "r.", label="(confidence, accuracy)")
        ece = float(metrics.expected_calibration_error(probs, y, num_bins))
        ax.set_title(f"{name}\nECE {ece:.3f}", fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0, 0].set_ylabel("accuracy")
    return save_figure(fig, path)


def plot_entropy(entropies: Dict[str, Tuple[torch.Tensor, torch.Tensor]], path: Path,
                 labels=("test digits", "out of distribution")) -> Path:
    """Histograms of predictive entropy, in-distribution against OOD, per method."""
    names = list(entropies)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False, sharey=True)
    top = max(float(torch.cat(pair).max()) for pair in entropies.values())
    bins = torch.linspace(0, max(top, 1e-3), 25).numpy()
    for ax, name in zip(axes[0], names):
        inside, outside = entropies[name]
        ax.hist(inside.numpy(), bins=bins, alpha=0.6, density=True, label=labels[0])
        ax.hist(outside.numpy(), bins=bins, alpha=0.6, density=True, label=labels[1])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("predictive entropy [nats]")
    axes[0, 0].set_ylabel("density")
    axes[0, 0].legend(fontsize=7)
    return save_figure(fig, path)
