"""
Eight schools (Rubin 1981), non-centred, with NGVI, Adam and a NUTS reference.

    mu ~ N(0, 5),  tau ~ HalfCauchy(5),  theta_tilde_j ~ N(0, 1),
    y_j ~ N(mu + tau * theta_tilde_j, sigma_j),   j = 1..8

A mean-field ``AutoNormal`` guide (``tau`` in log space), full-batch steps:

* NGVI + Trace_ELBO                - curvature from the ordinary gradients
* NGVI + CurvatureELBO("reparam")  - the same estimate, Normal priors exact
* pyro.optim.Adam + Trace_ELBO

and Pyro's own NUTS (``pyro.infer.MCMC``) as the reference. Prints the
posterior mean and standard deviation of mu, tau and theta_j = mu + tau *
theta_tilde_j for each, and the ELBO summary (final, steps to within 1 nat of
the best); saves ``elbo.png`` and ``posteriors.png`` into ``--out``. A mean-field
Gaussian cannot follow the funnel between tau and theta: expect VI to
underestimate the spread of tau and of the theta_j against NUTS, whichever
optimiser fits it.

Usage::

    python examples/hierarchical.py [--epochs 500] [--warmup 500] [--samples 500] [--quick]

(``--epochs`` counts full-batch steps here.)
"""

import sys
import warnings
from pathlib import Path

import torch

import pyro
import pyro.distributions as dist
import pyro.optim
from pyro.infer import MCMC, NUTS, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # run as a script or imported by path: find the harness
    sys.path.insert(0, HERE)
import harness  # noqa: E402

from pyro_ngvi import NGVI, CurvatureELBO  # noqa: E402

NAME = "hierarchical"
Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])

# Settings: tried on --seed 1 (the reported run uses --seed 0), 1000 steps.
# NGVI: lr / beta decaying from 0.2, 0.3 or 0.5 (all reach the same ELBO; a
# decaying lr removes the single-sample noise floor). Adam: lr 0.02 / 0.05 / 0.1,
# 0.05 the quickest to settle.
NGVI_ARGS = dict(lr=harness.decaying(0.3, 0.01, 20), beta=harness.decaying(0.3, 0.02, 20))
ADAM_LR = 0.05


def model(sigma, y=None):
    """Non-centred eight schools; broadcasts over leading particle dimensions."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", sigma.shape[-1]):
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * theta_tilde)
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def summarise(samples) -> dict:
    """``{"mu": (mean, sd), "tau": ..., "theta[1]": ...}`` from draws of mu, tau, theta."""
    out = {}
    for name in ("mu", "tau"):
        values = samples[name].reshape(-1)
        out[name] = (float(values.mean()), float(values.std()))
    theta = samples["theta"].reshape(-1, len(SIGMA))
    for j in range(theta.shape[1]):
        out[f"theta[{j + 1}]"] = (float(theta[:, j].mean()), float(theta[:, j].std()))
    return out


def run_nuts(warmup: int, num_samples: int) -> dict:
    """Pyro's NUTS, the model's potential JIT-compiled (about 2.5x faster here)."""
    kernel = NUTS(model, jit_compile=True, ignore_jit_warnings=True)
    mcmc = MCMC(kernel, warmup_steps=warmup, num_samples=num_samples)
    with warnings.catch_warnings():
        # recent torch marks torch.jit.trace (what Pyro's jit_compile uses) as deprecated
        warnings.filterwarnings("ignore", message="`torch.jit.trace` is deprecated", category=FutureWarning)
        mcmc.run(SIGMA, Y)
    samples = mcmc.get_samples()
    samples["theta"] = samples["mu"].unsqueeze(-1) + samples["tau"].unsqueeze(-1) * samples["theta_tilde"]
    return samples


def plot_posteriors(summaries: dict, tau_samples: dict, path: Path) -> Path:
    fig, (left, right) = harness.plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2.2, 1]})
    names = list(next(iter(summaries.values())))
    width = 0.8 / len(summaries)
    for k, (method, summary) in enumerate(summaries.items()):
        x = torch.arange(len(names)).numpy() + (k - (len(summaries) - 1) / 2) * width
        means = [summary[n][0] for n in names]
        sds = [summary[n][1] for n in names]
        left.errorbar(x, means, yerr=sds, fmt="o", ms=3, capsize=2, label=method)
    left.set_xticks(range(len(names)), names, rotation=45)
    left.set_ylabel("posterior mean +- sd")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    bins = torch.linspace(0, 25, 50).numpy()
    for method, values in tau_samples.items():
        right.hist(values.reshape(-1).clamp(max=25).numpy(), bins=bins, density=True, histtype="step",
                   label=method)
    right.set_xlabel("tau")
    right.set_ylabel("density")
    right.legend(fontsize=7)
    return harness.save_figure(fig, path)


def main(argv=None):
    parser = harness.make_parser(NAME, __doc__.strip().splitlines()[0], epochs=500, unit="steps")
    parser.add_argument("--warmup", type=int, default=500, help="NUTS warm-up steps")
    parser.add_argument("--samples", type=int, default=500, help="NUTS samples")
    parser.add_argument("--elbo-samples", type=int, default=1000, help="samples per ELBO estimate")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.warmup, args.samples = min(args.epochs, 20), min(args.warmup, 30), min(args.samples, 30)
        args.elbo_samples = min(args.elbo_samples, 200)

    with harness.session(args):
        data = (SIGMA, Y)
        methods = {
            "NGVI + Trace_ELBO": (lambda: NGVI(**NGVI_ARGS), Trace_ELBO()),
            "NGVI + reparam": (lambda: NGVI(**NGVI_ARGS), CurvatureELBO("reparam")),
            "Adam + Trace_ELBO": (lambda: pyro.optim.Adam({"lr": ADAM_LR}), Trace_ELBO()),
        }
        histories, draws = {}, {}
        for name, (optim, loss) in methods.items():
            harness.seed(args.seed)
            guide = AutoNormal(model)
            histories[name] = harness.run_full_batch(name, model, guide, optim(), loss, data, args.epochs,
                                                    args.elbo_samples)
            predictive = Predictive(model, guide=guide, num_samples=4000, return_sites=["mu", "tau", "theta"],
                                    parallel=True)
            with torch.no_grad():
                draws[name] = predictive(SIGMA)
        harness.seed(args.seed)
        draws["NUTS"] = run_nuts(args.warmup, args.samples)

        summaries = {"NUTS": summarise(draws["NUTS"])}
        summaries.update({name: summarise(draws[name]) for name in methods})
        rows = [{"parameter": p, **{m: "{:.2f} +- {:.2f}".format(*s[p]) for m, s in summaries.items()}}
                for p in summaries["NUTS"]]
        print()
        print(f"Eight schools, non-centred: posterior mean +- sd (NUTS: {args.warmup} warm-up + {args.samples} "
              f"samples; VI: {args.epochs} steps, 4000 guide samples)")
        print()
        print(harness.markdown_table(rows, [("parameter", "parameter", "s")] + [(m, m, "s") for m in summaries]))

        best = max(max(h.scores["elbo"]) for h in histories.values())
        elbo_rows = []
        for name, history in histories.items():
            reached = harness.steps_to_within(history, best, 1.0)
            elbo_rows.append({
                "method": name,
                "final": history.scores["elbo"][-1],
                "steps": "not reached" if reached is None else str(reached),
                "ms_per_step": 1e3 * history.seconds_per_step,
            })
        print()
        print(f"ELBO ({args.elbo_samples} samples per estimate; best over all runs {best:.2f})")
        print()
        print(harness.markdown_table(elbo_rows, [
            ("method", "method", "s"),
            ("final", "final ELBO", ".2f"),
            ("steps", "steps to best - 1 nat", "s"),
            ("ms_per_step", "ms/step", ".2f"),
        ]))
        figures = [
            harness.plot_elbo_curves({n: (h.epoch, h.scores["elbo"]) for n, h in histories.items()},
                                    args.out / "elbo.png", best=best),
            plot_posteriors(summaries, {m: draws[m]["tau"] for m in summaries}, args.out / "posteriors.png"),
        ]
        print()
        print("figures: " + ", ".join(str(f) for f in figures))
        return {"posterior": summaries, "elbo": elbo_rows}


if __name__ == "__main__":
    main()
