"""
A Bayesian MLP (10-50-1) for scikit-learn's diabetes regression, noise learned.

``BayesianNet(net, "gaussian", noise_scale=None)``: y ~ N(f(x; w), sigma^2) with
w ~ N(0, s0^2) element-wise and sigma a point-estimated ``pyro.param``.
Features and target are standardised with the training split's statistics, so
RMSE and log-likelihood are in units of the target's standard deviation.

* NGVI + CurvatureELBO("ggn")  - the README's recipe (bnn.guide(), NGVI()), exact
                                 Gauss-Newton diagonal (BackPACK)
* NGVI + CurvatureELBO("ef")   - the same with VOGN's per-example squared gradients
* Pyro SVI + Adam              - Bayes-by-Backprop on the same model and guide
* MAP + Adam                   - the plain network (noise by MAP too)
* ivon-opt                     - IVON on the plain network (if installed)

Prints test RMSE, log-likelihood and the coverage of the central 50 % and 90 %
predictive intervals; saves ``training_curves.png`` (negative ELBO and test
log-likelihood against epochs and wall time) and ``predictions.png`` (predictive
mean and 90 % interval against the target, test points) into ``--out``.

Usage::

    python examples/bnn_regression.py [--epochs 100] [--quick] [--out out/bnn_regression]
"""

import math
import sys
from pathlib import Path

import torch

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # run as a script or imported by path: find the harness
    sys.path.insert(0, HERE)
import harness  # noqa: E402

NAME = "bnn_regression"


def methods(task: harness.Task, steps: int) -> dict:
    """
    Name -> factory of each method. NGVI: the README's recipe, nothing set
    (``bnn.guide()``, ``NGVI()``; the noise scale is a point estimate NGVI hands to
    its point optimiser, Adam). Baselines, a small grid on --seed 1 (the reported
    runs use --seed 0): Adam lr 0.01 / 0.03 and init_scale 0.01 / 0.1 for
    Bayes-by-Backprop, lr 1e-3 / 3e-3 / 1e-2 for MAP; for ivon-opt lr 0.02 / 0.05 /
    0.1, hess_init 0.1 / 0.01 / 0.001 and beta2 0.99999 / 0.999 / 0.99, by the ELBO.
    """
    factories = {
        "NGVI (ggn)": lambda: harness.ngvi_recipe(task, "ggn", name="NGVI (ggn)"),
        "NGVI (ef)": lambda: harness.ngvi_recipe(task, "ef", name="NGVI (ef)"),
        "BBB (Adam)": lambda: harness.bayes_by_backprop(task, lr=1e-2, init_scale=0.01, name="BBB (Adam)"),
        "MAP (Adam)": lambda: harness.MAP(task, lr=1e-3, name="MAP (Adam)"),
    }
    if harness.ivon_installed():
        factories["ivon-opt"] = lambda: harness.IVON(task, lr=0.05, hess_init=0.1, beta2=0.99)
    return factories


def plot_predictions(runs, y, path):
    fig, axes = harness.plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.3), sharex=True, sharey=True,
                                     squeeze=False)
    order = torch.argsort(y)
    for ax, (name, (loc, noise_scale)) in zip(axes[0], runs.items()):
        loc = loc.squeeze(-1)[:, order]
        noise = torch.randn((20,) + loc.shape, generator=torch.Generator().manual_seed(0))
        draws = (loc + noise_scale * noise).reshape(-1, loc.shape[1])
        low, high = torch.quantile(draws, torch.tensor([0.05, 0.95]), dim=0).numpy()
        index = torch.arange(len(y)).numpy()
        ax.fill_between(index, low, high, alpha=0.3, label="90 % interval")
        ax.plot(index, loc.mean(0).numpy(), lw=1, label="predictive mean")
        ax.plot(index, y[order].numpy(), "k.", ms=3, label="target")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("test point (sorted by target)")
    axes[0, 0].set_ylabel("standardised target")
    axes[0, 0].legend(fontsize=7)
    return harness.save_figure(fig, path)


def main(argv=None):
    args = harness.parse_bnn_args(NAME, __doc__.strip().splitlines()[0], argv, epochs=100, batch_size=32, samples=64)
    with harness.session(args):
        task = harness.diabetes_mlp(args.seed, prior_scale=args.prior_scale, batch_size=args.batch_size)
        split = task.split
        steps = args.epochs * math.ceil(task.num_data / args.batch_size)
        runs = harness.compare(methods(task, steps), args.epochs,
                               harness.evaluator(task, args.samples, args.samples, seed=args.seed))
        rows, predictions = [], {}
        for name, (method, history) in runs.items():
            outputs = method.predict(split.x_test, args.samples, torch.Generator().manual_seed(args.seed))
            predictions[name] = outputs, method.noise_scale
            rows.append({"method": name, **history.at(args.epochs), "noise": method.noise_scale,
                         "seconds": history.time[-1], "ms_per_step": 1e3 * history.seconds_per_step})
        print()
        print(f"Diabetes, MLP 10-50-1, prior N(0, {args.prior_scale:g}^2), learned noise, {args.epochs} epochs, "
              f"batch {args.batch_size}, {args.samples} posterior samples (N = {task.num_data} train / "
              f"{len(split.x_test)} test; standardised target)")
        print()
        print(harness.markdown_table(rows, [
            ("method", "method", "s"),
            ("rmse", "test RMSE", ".3f"),
            ("loglik", "test log-lik", ".3f"),
            ("coverage50", "50 % cover", ".2f"),
            ("coverage90", "90 % cover", ".2f"),
            ("noise", "noise sigma", ".3f"),
            ("elbo", "final ELBO", ".1f"),
            ("seconds", "train s", ".1f"),
            ("ms_per_step", "ms/step", ".2f"),
        ]))
        figures = [
            harness.plot_training({name: [h] for name, (_, h) in runs.items()}, "loglik", "test log-likelihood",
                                  args.out / "training_curves.png"),
            plot_predictions(predictions, split.y_test, args.out / "predictions.png"),
        ]
        print()
        print("figures: " + ", ".join(str(f) for f in figures))
        return rows


if __name__ == "__main__":
    main()
