"""
Two practical questions about the BayesianNet recipe, on the digits MLP of
``bnn_classification.py`` (64-100-10, prior N(0, 1)):

1. **The tuning path of Osawa et al. (2019)**: train the deterministic variant first
   (OGN: the same ``NGVI()``, statistics at the mean,
   ``CurvatureELBO("ggn", deterministic=True)``), which behaves like a point-estimate
   optimizer and is quick to get right, then switch the same optimizer to sampled
   statistics (VOGN: ``CurvatureELBO("ggn")``) and let the posterior widen. Compared
   with VOGN from the start for as many epochs.
2. **How many test-time samples**: the metrics of the predictive built from S weight
   samples of the final VOGN posterior, S = 1 ... 200 (``pyro_ngvi.metrics.metrics_by_num_samples``:
   the samples cut into disjoint groups of S, each group's predictive scored, averaged).

Prints two markdown tables and saves ``num_samples.png`` (test NLL and ECE against S)
into ``--out``.

Usage::

    python examples/bnn_recipe.py [--epochs 100] [--quick] [--out out/bnn_recipe]
"""

import sys
from pathlib import Path

import torch

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import harness  # noqa: E402
from bnn_classification import digits_task, score  # noqa: E402

from pyro.infer import SVI  # noqa: E402

from pyro_ngvi import CurvatureELBO, metrics  # noqa: E402

NAME = "bnn_recipe"
SAMPLE_COUNTS = (1, 2, 5, 10, 20, 50, 100, 200)


def tuning_path(task: harness.Task, epochs: int, ogn_epochs: int, samples: int):
    """Rows: OGN after ``ogn_epochs``, OGN then VOGN (``epochs`` in all), VOGN from the start."""
    rows = []
    path = harness.ngvi_recipe(task, "ggn", name="OGN -> VOGN")
    with path.active():
        path.svi = SVI(path.bnn, path.guide, path.optim, CurvatureELBO("ggn", deterministic=True))
        ogn = harness.fit(path, ogn_epochs)
        rows.append({"run": f"OGN (deterministic), {ogn_epochs} epochs", **score(task, path, samples),
                     "seconds": sum(ogn.step_times)})
        path.svi = SVI(path.bnn, path.guide, path.optim, CurvatureELBO("ggn"))  # the same NGVI, its state kept
        vogn = harness.fit(path, epochs - ogn_epochs)
        rows.append({"run": f"then VOGN, {epochs - ogn_epochs} epochs", **score(task, path, samples),
                     "seconds": sum(ogn.step_times) + sum(vogn.step_times)})
    scratch = harness.ngvi_recipe(task, "ggn", name="VOGN")
    history = harness.fit(scratch, epochs)
    rows.append({"run": f"VOGN from the start, {epochs} epochs", **score(task, scratch, samples),
                 "seconds": sum(history.step_times)})
    return rows, scratch


def by_num_samples(task: harness.Task, method: harness.Method, counts):
    """The predictive's test metrics against the number of weight samples it averages."""
    with method.active():
        logits = method.predict(task.split.x_test, max(counts), torch.Generator().manual_seed(task.seed))
    table = metrics.metrics_by_num_samples(logits, task.split.y_test, counts)
    return [{"samples": s, **{key: float(values[k]) for key, values in table.items()}} for k, s in enumerate(counts)]


def main(argv=None):
    args = harness.parse_bnn_args(NAME, __doc__.strip().splitlines()[0], argv, epochs=100, batch_size=128,
                                  samples=32)
    counts = [s for s in SAMPLE_COUNTS if s <= (8 if args.quick else max(SAMPLE_COUNTS))]
    with harness.session(args):
        task = digits_task(args.seed, args.prior_scale, args.batch_size)
        rows, vogn = tuning_path(task, args.epochs, max(1, args.epochs // 2), args.samples)
        print()
        print(f"Digits, MLP 64-100-10, NGVI() with ggn curvature; test metrics from {args.samples} samples "
              f"(OGN's guide is sampled too)")
        print()
        print(harness.markdown_table(rows, [
            ("run", "run", "s"), ("accuracy", "test acc", ".3f"), ("nll", "test NLL", ".3f"),
            ("ece", "ECE", ".3f"), ("ood_auroc", "OOD AUROC", ".3f"), ("seconds", "train s", ".1f"),
        ]))
        table = by_num_samples(task, vogn, counts)
        print()
        print("The VOGN posterior's predictive against the number of test-time samples S:")
        print()
        print(harness.markdown_table(table, [
            ("samples", "S", "d"), ("accuracy", "test acc", ".4f"), ("nll", "test NLL", ".4f"), ("ece", "ECE", ".4f"),
        ]))
        fig, axes = harness.plt.subplots(1, 2, figsize=(8, 3.2))
        for ax, key, label in zip(axes, ("nll", "ece"), ("test NLL", "ECE")):
            ax.plot([r["samples"] for r in table], [r[key] for r in table], marker="o")
            ax.set_xscale("log")
            ax.set_xlabel("test-time samples S")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        figure = harness.save_figure(fig, args.out / "num_samples.png")
        print()
        print(f"figure: {figure}")
        return rows, table


if __name__ == "__main__":
    main()
