"""
Shared pieces of the BNN benchmarks (``bnn_step.py``, ``bnn_digits.py``): the
scikit-learn digits data, the 64-100-10 MLP, every training method behind one
small interface, and the evaluation (negative ELBO, predictive metrics) that
treats all methods alike.

Setting (DESIGN §5): digits standardised with the training set's statistics,
MLP 64-100-10 (ReLU), minibatches of 128, Categorical likelihood, prior
``N(0, 1)`` on every weight, ``N`` the size of the training set.

Methods (each an object with ``step(x, y)``, ``posterior()`` and ``active()``):

* :class:`PyroMethod`: Pyro ``SVI`` on a :class:`~pyro_ngvi.BayesianNet` with an
  ``AutoNormal`` guide, any optimizer and loss: NGVI with ``CurvatureELBO`` or
  ``Trace_ELBO``, or ``pyro.optim.Adam`` with ``Trace_ELBO`` (Bayes-by-Backprop).
* :class:`HandVOGN`: VOGN written by hand in plain PyTorch with BackPACK, the
  reference for the speed of the BackPACK path.
* :class:`MAPAdam`: the plain network, Adam on the negative log joint / N.
* :class:`IVONMethod`: ``ivon.IVON`` (ivon-opt), loss per datum, ``ess = N``,
  ``weight_decay = prior precision / N``.

Run from the repository root or from ``benchmarks/``; the scripts put this
folder on ``sys.path``.
"""

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import pyro
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import BayesianNet, CurvatureELBO, NGVI
from pyro_ngvi import metrics

PRIOR_SCALE = 1.0
HIDDEN = 100
BATCH_SIZE = 128
NUM_CLASSES = 10

Posterior = List[Tuple[torch.Tensor, torch.Tensor]]  # (mean, std) per weight tensor


# ------------------------------------------------------------------ data and net
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from _common import Split as Digits, load_split  # noqa: E402  (examples/_common.py)


def load_digits(test_size: float = 0.3, seed: int = 0) -> Digits:
    """scikit-learn digits, stratified train/test split, standardised with the
    training set's mean and standard deviation (constant pixels stay 0)."""
    from sklearn.datasets import load_digits as sk_load_digits

    return load_split(sk_load_digits, classification=True, test_size=test_size, seed=seed)


def make_net(seed: int, hidden: int = HIDDEN) -> nn.Sequential:
    """The 64-hidden-10 ReLU MLP with PyTorch's default initialisation under ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES))


def epoch_batches(num_data: int, batch_size: int, generator: torch.Generator) -> List[torch.Tensor]:
    """Index tensors of one epoch: a fresh permutation cut into minibatches (the
    last one may be smaller)."""
    return list(torch.randperm(num_data, generator=generator).split(batch_size))


# ------------------------------------------------------------------ methods
class Method:
    """One training method. ``step`` takes one minibatch; ``posterior`` returns
    (mean, std) per weight tensor in ``net.parameters()`` order (``None`` for a
    point estimate); ``point`` the weights a point estimate predicts with."""

    name = "method"
    bayesian = True

    def active(self):
        """Context in which ``step`` may be called (a Pyro method's param store)."""
        return contextlib.nullcontext()

    def prepare(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Set up state that needs example data (before any step or evaluation)."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    def posterior(self) -> Optional[Posterior]:
        return None

    def point(self) -> List[torch.Tensor]:
        return [mean for mean, _ in self.posterior()]


class PyroMethod(Method):
    """Pyro ``SVI`` on a :class:`BayesianNet` with ``AutoNormal``, in a param-store
    scope of its own (several can live in one process)."""

    def __init__(self, name: str, net: nn.Module, num_data: int, optim, loss, init_scale: float = 0.1,
                 prior_scale: float = PRIOR_SCALE):
        self.name = name
        self.bnn = BayesianNet(net, "categorical", num_data=num_data, prior=prior_scale)
        self.guide = AutoNormal(self.bnn, init_loc_fn=self.bnn.init_loc_fn, init_scale=init_scale)
        self.optim = optim
        self.svi = SVI(self.bnn, self.guide, optim, loss=loss)
        self._state = {"params": {}, "constraints": {}}
        self._active = False

    @contextlib.contextmanager
    def active(self):
        if self._active:
            yield
            return
        with pyro.get_param_store().scope(self._state):
            self._active = True
            try:
                yield
            finally:
                self._active = False

    def prepare(self, x, y):
        with self.active():
            if self.guide.prototype_trace is None:
                self.guide(x, y)  # creates locs (the net's init) and scales (init_scale)

    def step(self, x, y):
        self.svi.step(x, y)

    def posterior(self) -> Posterior:
        with self.active():
            store = pyro.get_param_store()
            return [
                (store[f"AutoNormal.locs.{site}"].detach().clone(),
                 store[f"AutoNormal.scales.{site}"].detach().clone())
                for site in self.bnn.latent_sites
            ]


def ngvi(name, net, num_data, curvature="ef", num_particles=1, init_scale=0.1, **ngvi_args) -> PyroMethod:
    """NGVI on Pyro SVI with ``CurvatureELBO(curvature)`` (``curvature=None``: plain
    ``Trace_ELBO``, the curvature recovered from its gradients)."""
    if curvature is None:
        loss = Trace_ELBO(num_particles=num_particles)
    else:
        loss = CurvatureELBO(curvature, num_particles=num_particles)
    return PyroMethod(name, net, num_data, NGVI(**ngvi_args), loss, init_scale=init_scale)


def bayes_by_backprop(name, net, num_data, lr=1e-3, init_scale=0.1, num_particles=1) -> PyroMethod:
    """Pyro SVI + ``pyro.optim.Adam`` + ``Trace_ELBO`` (Bayes-by-Backprop)."""
    optim = pyro.optim.Adam({"lr": lr})
    return PyroMethod(name, net, num_data, optim, Trace_ELBO(num_particles=num_particles), init_scale=init_scale)


class HandVOGN(Method):
    """
    VOGN [Osawa et al. 2019] by hand: plain network, BackPACK ``SumGradSquared``,
    in the same coordinates as NGVI (full-data gradient, precision ``lam``)::

        w   = mu + eps / sqrt(lam)                      (copied into the net)
        g   = N/B * grad sum_i l_i,   h = N/B * sum_i (grad l_i)^2
        lam <- (1 - beta) lam + beta (lam0 + h)
        gm  <- momentum gm + (1 - momentum) g           (gm = g on the first step)
        mu  <- mu - lr (gm + lam0 mu) / (lam + damping)

    the update NGVI takes with the same arguments (its ``warm_start`` aside).
    """

    #: curvature source -> BackPACK extension (``ef``: VOGN's own)
    EXTENSIONS = {"ef": "SumGradSquared", "ggn": "DiagGGNExact", "ggn_mc": "DiagGGNMC"}

    def __init__(self, net: nn.Module, num_data: int, lr=0.1, beta=0.05, damping=0.0, init_scale=0.1,
                 prior_scale: float = PRIOR_SCALE, curvature: str = "ef", momentum: float = 0.0):
        import backpack.extensions
        from backpack import extend

        self.name = f"hand-written VOGN ({self.EXTENSIONS[curvature]})"
        self.net = extend(net)
        self.loss = extend(nn.CrossEntropyLoss(reduction="sum"))
        self.extension = getattr(backpack.extensions, self.EXTENSIONS[curvature])()
        self.num_data, self.lr, self.beta, self.damping = num_data, lr, beta, damping
        self.params = list(net.parameters())
        self.mean = [p.detach().clone() for p in self.params]
        self.precision = [torch.full_like(p, init_scale**-2) for p in self.params]
        self.prior_precision = prior_scale**-2
        self.momentum = momentum
        self.grad_average = None

    def step(self, x, y):
        from backpack import backpack

        with torch.no_grad():
            for p, mu, lam in zip(self.params, self.mean, self.precision):
                p.copy_(torch.randn_like(mu).div_(lam.sqrt()).add_(mu))
                p.grad = None
        with backpack(self.extension):
            self.loss(self.net(x), y).backward()
        scale = self.num_data / len(x)
        with torch.no_grad():
            grads = [scale * p.grad for p in self.params]
            if self.momentum and self.grad_average is not None:
                torch._foreach_lerp_(self.grad_average, grads, 1 - self.momentum)
                grads = self.grad_average
            elif self.momentum:
                self.grad_average = grads
            for p, g, mu, lam in zip(self.params, grads, self.mean, self.precision):
                h = getattr(p, self.extension.savefield)
                lam.mul_(1 - self.beta).add_(h, alpha=self.beta * scale).add_(self.beta * self.prior_precision)
                mu.sub_(self.lr * (g + self.prior_precision * mu) / (lam + self.damping))

    def posterior(self):
        return [(mu.clone(), lam.rsqrt()) for mu, lam in zip(self.mean, self.precision)]


class MAPAdam(Method):
    """MAP: Adam on ``(-log p(y | x, w) - log p0(w)) / N`` (mean cross-entropy plus
    weight decay ``lam0 / (2N) |w|^2``)."""

    name = "MAP Adam"
    bayesian = False

    def __init__(self, net: nn.Module, num_data: int, lr=1e-3, prior_scale: float = PRIOR_SCALE):
        self.net = net
        self.weight_decay = prior_scale**-2 / num_data
        self.optim = torch.optim.Adam(net.parameters(), lr=lr)

    def step(self, x, y):
        self.optim.zero_grad(set_to_none=True)
        penalty = sum(p.square().sum() for p in self.net.parameters())
        loss = F.cross_entropy(self.net(x), y) + 0.5 * self.weight_decay * penalty
        loss.backward()
        self.optim.step()

    def point(self):
        return [p.detach().clone() for p in self.net.parameters()]


class IVONMethod(Method):
    """ivon-opt's IVON: loss = mean cross-entropy of the minibatch, ``ess = N``,
    ``weight_decay = lam0 / N``; posterior std ``1 / sqrt(ess (hess + weight_decay))``."""

    name = "ivon-opt"

    def __init__(self, net: nn.Module, num_data: int, lr=0.1, hess_init=0.5, beta1=0.9,
                 beta2=0.99999, mc_samples=1, prior_scale: float = PRIOR_SCALE, **kwargs):
        import ivon

        self.net = net
        self.mc_samples = mc_samples
        self.optim = ivon.IVON(
            net.parameters(), lr=lr, ess=num_data, hess_init=hess_init, beta1=beta1, beta2=beta2,
            weight_decay=prior_scale**-2 / num_data, mc_samples=mc_samples, **kwargs,
        )

    def step(self, x, y):
        for _ in range(self.mc_samples):
            with self.optim.sampled_params(train=True):
                self.optim.zero_grad(set_to_none=True)
                F.cross_entropy(self.net(x), y).backward()
        self.optim.step()

    def posterior(self):
        out = []
        for group in self.optim.param_groups:
            std = (group["ess"] * (group["hess"] + group["weight_decay"])).rsqrt()
            offset = 0
            for p in group["params"]:
                out.append((p.detach().clone(), std[offset: offset + p.numel()].view_as(p).clone()))
                offset += p.numel()
        return out


# ------------------------------------------------------------------ evaluation
def _forward(net: nn.Module, weights: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    params = dict(zip([k for k, _ in net.named_parameters()], weights))
    return torch.func.functional_call(net, params, (x,))


def _sampled_weights(posterior: Posterior, generator: torch.Generator) -> List[torch.Tensor]:
    return [
        mean + std * torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        for mean, std in posterior
    ]


def gaussian_kl(posterior: Posterior, prior_scale: float = PRIOR_SCALE) -> torch.Tensor:
    """:math:`\\mathrm{KL}(q \\| p_0)` of a mean-field Gaussian from ``N(0, s0^2)``."""
    total = torch.zeros(())
    for mean, std in posterior:
        ratio = std.square() / prior_scale**2
        total = total + 0.5 * (ratio + mean.square() / prior_scale**2 - 1 - ratio.log()).sum()
    return total


@torch.no_grad()
def negative_elbo_per_datum(net, posterior: Posterior, x, y, num_particles=8, seed=0,
                            prior_scale: float = PRIOR_SCALE) -> float:
    """
    ``-ELBO / N`` on ``(x, y)``: the expected negative log-likelihood of the whole
    set by ``num_particles`` weight samples plus the closed-form KL to the prior.
    The noise is drawn from a generator seeded with ``seed``, so every method and
    every epoch is scored with the same draws (common random numbers).
    """
    generator = torch.Generator().manual_seed(seed)
    nll = 0.0
    for _ in range(num_particles):
        logits = _forward(net, _sampled_weights(posterior, generator), x)
        nll += float(F.cross_entropy(logits, y, reduction="sum"))
    return (nll / num_particles + float(gaussian_kl(posterior, prior_scale))) / len(x)


@torch.no_grad()
def predictive_probs(net, method: Method, x, num_samples=32, seed=0) -> torch.Tensor:
    """Posterior predictive class probabilities (``num_samples`` weight samples), or
    the softmax of the point estimate."""
    posterior = method.posterior() if method.bayesian else None
    if posterior is None:
        return torch.softmax(_forward(net, method.point(), x), -1)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.stack([_forward(net, _sampled_weights(posterior, generator), x) for _ in range(num_samples)])
    return metrics.predictive_probs_from_logits(logits)


def predictive_metrics(net, method: Method, x, y, num_samples=32, seed=0) -> Dict[str, float]:
    probs = predictive_probs(net, method, x, num_samples, seed)
    if not bool(torch.isfinite(probs).all()):  # a diverged run
        return {"nll": math.nan, "acc": math.nan, "ece": math.nan}
    return {
        "nll": float(metrics.nll(probs, y)),
        "acc": float(metrics.accuracy(probs, y)),
        "ece": float(metrics.expected_calibration_error(probs, y)),
    }


def trace_elbo_per_datum(net_seed: int, posterior: Posterior, x, y, num_particles=64) -> float:
    """The same ``-ELBO / N`` by Pyro's ``Trace_ELBO`` on a fresh ``BayesianNet`` whose
    ``AutoNormal`` holds ``posterior`` (a cross-check of :func:`negative_elbo_per_datum`)."""
    from torch.distributions import biject_to

    with pyro.get_param_store().scope():
        bnn = BayesianNet(make_net(net_seed), "categorical", num_data=len(x), prior=PRIOR_SCALE)
        guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn)
        guide(x, y)
        store = pyro.get_param_store()
        with torch.no_grad():
            for site, (mean, std) in zip(bnn.latent_sites, posterior):
                store._params[f"AutoNormal.locs.{site}"].copy_(mean)
                raw = biject_to(store._constraints[f"AutoNormal.scales.{site}"]).inv(std)
                store._params[f"AutoNormal.scales.{site}"].copy_(raw)
            loss = Trace_ELBO(num_particles=num_particles).loss(bnn, guide, x, y)
    return loss / len(x)


# ------------------------------------------------------------------ training loop
@dataclass
class History:
    """Per-epoch record of one run (index 0: before training)."""

    epochs: List[int]
    wall: List[float]  # cumulative training seconds (evaluation excluded)
    neg_elbo: List[float]  # -ELBO / N on the training set (nan for a point estimate)
    test: List[Dict[str, float]]  # predictive nll / acc / ece on the test set
    step_times: List[float]  # seconds per step


def train(method: Method, data: Digits, epochs: int, seed: int, eval_net: nn.Module,
          eval_every: int = 1, elbo_particles: int = 8, predictive_samples: int = 32,
          callback: Optional[Callable[[int, History], bool]] = None) -> History:
    """
    Train ``method`` for ``epochs`` epochs of minibatches (a fresh permutation per
    epoch from a generator seeded with ``seed``), evaluating every ``eval_every``
    epochs. Only the steps are timed. ``callback(epoch, history)`` returning True
    stops early.
    """
    import time

    generator = torch.Generator().manual_seed(seed)
    history = History([], [], [], [], [])
    wall = 0.0

    def evaluate(epoch):
        history.epochs.append(epoch)
        history.wall.append(wall)
        if method.bayesian:
            posterior = method.posterior()
            history.neg_elbo.append(negative_elbo_per_datum(
                eval_net, posterior, data.x_train, data.y_train, elbo_particles, seed=seed))
        else:
            history.neg_elbo.append(math.nan)
        history.test.append(predictive_metrics(eval_net, method, data.x_test, data.y_test,
                                               predictive_samples, seed=seed))

    method.prepare(data.x_train[:BATCH_SIZE], data.y_train[:BATCH_SIZE])
    with method.active():
        evaluate(0)
        for epoch in range(1, epochs + 1):
            for idx in epoch_batches(data.num_train, BATCH_SIZE, generator):
                x, y = data.x_train[idx], data.y_train[idx]
                start = time.perf_counter()
                method.step(x, y)
                elapsed = time.perf_counter() - start
                wall += elapsed
                history.step_times.append(elapsed)
            if epoch % eval_every == 0 or epoch == epochs:
                evaluate(epoch)
                if callback is not None and callback(epoch, history):
                    break
    return history
