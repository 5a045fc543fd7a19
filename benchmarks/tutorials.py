"""
Pyro's tutorial models, rewritten small, trained with ``NGVI()`` swapped in for the tutorial's
own Adam for the same number of steps, each against a reference.

Tutorials (``--tutorials``), the tutorial's Adam and steps, and the reference:

- ``regression``: Bayesian Regression part 1, ``PyroModule[nn.Linear]`` with ``PyroSample`` priors
  w ~ N(0, 1), b ~ N(0, 10), diabetes (3 standardised features, y / 50), ``AutoDiagonalNormal``;
  Adam lr 0.03, 1500 steps. Closed form: with the noise sigma fixed (at the least-squares residual
  sd) the posterior is N(L^-1 X^T y / sigma^2, L^-1), L = diag(prior precisions) + X^T X / sigma^2,
  and the mean-field optimum has its mean and the sds 1 / sqrt(L_ii).
- ``part2``: part 2's hand-written guide (a, bA, bR, bAR Normal; sigma ~ Uniform(0, 10) with the
  guide N(s, 0.05^2), s a positive param), diabetes with sex as the binary feature and bmi; Adam
  lr 0.05, 5000 steps. Closed form in one dimension: given tau = E_q[1 / sigma^2] the weights'
  optimum is the line above with tau; the ELBO is then a function of s alone (``part2_reference``).
- ``coin``: SVI part I/II, Beta(10, 10) prior, 6 heads in 10, a Beta guide (NGVI's point optimizer);
  Adam lr 5e-4, betas (0.9, 0.999), 5000 steps. Closed form: Beta(16, 14) is in the guide's family.
- ``gmm_delta``: the Gaussian mixture tutorial (K = 2, 5 points, ``config_enumerate``,
  ``TraceEnum_ELBO``, ``AutoDelta`` on the globals, best of 20 starts); Adam lr 0.1, betas
  (0.8, 0.99), 200 steps. Reference: the same deterministic loss minimised by L-BFGS from the same
  start; error: the loss gap in nats.
- ``gmm_normal``: the same with ``AutoNormal``. Reference: a long run (ClippedAdam 0.05 -> 0.0005
  over 3000 steps, 16 particles); error: the ELBO gap in nats (4000 draws, the same for all).
- ``vae``: the VAE tutorial on binarised scikit-learn digits (z 4, hidden 64, batch 128, 1500
  training images); Adam lr 1e-3, 600 steps (50 epochs). No reference: the test ELBO per image
  (higher is better; 20 passes over 297 test images, fixed draws).
- ``hier``: varying intercepts (20 groups, 400 points, the data plate subsampled to 100),
  ``AutoNormal``; Adam lr 0.03 (part 1's), 2000 steps. Reference: a long run (full data, 8
  particles, ClippedAdam 0.02 -> 0.0004 over 6000 steps).
- ``eight``: eight schools, non-centred, the schools plate subsampled to 4,
  ``AutoNormal(create_plates=...)``; Adam lr 0.03 (part 1's), 2000 steps. Reference: a long run
  (16 particles, ClippedAdam 0.02 -> 0.0002 over 5000 steps).

For a Gaussian guide "error" is max over the latent coordinates of |guide mean - reference mean| /
reference sd (for ``AutoNormal`` in the unconstrained space), "scales" the worst |guide sd /
reference sd - 1|. Each tutorial runs ``NGVI()`` (no argument) and the tutorial's Adam for the same
steps and seed, one after the other, in one thread; ms per step is timed apart: both optimizers from seed 0, 20
steps each, then 12 rounds of 25 steps of each in turn (their param stores swapped), the median of
the blocks' mean step times (load from other processes hits both alike); the
warnings are those of the NGVI runs (``NGVIWarning`` and subclasses). Several seeds give the median
error and, in brackets, the worst. ``--quick`` (under a minute) runs a tenth of the steps and of the
reference runs, to check the script, not to read its numbers.

Usage::

    python benchmarks/tutorials.py [--tutorials regression coin ...] [--steps N] [--seeds 1]
        [--quick] [--out benchmarks/results/tutorials.md]
"""

import argparse
import datetime
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.nn as nn

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample
from pyro.ops.indexing import Vindex

from pyro_ngvi import NGVI, NGVIWarning

PHI_1 = 0.8413447460685429  # the standard normal's cdf at 1: quantiles at 1 - PHI_1, PHI_1 are loc -+ scale


def diabetes():
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), torch.tensor(y, dtype=torch.float32) / 50.0


def worst(est: Dict[str, Tuple[torch.Tensor, torch.Tensor]], ref: Dict[str, Tuple[torch.Tensor, torch.Tensor]]):
    """max |m - m_ref| / s_ref and max |s / s_ref - 1| over every coordinate of every site."""
    err = max(((est[k][0].double() - ref[k][0].double()).abs() / ref[k][1].double()).max().item() for k in ref)
    sc = max((est[k][1].double() / ref[k][1].double() - 1).abs().max().item() for k in ref)
    return err, sc


# ------------------------------------------------------------------ regression (part 1)
class Regression(PyroModule):
    """The tutorial's model with the noise fixed: y ~ N(x w + b, sigma^2), w ~ N(0, 1), b ~ N(0, 10^2)."""

    def __init__(self, sigma: float):
        super().__init__()
        self.sigma = sigma
        self.linear = PyroModule[nn.Linear](3, 1)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, self.sigma), obs=y)
        return mean


def regression_data():
    x, y = diabetes()
    x = x[:, [2, 3, 8]]
    design = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    coef = torch.linalg.lstsq(design, y.double().unsqueeze(-1)).solution.squeeze(-1)
    sigma = float((y.double() - design @ coef).pow(2).sum().div(len(y) - 4).sqrt())  # least-squares residual sd
    return x, y, sigma


def regression_reference(quick: bool):
    x, y, sigma = regression_data()
    design = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    precision = torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.01], dtype=torch.float64)) + design.T @ design / sigma ** 2
    mean = torch.linalg.solve(precision, design.T @ y.double() / sigma ** 2)
    sd = precision.diagonal().rsqrt()
    return {"linear.weight": (mean[:3], sd[:3]), "linear.bias": (mean[3:], sd[3:])}


def regression_run(optim, seed: int):
    x, y, sigma = regression_data()
    model = Regression(sigma)
    guide = AutoDiagonalNormal(model)
    svi = SVI(model, guide, optim, loss=Trace_ELBO())

    def score(ref):
        with torch.no_grad():
            q = guide.quantiles([1 - PHI_1, PHI_1], x, y)
        est = {k: (((q[k][1] + q[k][0]) / 2).reshape(-1), ((q[k][1] - q[k][0]) / 2).reshape(-1)) for k in ref}
        return worst(est, ref)
    return lambda: svi.step(x, y), score


# ------------------------------------------------------------------ regression part 2, hand-written guide
SIGMA_SD = 0.05  # the guide's fixed sd of sigma


def part2_data():
    x, y = diabetes()
    is_a, r = (x[:, 1] > 0).float(), x[:, 2]  # sex as the binary 'is_cont_africa', bmi as 'ruggedness'
    return is_a, r, y


def part2_model(is_a, r, y):
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    b_a = pyro.sample("bA", dist.Normal(0.0, 1.0))
    b_r = pyro.sample("bR", dist.Normal(0.0, 1.0))
    b_ar = pyro.sample("bAR", dist.Normal(0.0, 1.0))
    sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
    mean = a + b_a * is_a + b_r * r + b_ar * is_a * r
    with pyro.plate("data", len(r)):
        pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


def part2_guide(is_a, r, y):
    a_loc = pyro.param("a_loc", torch.tensor(0.0))
    a_scale = pyro.param("a_scale", torch.tensor(1.0), constraint=constraints.positive)
    sigma_loc = pyro.param("sigma_loc", torch.tensor(1.0), constraint=constraints.positive)
    weights_loc = pyro.param("weights_loc", torch.randn(3))
    weights_scale = pyro.param("weights_scale", torch.ones(3), constraint=constraints.positive)
    pyro.sample("a", dist.Normal(a_loc, a_scale))
    pyro.sample("bA", dist.Normal(weights_loc[0], weights_scale[0]))
    pyro.sample("bR", dist.Normal(weights_loc[1], weights_scale[1]))
    pyro.sample("bAR", dist.Normal(weights_loc[2], weights_scale[2]))
    pyro.sample("sigma", dist.Normal(sigma_loc, torch.tensor(SIGMA_SD)))


def part2_reference(quick: bool):
    """The ELBO of the mean-field family, maximised over everything but s in closed form:
    with tau = E[1/sigma^2], m = L^-1 tau X^T y, v_j = 1 / L_jj (L = Lambda_0 + tau X^T X) and
    f(s) = -n E[log sigma] - tau/2 (|y - X m|^2 + sum_j v_j |X_j|^2) - 1/2 sum_j lambda_j (m_j^2 + v_j)
    + 1/2 sum_j log v_j (constants dropped), E over sigma ~ N(s, 0.05^2) by 60-point Gauss-Hermite."""
    from scipy.optimize import minimize_scalar

    is_a, r, y = part2_data()
    design = torch.stack([torch.ones_like(r), is_a, r, is_a * r], 1).double()
    y = y.double()
    lam = torch.tensor([0.01, 1.0, 1.0, 1.0], dtype=torch.float64)
    nodes, weights = np.polynomial.hermite_e.hermegauss(60)
    weights = weights / weights.sum()

    def solve(s: float):
        sig = s + SIGMA_SD * nodes
        tau = float((weights / sig ** 2).sum())
        precision = torch.diag(lam) + tau * design.T @ design
        m = torch.linalg.solve(precision, tau * design.T @ y)
        v = 1 / precision.diagonal()
        f = (-len(y) * float((weights * np.log(sig)).sum())
             - tau / 2 * float((y - design @ m).pow(2).sum() + (v * design.pow(2).sum(0)).sum())
             - 0.5 * float((lam * (m ** 2 + v)).sum()) + 0.5 * float(v.log().sum()))
        return f, m, v.sqrt()

    s = minimize_scalar(lambda s: -solve(s)[0], bounds=(0.3, 5.0), method="bounded",
                        options={"xatol": 1e-9}).x
    _, m, sd = solve(s)
    return {"a": (m[:1], sd[:1]), "weights": (m[1:], sd[1:]),
            "sigma": (torch.tensor([s]), torch.tensor([SIGMA_SD]))}


def part2_run(optim, seed: int):
    data = part2_data()
    svi = SVI(part2_model, part2_guide, optim, loss=Trace_ELBO())

    def score(ref):
        p = {k: v.detach() for k, v in pyro.get_param_store().items()}
        est = {"a": (p["a_loc"].reshape(1), p["a_scale"].reshape(1)),
               "weights": (p["weights_loc"], p["weights_scale"]),
               "sigma": (p["sigma_loc"].reshape(1), torch.tensor([SIGMA_SD]))}
        return worst(est, ref)
    return lambda: svi.step(*data), score


# ------------------------------------------------------------------ coin (SVI part I/II)
COIN = torch.cat([torch.ones(6), torch.zeros(4)])


def coin_model(data):
    f = pyro.sample("latent_fairness", dist.Beta(torch.tensor(10.0), torch.tensor(10.0)))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Bernoulli(f), obs=data)


def coin_guide(data):
    a = pyro.param("alpha_q", torch.tensor(15.0), constraint=constraints.positive)
    b = pyro.param("beta_q", torch.tensor(15.0), constraint=constraints.positive)
    pyro.sample("latent_fairness", dist.Beta(a, b))


def beta_mean_sd(a: float, b: float):
    return a / (a + b), math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))


def coin_reference(quick: bool):
    mean, sd = beta_mean_sd(16.0, 14.0)  # Beta(10 + 6, 10 + 4)
    return {"f": (torch.tensor([mean]), torch.tensor([sd]))}


def coin_run(optim, seed: int):
    svi = SVI(coin_model, coin_guide, optim, loss=Trace_ELBO())

    def score(ref):
        mean, sd = beta_mean_sd(pyro.param("alpha_q").item(), pyro.param("beta_q").item())
        return worst({"f": (torch.tensor([mean]), torch.tensor([sd]))}, ref)
    return lambda: svi.step(COIN), score


# ------------------------------------------------------------------ Gaussian mixture
GMM_DATA = torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0])


def gmm_model(data, vindex: bool = False):
    weights = pyro.sample("weights", dist.Dirichlet(0.5 * torch.ones(2)))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 2.0))
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(data)):
        assignment = pyro.sample("assignment", dist.Categorical(weights))
        loc = Vindex(locs.unsqueeze(-2))[..., assignment] if vindex else locs[assignment]
        pyro.sample("obs", dist.Normal(loc, scale), obs=data)


gmm_enum = config_enumerate(gmm_model)
gmm_enum_vectorised = config_enumerate(lambda data: gmm_model(data, vindex=True))


def gmm_guide(guide_cls):
    """The tutorial's start: of 20 seeded initialisations, the one of lowest loss."""
    def init_loc_fn(site):
        if site["name"] == "weights":
            return torch.ones(2) / 2
        if site["name"] == "scale":
            return (GMM_DATA.var() / 2).sqrt()
        return GMM_DATA[torch.multinomial(torch.ones(5) / 5, 2)]

    elbo = TraceEnum_ELBO(max_plate_nesting=1)

    def initialise(seed):
        pyro.set_rng_seed(seed)
        pyro.clear_param_store()
        guide = guide_cls(poutine.block(gmm_enum, expose=["weights", "locs", "scale"]), init_loc_fn=init_loc_fn)
        return elbo.loss(gmm_enum, guide, GMM_DATA), guide
    best = min(range(20), key=lambda s: initialise(s)[0])
    return initialise(best)[1], elbo


def gmm_elbo(guide, particles: int = 4000) -> float:
    pyro.set_rng_seed(1)
    ev = TraceEnum_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    with torch.no_grad():
        return -ev.loss(gmm_enum_vectorised, guide, GMM_DATA)


def gmm_delta_reference(quick: bool):
    guide, elbo = gmm_guide(AutoDelta)
    params = list(guide.parameters())
    lbfgs = torch.optim.LBFGS(params, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                              line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        loss = elbo.differentiable_loss(gmm_enum, guide, GMM_DATA)
        loss.backward()
        return loss
    lbfgs.step(closure)
    return -elbo.loss(gmm_enum, guide, GMM_DATA)


def gmm_delta_run(optim, seed: int):
    guide, elbo = gmm_guide(AutoDelta)
    pyro.set_rng_seed(seed)
    svi = SVI(gmm_enum, guide, optim, loss=elbo)
    return lambda: svi.step(GMM_DATA), lambda ref: (ref + elbo.loss(gmm_enum, guide, GMM_DATA), None)


def gmm_normal_reference(quick: bool):
    steps = 300 if quick else 3000
    guide, _ = gmm_guide(AutoNormal)
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=16, vectorize_particles=True)
    svi = SVI(gmm_enum_vectorised, guide, pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.01 ** (1 / steps)}), elbo)
    for _ in range(steps):
        svi.step(GMM_DATA)
    return gmm_elbo(guide)


def gmm_normal_run(optim, seed: int):
    guide, elbo = gmm_guide(AutoNormal)
    pyro.set_rng_seed(seed)
    svi = SVI(gmm_enum, guide, optim, loss=elbo)
    return lambda: svi.step(GMM_DATA), lambda ref: (ref - gmm_elbo(guide), None)


# ------------------------------------------------------------------ VAE
class VAE(nn.Module):
    """The tutorial's VAE: softplus MLPs, z ~ N(0, I_4), Bernoulli pixels, 64 -> 64 -> 4."""

    def __init__(self, d: int = 64, h: int = 64, z: int = 4):
        super().__init__()
        self.z = z
        self.decoder = nn.Sequential(nn.Linear(z, h), nn.Softplus(), nn.Linear(h, d), nn.Sigmoid())
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.Softplus())
        self.enc_loc, self.enc_scale = nn.Linear(h, z), nn.Linear(h, z)

    def model(self, x):
        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("latent", dist.Normal(x.new_zeros(x.shape[0], self.z), 1.0).to_event(1))
            pyro.sample("obs", dist.Bernoulli(self.decoder(z), validate_args=False).to_event(1), obs=x)

    def guide(self, x):
        pyro.module("encoder", self)  # the encoder's layers (the decoder's params are the model's)
        with pyro.plate("data", x.shape[0]):
            hidden = self.encoder(x)
            pyro.sample("latent", dist.Normal(self.enc_loc(hidden), self.enc_scale(hidden).exp()).to_event(1))


def digits():
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data > 8, dtype=torch.float32)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm[:1500]], x[perm[1500:]]


def vae_run(optim, seed: int):
    train, test = digits()
    vae = VAE()
    svi = SVI(vae.model, vae.guide, optim, loss=Trace_ELBO())
    batches: List[torch.Tensor] = []

    def step():
        if not batches:
            batches.extend(torch.randperm(len(train)).split(128))
        svi.step(train[batches.pop(0)])

    def score(ref):
        pyro.set_rng_seed(123)
        with torch.no_grad():
            return -sum(svi.evaluate_loss(test) for _ in range(20)) / 20 / len(test), None
    return step, score


# ------------------------------------------------------------------ varying intercepts, subsampled
def hier_data():
    g = torch.Generator().manual_seed(0)
    county = torch.randint(0, 20, (400,), generator=g)
    x = torch.randint(0, 2, (400,), generator=g).float()
    a_true = 1.5 + 0.6 * torch.randn(20, generator=g)
    y = a_true[county] - 0.7 * x + 0.8 * torch.randn(400, generator=g)
    return county, x, y


def hier_model(county, x, y, subsample=100):
    mu_a = pyro.sample("mu_a", dist.Normal(0.0, 10.0))
    sigma_a = pyro.sample("sigma_a", dist.HalfNormal(5.0))
    beta = pyro.sample("beta", dist.Normal(0.0, 10.0))
    sigma_y = pyro.sample("sigma_y", dist.HalfNormal(5.0))
    with pyro.plate("county", 20):
        a = pyro.sample("a", dist.Normal(mu_a, sigma_a))
    with pyro.plate("data", len(x), subsample_size=subsample) as ind:
        pyro.sample("obs", dist.Normal(a[..., county[ind]] + beta * x[ind], sigma_y), obs=y[ind])


def long_run(model, guide, args, steps: int, lr: float, final: float, particles: int):
    """The reference: ClippedAdam decayed from lr to lr * final over the run, vectorised particles."""
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    elbo = Trace_ELBO(num_particles=particles, vectorize_particles=True)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": lr, "lrd": final ** (1 / steps)}), elbo)
    for _ in range(steps):
        svi.step(*args)
    return autonormal_params(guide)


def autonormal_params(guide):
    """An AutoNormal's unconstrained (loc, scale) per site, flattened."""
    return {name: (getattr(guide.locs, name).detach().clone().reshape(-1),
                   getattr(guide.scales, name).detach().clone().reshape(-1))
            for name, _ in guide.prototype_trace.iter_stochastic_nodes()}


def hier_reference(quick: bool):
    county, x, y = hier_data()
    return long_run(hier_model, AutoNormal(hier_model), (county, x, y, None), 600 if quick else 6000, 0.02, 0.02, 8)


def hier_run(optim, seed: int):
    args = (*hier_data(), 100)
    guide = AutoNormal(hier_model)
    svi = SVI(hier_model, guide, optim, loss=Trace_ELBO())
    return lambda: svi.step(*args), lambda ref: worst(autonormal_params(guide), ref)


# ------------------------------------------------------------------ eight schools, non-centred
SCHOOLS_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOLS_SD = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def schools_plate(subsample=None):
    return pyro.plate("schools", 8, subsample_size=subsample)


def schools_model(subsample=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with schools_plate(subsample) as ind:
        eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(mu + tau * eta, SCHOOLS_SD[ind]), obs=SCHOOLS_Y[ind])


def eight_reference(quick: bool):
    guide = AutoNormal(schools_model, create_plates=schools_plate)
    return long_run(schools_model, guide, (None,), 500 if quick else 5000, 0.02, 0.01, 16)


def eight_run(optim, seed: int):
    guide = AutoNormal(schools_model, create_plates=schools_plate)
    svi = SVI(schools_model, guide, optim, loss=Trace_ELBO())
    return lambda: svi.step(4), lambda ref: worst(autonormal_params(guide), ref)


# ------------------------------------------------------------------ the runs and the table
class Tutorial:
    def __init__(self, title: str, steps: int, adam: Callable, adam_label: str, reference: Callable,
                 reference_label: str, measure: str, run: Callable):
        self.title, self.steps, self.adam, self.adam_label = title, steps, adam, adam_label
        self.reference, self.reference_label, self.measure, self.run = reference, reference_label, measure, run


SD, GAP, ELBO = "max mean error (ref. sd)", "ELBO gap to ref. (nats)", "test ELBO / image"
TUTORIALS = {
    "regression": Tutorial("Bayesian regression 1, `AutoDiagonalNormal`", 1500,
                           lambda: pyro.optim.Adam({"lr": 0.03}), "Adam 0.03", regression_reference,
                           "closed form (noise fixed)", SD, regression_run),
    "part2": Tutorial("Bayesian regression 2, hand-written guide", 5000,
                      lambda: pyro.optim.Adam({"lr": 0.05}), "Adam 0.05", part2_reference,
                      "closed form (1-D quadrature)", SD, part2_run),
    "coin": Tutorial("SVI part I/II coin, Beta guide", 5000,
                     lambda: pyro.optim.Adam({"lr": 0.0005, "betas": (0.90, 0.999)}), "Adam 5e-4",
                     coin_reference, "closed form (Beta(16, 14))", SD, coin_run),
    "gmm_delta": Tutorial("GMM, `TraceEnum_ELBO`, `AutoDelta`", 200,
                          lambda: pyro.optim.Adam({"lr": 0.1, "betas": [0.8, 0.99]}), "Adam 0.1",
                          gmm_delta_reference, "L-BFGS on the same loss", GAP, gmm_delta_run),
    "gmm_normal": Tutorial("GMM, `TraceEnum_ELBO`, `AutoNormal`", 200,
                           lambda: pyro.optim.Adam({"lr": 0.1, "betas": [0.8, 0.99]}), "Adam 0.1",
                           gmm_normal_reference, "long run (16 particles)", GAP, gmm_normal_run),
    "vae": Tutorial("VAE, binarised digits", 600, lambda: pyro.optim.Adam({"lr": 1e-3}), "Adam 1e-3",
                    lambda quick: None, "none (higher is better)", ELBO, vae_run),
    "hier": Tutorial("varying intercepts, data plate subsampled", 2000, lambda: pyro.optim.Adam({"lr": 0.03}),
                     "Adam 0.03", hier_reference, "long run (8 particles)", SD, hier_run),
    "eight": Tutorial("eight schools, schools plate subsampled", 2000, lambda: pyro.optim.Adam({"lr": 0.03}),
                      "Adam 0.03", eight_reference, "long run (16 particles)", SD, eight_run),
}


def train(tutorial: Tutorial, optim, ref, seed: int, steps: int):
    """One run: (error, scale error or None, the NGVI warnings seen)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    step, score = tutorial.run(optim, seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            step()
    error, scale = score(ref)
    return float(error), scale, [w for w in caught if issubclass(w.category, NGVIWarning)]


def ms_per_step(tutorial: Tutorial, blocks: int, block: int = 25, warmup: int = 20):
    """Median ms per step of NGVI() and of the tutorial's Adam, each in its own param-store scope,
    interleaved in blocks of ``block`` steps after ``warmup`` steps each (load from other processes
    then hits both alike): the medians of the blocks' mean step times."""
    store = pyro.get_param_store()
    steps, states, times = {}, {}, {"ngvi": [], "adam": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, make in (("ngvi", NGVI), ("adam", tutorial.adam)):
            pyro.set_rng_seed(0)
            with store.scope() as states[label]:
                steps[label] = tutorial.run(make(), 0)[0]
                for _ in range(warmup):
                    steps[label]()
        for _ in range(blocks):
            for label, step in steps.items():
                with store.scope(states[label]):
                    start = time.perf_counter()
                    for _ in range(block):
                        step()
                    times[label].append((time.perf_counter() - start) / block)
    return 1e3 * statistics.median(times["ngvi"]), 1e3 * statistics.median(times["adam"])


def cell(values: List[float], digits: int, higher_is_better: bool = False) -> str:
    """The median over seeds, and the worst in brackets when there are several."""
    text = f"{statistics.median(values):.{digits}f}"
    bad = min(values) if higher_is_better else max(values)
    return text if len(values) == 1 else f"{text} ({bad:.{digits}f})"


def commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tutorials", nargs="+", default=list(TUTORIALS), choices=list(TUTORIALS))
    parser.add_argument("--steps", type=int, default=None, help="steps for every tutorial (default: each one's own)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tenth of the steps and reference runs (< 1 min)")
    parser.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = parser.parse_args()
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    if args.steps is not None and args.steps < 20:
        raise ValueError(f"--steps must be at least 20, got {args.steps}")
    torch.set_num_threads(1)
    started, load = time.perf_counter(), os.getloadavg()[0]
    rows, notes = [], []
    for name in args.tutorials:
        tut = TUTORIALS[name]
        steps = args.steps or (max(20, tut.steps // 10) if args.quick else tut.steps)
        pyro.clear_param_store()
        ref = tut.reference(args.quick)
        result = {"NGVI()": [], tut.adam_label: []}
        for seed in range(args.seeds):
            result["NGVI()"].append(train(tut, NGVI(), ref, seed, steps))
            result[tut.adam_label].append(train(tut, tut.adam(), ref, seed, steps))
        ngvi, adam = result["NGVI()"], result[tut.adam_label]
        scales = ["-" if r[0][1] is None else f"{100 * statistics.median([x[1] for x in r]):.1f} %" for r in (ngvi, adam)]
        ms = ms_per_step(tut, 4 if args.quick else 12)
        seen = [w for run in ngvi for w in run[2]]
        kinds = sorted({w.category.__name__ for w in seen})
        for w in seen[:1]:
            notes.append(f"- {name}: {w.category.__name__}: {str(w.message)[:300]}")
        digits, higher = (2, True) if tut.measure == ELBO else (3, False)
        rows.append(f"| {name}: {tut.title}, {tut.adam_label}, {steps} steps | {tut.reference_label} | {tut.measure} "
                    f"| {cell([x[0] for x in ngvi], digits, higher)} | {cell([x[0] for x in adam], digits, higher)} "
                    f"| {scales[0]} | {scales[1]} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.2f} "
                    f"| {len(seen)}{' (' + ', '.join(kinds) + ')' if kinds else ''} |")
        print(rows[-1], flush=True)
    header = [
        "# Pyro's tutorials with `NGVI()` swapped in for Adam (`benchmarks/tutorials.py`)", "",
        f"Command: `OMP_NUM_THREADS=1 PYTHONPATH=. python {' '.join(['benchmarks/tutorials.py'] + sys.argv[1:])}`", "",
        f"Date {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {commit()}, torch {torch.__version__}, pyro "
        f"{pyro.__version__}, one thread; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        f"({os.cpu_count()} cores), {time.perf_counter() - started:.0f} s in all.", "",
        f"Seeds 0-{args.seeds - 1}; errors are the median over seeds (worst in brackets); scales: the median of the "
        "worst |sd / ref. sd - 1|; ms per step: NGVI and Adam interleaved in blocks of 25 steps after 20 (seed 0), "
        "the median block; ratio NGVI / Adam; warnings: `NGVIWarning`s of the NGVI runs, all seeds.", "",
        "| tutorial, Adam setting, steps | reference | error measure | NGVI() | Adam | NGVI scales | Adam scales "
        "| NGVI ms/step | Adam ms/step | ratio | NGVI warnings |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    text = "\n".join(header + rows + ([""] + ["First warning of each tutorial that warned:"] + notes if notes else []))
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
