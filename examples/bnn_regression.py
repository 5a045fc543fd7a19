"""
A Bayesian MLP (10-50-1) for scikit-learn's diabetes regression, noise learned.

``BayesianNet(net, "gaussian", noise_scale=None)``: y ~ N(f(x; w), sigma^2) with
w ~ N(0, s0^2) element-wise and sigma a point-estimated ``pyro.param``.
Features and target are standardised with the training split's statistics, so
RMSE and log-likelihood are in units of the target's standard deviation.

* NGVI + CurvatureELBO("ggn")  - exact Gauss-Newton diagonal (BackPACK)
* NGVI + CurvatureELBO("ef")   - VOGN's per-example squared gradients
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
from torch import nn

import pyro.optim
from pyro.infer import Trace_ELBO

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # run as a script or imported by path: find _common
    sys.path.insert(0, HERE)
import _common as common  # noqa: E402

from pyro_ngvi import CurvatureELBO  # noqa: E402

NAME = "bnn_regression"

# Settings: a small grid on --seed 1 (the reported runs use --seed 0); the
# learning rates of NGVI are annealed 10x over the run (the single-sample noise
# floor), the noise scale is a point estimate that NGVI hands to its point
# optimiser (Adam). Baselines: Adam lr 0.01 / 0.03 and init_scale 0.01 / 0.1 for
# Bayes-by-Backprop, lr 1e-3 / 3e-3 / 1e-2 for MAP, lr / hess_init for ivon-opt.
NGVI_GGN = dict(lr=(0.05, 0.005), beta=0.1, damping=10.0, point_optim_args={"lr": 1e-2})
NGVI_EF = dict(lr=(0.02, 0.002), beta=0.1, point_optim_args={"lr": 1e-2})
NGVI_INIT_SCALE = 0.1
ADAM_LR = 1e-2
ADAM_INIT_SCALE = 0.01
MAP_LR = 1e-3
IVON = dict(lr=0.05, hess_init=0.1)


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 1))


def plot_predictions(runs, y, path):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.3), sharex=True, sharey=True,
                             squeeze=False)
    order = torch.argsort(y)
    for ax, (name, run) in zip(axes[0], runs.items()):
        loc = run.outputs["test"].reshape(len(run.outputs["test"]), -1)[:, order]
        noise = torch.randn((20,) + loc.shape, generator=torch.Generator().manual_seed(0))
        draws = (loc + run.noise_scale * noise).reshape(-1, loc.shape[1])
        low, high = torch.quantile(draws, torch.tensor([0.05, 0.95]), dim=0).numpy()
        index = torch.arange(len(y)).numpy()
        ax.fill_between(index, low, high, alpha=0.3, label="90 % interval")
        ax.plot(index, loc.mean(0).numpy(), lw=1, label="predictive mean")
        ax.plot(index, y[order].numpy(), "k.", ms=3, label="target")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("test point (sorted by target)")
    axes[0, 0].set_ylabel("standardised target")
    axes[0, 0].legend(fontsize=7)
    return common.save_figure(fig, path)


def main(argv=None):
    parser = common.make_parser(NAME, __doc__.strip().splitlines()[0], epochs=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prior-scale", type=float, default=1.0, help="prior standard deviation s0")
    parser.add_argument("--samples", type=int, default=64, help="posterior samples per prediction")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.samples = min(args.epochs, 2), min(args.samples, 8)

    with common.session(args):
        from sklearn.datasets import load_diabetes

        split = common.load_split(load_diabetes, classification=False, seed=args.seed)
        task = common.BNNTask(
            split, "gaussian", make_net, args.prior_scale, args.batch_size, args.epochs,
            score=lambda outputs, noise: common.regression_metrics(outputs, noise, split.y_test),
            inputs={"test": split.x_test}, seed=args.seed,
            eval_samples=args.samples, final_samples=args.samples,
        )
        steps = args.epochs * math.ceil(split.num_train / args.batch_size)
        runs = {
            "NGVI (ggn)": common.run_pyro(task, "NGVI (ggn)", common.ngvi(NGVI_GGN, steps), CurvatureELBO("ggn"),
                                          NGVI_INIT_SCALE),
            "NGVI (ef)": common.run_pyro(task, "NGVI (ef)", common.ngvi(NGVI_EF, steps), CurvatureELBO("ef"),
                                         NGVI_INIT_SCALE),
            "BBB (Adam)": common.run_pyro(task, "BBB (Adam)", pyro.optim.Adam({"lr": ADAM_LR}), Trace_ELBO(),
                                          ADAM_INIT_SCALE),
            "MAP (Adam)": common.run_map(task, "MAP (Adam)", MAP_LR),
        }
        if common.ivon is not None:
            runs["ivon-opt"] = common.run_ivon(task, "ivon-opt", **IVON)
        else:
            print("ivon-opt is not installed: skipping that baseline (pip install ivon-opt)")

        rows = []
        for name, run in runs.items():
            row = {"method": name, **common.regression_metrics(run.outputs["test"], run.noise_scale, split.y_test)}
            row["noise"] = run.noise_scale
            row["elbo"] = run.history.elbo[-1] if run.history.objective == "ELBO" else None
            row["seconds"] = run.history.time[-1]
            row["ms_per_step"] = 1e3 * run.history.seconds_per_step
            rows.append(row)
        print()
        print(f"Diabetes, MLP 10-50-1, prior N(0, {args.prior_scale:g}^2), learned noise, {args.epochs} epochs, "
              f"batch {args.batch_size}, {args.samples} posterior samples (N = {split.num_train} train / "
              f"{len(split.x_test)} test; standardised target)")
        print()
        print(common.markdown_table(rows, [
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
            common.plot_training([run.history for run in runs.values()], "loglik", "test log-likelihood",
                                 args.out / "training_curves.png"),
            plot_predictions(runs, split.y_test, args.out / "predictions.png"),
        ]
        print()
        print("figures: " + ", ".join(str(f) for f in figures))
        return rows


if __name__ == "__main__":
    main()
