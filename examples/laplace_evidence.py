"""
Choosing a prior precision by the Laplace evidence, and what the held-out data say.

Two models, one scalar prior precision ``alpha`` on the weights, a grid of values:

* **diabetes** (scikit-learn ``load_diabetes``): Bayesian linear regression on
  the standardised features, ``w ~ N(0, 1/alpha)``, a bias ``~ N(0, 10^2)``,
  a noise scale ``sigma ~ LogNormal(0, 1)`` (a positive site: its Laplace
  approximation lives in ``log sigma``), curvature ``"hessian"``.
* **digits** (``load_digits``, 8x8 images): an MLP 64-32-10 as a
  :class:`~pyro_ngvi.BayesianNet`, ``w ~ N(0, 1/alpha)`` on every weight,
  curvature ``"ggn"`` (BackPACK), a short deterministic NGVI run per ``alpha``
  (warm-started from the previous one, strongest prior first).

For each ``alpha`` :func:`pyro_ngvi.laplace.optimize_prior_precision` finds the
mode and the diagonal Laplace log evidence; the script then evaluates the
held-out negative log-likelihood per example of the Laplace posterior predictive
(``Predictive`` with the Laplace guide, Monte Carlo) and of the MAP plug-in
predictive. It prints one table per data set and saves ``laplace_evidence.png``
(evidence and test NLL against ``alpha``) under ``--out``.

Usage::

    python examples/laplace_evidence.py [--out out/laplace] [--quick] [--threads 1] [--seed 0]
"""

import argparse
import os
import sys
import time
import warnings

import torch
from torch import nn
from tqdm import tqdm

import pyro
import pyro.distributions as dist
from pyro.infer import Predictive

from pyro_ngvi import BayesianNet, LaplaceWarning, optimize_prior_precision
from pyro_ngvi.metrics import gaussian_log_likelihood, nll, predictive_probs_from_logits

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as a script or imported by path: find the harness
    sys.path.insert(0, HERE)
import harness  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default="out/laplace", help="output folder (default: out/laplace)")
    parser.add_argument("--quick", action="store_true", help="a few candidates and steps: a smoke test")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def split(x, y, num_train, seed):
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = perm[:num_train], perm[num_train:]
    return x[train], y[train], x[test], y[test]


# ---------------------------------------------------------------- diabetes
def diabetes_data(seed):
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    x_train, y_train, x_test, y_test = split(x, y, 300, seed)
    mean, std = x_train.mean(0), x_train.std(0)
    y_mean, y_std = y_train.mean(), y_train.std()
    return ((x_train - mean) / std, (y_train - y_mean) / y_std, (x_test - mean) / std, (y_test - y_mean) / y_std)


def make_regression(alpha):
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, alpha**-0.5).expand([x.shape[-1]]).to_event(1))
        bias = pyro.sample("bias", dist.Normal(0.0, 10.0))
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        mean = pyro.deterministic("mean", x @ w + bias)
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(mean, sigma), obs=y)

    return model


def diabetes_test_nll(result, model, x_test, y_test, num_samples):
    """Laplace predictive and MAP plug-in NLL per example (standardised units)."""
    samples = Predictive(model, guide=result.guide, num_samples=num_samples, return_sites=["mean", "sigma"])(x_test)
    means = samples["mean"].reshape(num_samples, len(y_test))
    sigmas = samples["sigma"].reshape(num_samples, 1)
    laplace_nll = -float(gaussian_log_likelihood(means, sigmas, y_test))
    median = result.guide.median()
    map_mean = x_test @ median["w"] + median["bias"]
    map_nll = -float(torch.distributions.Normal(map_mean, median["sigma"]).log_prob(y_test).mean())
    return laplace_nll, map_nll


# ------------------------------------------------------------------ digits
def digits_data(seed, num_train):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    return split(x, y, num_train, seed)


def digits_test_nll(result, model, x_test, y_test, num_samples):
    logits = Predictive(model, guide=result.guide, num_samples=num_samples, return_sites=["output"])(x_test)["output"]
    laplace_nll = float(nll(predictive_probs_from_logits(logits), y_test))
    with torch.no_grad():
        for weight in model._latents:  # the MAP network
            weight.param.copy_(result.map[weight.site])
        map_nll = float(nn.functional.cross_entropy(model.net(x_test), y_test))
    return laplace_nll, map_nll


# ---------------------------------------------------------------- experiment
def run(name, make_model, candidates, data, test_nll, progress, num_samples, **laplace_kwargs):
    """Select alpha by the evidence; score every candidate on the test split as it is fitted."""
    x_train, y_train, x_test, y_test = data
    rows = []
    clock = [time.perf_counter()]

    def score(alpha, result):
        seconds = time.perf_counter() - clock[0]
        laplace_nll, map_nll = test_nll(result, make_model(alpha), x_test, y_test, num_samples)
        rows.append(
            {
                "alpha": alpha,
                "log_evidence": result.log_evidence,
                "per_example": result.log_evidence / len(x_train),
                "laplace_nll": laplace_nll,
                "map_nll": map_nll,
                "steps": result.num_steps,
                "newton_step": result.newton_step,
                "seconds": seconds,
            }
        )
        progress.set_postfix_str(f"{name} alpha={alpha:g}")
        progress.update()
        clock[0] = time.perf_counter()

    with warnings.catch_warnings():
        # a short run on a network stops before tol; the table reports how far (Newton step)
        warnings.simplefilter("ignore", LaplaceWarning)
        search = optimize_prior_precision(
            make_model, candidates, x_train, y_train, callback=score, **laplace_kwargs
        )
    return search.best, rows


def print_table(name, best_evidence, rows, num_train):
    best_nll = min(rows, key=lambda r: r["laplace_nll"])["alpha"]
    print(f"\n### {name} (N = {num_train}; * best evidence, + best Laplace test NLL)\n")
    print("| alpha | log evidence | per example | test NLL (Laplace) | test NLL (MAP) | steps | Newton step (std) | s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mark = ("*" if r["alpha"] == best_evidence else "") + ("+" if r["alpha"] == best_nll else "")
        print(
            f"| {r['alpha']:g}{mark} | {r['log_evidence']:.2f} | {r['per_example']:.4f} | {r['laplace_nll']:.4f} | "
            f"{r['map_nll']:.4f} | {r['steps']} | {r['newton_step']:.2g} | {r['seconds']:.1f} |"
        )


def plot(results, path):
    fig, axes = harness.plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, (_, rows)) in zip(axes[0], results.items()):
        alphas = [r["alpha"] for r in rows]
        ax.plot(alphas, [r["per_example"] for r in rows], "o-", color="C0", label="log evidence / N")
        ax.set_xscale("log")
        ax.set_xlabel("prior precision alpha")
        ax.set_ylabel("Laplace log evidence per example", color="C0")
        best = max(rows, key=lambda r: r["log_evidence"])["alpha"]  # what optimize_prior_precision chose
        ax.axvline(best, color="C0", linestyle=":", linewidth=1)
        twin = ax.twinx()
        twin.plot(alphas, [r["laplace_nll"] for r in rows], "s-", color="C1", label="test NLL, Laplace predictive")
        twin.plot(alphas, [r["map_nll"] for r in rows], "^--", color="C2", label="test NLL, MAP plug-in")
        twin.set_ylabel("test NLL per example")
        ax.set_title(name)
        lines = ax.get_lines()[:1] + twin.get_lines()
        ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="best")
    harness.save_figure(fig, path)


def main(argv=None):
    """Run both experiments; returns ``{title: (alpha chosen by the evidence, rows)}``."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    pyro.set_rng_seed(args.seed)
    quick = args.quick

    diabetes_alphas = [1e2, 1.0, 1e-2] if quick else [1e3, 1e2, 3e1, 1e1, 1.0, 1e-1, 1e-2]
    digits_alphas = [30.0, 3.0] if quick else [100.0, 30.0, 10.0, 3.0, 1.0]
    num_digits_train = 300 if quick else 1000
    total = len(diabetes_alphas) + len(digits_alphas)
    start = time.perf_counter()
    results = {}
    with tqdm(total=total, desc="laplace evidence") as progress:
        pyro.clear_param_store()
        results["diabetes: Bayesian linear regression"] = run(
            "diabetes", make_regression, diabetes_alphas, diabetes_data(args.seed), diabetes_test_nll, progress,
            num_samples=50 if quick else 300, curvature="hessian", num_steps=20 if quick else 200,
            lr=3.0, momentum=0.8, tol=1e-2,
        )

        pyro.clear_param_store()
        torch.manual_seed(args.seed)
        net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
        data = digits_data(args.seed, num_digits_train)

        def make_net(alpha):
            return BayesianNet(net, "categorical", num_data=num_digits_train, prior=alpha**-0.5)

        results["digits: MLP 64-32-10 (BayesianNet)"] = run(
            "digits", make_net, digits_alphas, data, digits_test_nll, progress,
            num_samples=20 if quick else 100, curvature="ggn", num_steps=20 if quick else 120,
            lr=0.1, momentum=0.9, tol=1e-3,
        )

    for name, (best, rows) in results.items():
        n = 300 if name.startswith("diabetes") else num_digits_train
        print_table(name, best, rows, n)
    path = os.path.join(args.out, "laplace_evidence.png")
    plot(results, path)
    print(f"\nfigure: {path}; total {time.perf_counter() - start:.0f} s")
    return results


if __name__ == "__main__":
    main()
