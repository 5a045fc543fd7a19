"""
The methods: each fits a task's network and offers the same small interface, so
that one training loop and one evaluation serve all of them.

* :class:`PyroSVI` (:func:`ngvi`, :func:`bayes_by_backprop`): Pyro's ``SVI`` on a
  :class:`~pyro_ngvi.BayesianNet` with an ``AutoNormal`` guide;
* :class:`MAP`: the plain network, Adam on the negative log joint;
* :class:`IVON`: ivon-opt's IVON on the plain network;
* :class:`HandVOGN`: VOGN written by hand with BackPACK, the speed reference.
"""

import contextlib
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

import pyro
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO

from .task import Task, nll

#: parameter name -> (mean, standard deviation) of a mean-field Gaussian over a network's weights
Posterior = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def sample_outputs(net: nn.Module, posterior: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]],
                   x: torch.Tensor, num_samples: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """
    Outputs ``(S, N, ...)`` of ``net`` on ``x`` at ``num_samples`` weight draws from
    ``posterior`` (a standard deviation ``None`` is a point estimate; parameters it
    does not name keep the network's values); one output when nothing is random.
    """
    names = [name for name, _ in net.named_parameters() if name in posterior]
    if all(posterior[name][1] is None for name in names):
        num_samples = 1
    outputs = []
    training = net.training
    net.eval()  # BatchNorm predicts with its running statistics
    try:
        for _ in range(num_samples):
            weights = {}
            for name in names:
                mean, std = posterior[name]
                noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
                weights[name] = mean if std is None else mean + std * noise
            outputs.append(functional_call(net, weights, (x,)))
    finally:
        net.train(training)
    return torch.stack(outputs)


class Method:
    """
    One way of fitting ``task``: ``step(x, y)`` takes an optimiser step on a
    minibatch; ``posterior()`` is the mean-field Gaussian over the network's
    weights (``None`` for a point estimate); ``predict(x, S)`` gives the network's
    outputs at ``S`` draws from it (one output for a point estimate); ``noise_scale``
    is the Gaussian likelihood's sigma. ``active()`` is the context the others run
    in (a param store).
    """

    name = "method"

    def __init__(self, task: Task):
        self.task = task
        self.net = task.network()

    def active(self):
        return contextlib.nullcontext()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    def posterior(self) -> Optional[Posterior]:
        return None

    @property
    def noise_scale(self) -> Optional[float]:
        return None

    def predict(self, x: torch.Tensor, num_samples: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        posterior = self.posterior()
        if posterior is None:
            posterior = {name: (p.detach(), None) for name, p in self.net.named_parameters()}
        return sample_outputs(self.net, posterior, x, num_samples, generator)


class PyroSVI(Method):
    """
    Pyro's ``SVI`` with any optimizer and loss on a :class:`~pyro_ngvi.BayesianNet`
    of the task's network and prior, with an ``AutoNormal`` guide started at the
    network's initial weights; in a param-store scope of its own, so that several
    can live in one process.
    """

    def __init__(self, task: Task, optim, loss, init_scale: Optional[float] = 0.1, name: str = "Pyro SVI",
                 make_guide: Optional[Callable] = None, prior=None):
        super().__init__(task)
        self.name = name
        self.bnn = BayesianNet(self.net, task.likelihood, num_data=task.num_data,
                               prior=task.prior_scale if prior is None else prior,
                               augmentation_factor=task.augmentation_factor)
        if make_guide is not None:  # e.g. a KroneckerNormal
            self.guide = make_guide(self.bnn)
        elif init_scale is None:  # the model's own guide: its data-relative initial scale
            self.guide = self.bnn.guide()
        else:
            self.guide = AutoNormal(self.bnn, init_loc_fn=self.bnn.init_loc_fn, init_scale=init_scale)
        self.optim = optim
        self.svi = SVI(self.bnn, self.guide, optim, loss)
        self._store = {"params": {}, "constraints": {}}
        self._entered = False
        with self.active():
            self.guide(task.split.x_train[:2], task.split.y_train[:2])  # locs: the net's weights

    @contextlib.contextmanager
    def active(self):
        if self._entered:
            yield
            return
        with pyro.get_param_store().scope(self._store):
            self._entered = True
            try:
                yield
            finally:
                self._entered = False

    def step(self, x, y):
        self.svi.step(x, y)

    def posterior(self) -> Posterior:
        """The guide's Gaussians, and the model's point estimates (BatchNorm) as they are in the
        param store (the traced path never copies them into the network)."""
        with self.active(), torch.no_grad():
            posterior = {site: tuple(t.detach().clone() for t in self.guide._get_loc_and_scale(site))
                         for site in self.bnn.latent_sites}
            store = pyro.get_param_store()
            for name, _ in self.net.named_parameters():
                if name not in posterior and name in store:
                    posterior[name] = (store[name].detach().clone(), None)
            return posterior

    @property
    def noise_scale(self):
        if self.task.likelihood != "gaussian":
            return None
        with self.active():
            return pyro.param("noise_scale").item()


class KroneckerSVI(PyroSVI):
    """
    :class:`PyroSVI` with a :class:`~pyro_ngvi.kronecker.KroneckerNormal` guide (noisy K-FAC
    with ``NGVI`` and ``CurvatureELBO("ggn")``): ``posterior()`` gives each weight's marginal
    (mean, standard deviation :math:`\\sqrt{U_{ii} V_{jj}}`), ``predict`` draws whole layers
    from their matrix normals.
    """

    def _layers(self):
        with self.active(), torch.no_grad():
            return [(layer, self.guide.get_layer(layer.name)) for layer in self.guide.layers]

    def posterior(self) -> Posterior:
        posterior = {}
        for layer, law in self._layers():
            row = law.row_scale_tril.square().sum(-1)  # diag U
            col = law.col_scale_tril.square().sum(-1)  # diag V
            std = (row[:, None] * col[None, :]).sqrt()
            for site, part in self.guide._split(layer, law.loc.detach(), sample=False).items():
                scale = self.guide._split(layer, std, sample=False)[site]
                posterior[site] = (part.clone(), scale.clone())
        return posterior

    @torch.no_grad()
    def predict(self, x, num_samples, generator=None):
        layers = self._layers()
        outputs = []
        training = self.net.training
        self.net.eval()
        try:
            for _ in range(num_samples):
                weights = {}
                for layer, law in layers:
                    noise = torch.randn(law.loc.shape, generator=generator, dtype=law.loc.dtype)
                    weights.update(self.guide._split(layer, law.transform(noise), sample=False))
                outputs.append(functional_call(self.net, weights, (x,)))
        finally:
            self.net.train(training)
        return torch.stack(outputs)


def ngvi_kronecker(task: Task, name: str = "NGVI K-FAC", init_scale: Optional[float] = None, prior=None,
                   **ngvi_args) -> KroneckerSVI:
    """Noisy K-FAC: ``KroneckerNormal(bnn)``, ``NGVI(**ngvi_args)``, ``CurvatureELBO("ggn")``
    (BackPACK KFLR) on the BayesianNet's fast path; ``init_scale`` default: ``bnn.initial_scale()``."""
    from pyro_ngvi.kronecker import KroneckerNormal

    def make(bnn):
        return KroneckerNormal(bnn, init_scale=float(init_scale or bnn.initial_scale()))

    return KroneckerSVI(task, NGVI(**ngvi_args), CurvatureELBO("ggn"), None, name, make_guide=make, prior=prior)


def ngvi(task: Task, curvature: Optional[str] = "ef", num_particles: int = 1, init_scale: float = 0.1,
         name: Optional[str] = None, **ngvi_args) -> PyroSVI:
    """NGVI with ``CurvatureELBO(curvature)``, or with ``Trace_ELBO`` for ``curvature=None``
    (the curvature recovered from its gradients)."""
    if curvature is None:
        loss = Trace_ELBO(num_particles=num_particles)
    else:
        loss = CurvatureELBO(curvature, num_particles=num_particles)
    return PyroSVI(task, NGVI(**ngvi_args), loss, init_scale, name or f"NGVI {curvature or 'Trace_ELBO'}")


def ngvi_recipe(task: Task, curvature: str = "ggn", name: Optional[str] = None, **overrides) -> PyroSVI:
    """
    NGVI as the README documents it for a :class:`~pyro_ngvi.BayesianNet`:
    ``bnn.guide()``, ``NGVI()`` and ``CurvatureELBO(curvature)``, nothing else set
    (``overrides``: NGVI's arguments, for development only).
    """
    model_args = {key: overrides.pop(key) for key in ("learn_prior", "noise_limit", "noise_limit_mode") if key in overrides}
    method = PyroSVI(task, NGVI(**overrides), CurvatureELBO(curvature), None, name or f"NGVI {curvature}")
    for key, value in model_args.items():
        setattr(method.bnn, key, value)
    return method


def bayes_by_backprop(task: Task, lr: float = 1e-3, init_scale: float = 0.1, num_particles: int = 1,
                      name: str = "Pyro SVI + Adam (BBB)") -> PyroSVI:
    """Bayes-by-Backprop: ``pyro.optim.Adam`` on ``Trace_ELBO``."""
    return PyroSVI(task, pyro.optim.Adam({"lr": lr}), Trace_ELBO(num_particles=num_particles), init_scale, name)


class _PlainNet(Method):
    """A method on the plain network; a Gaussian likelihood's noise scale is a learned ``exp(log_noise)``."""

    def __init__(self, task: Task):
        super().__init__(task)
        self.log_noise = nn.Parameter(torch.zeros(())) if task.likelihood == "gaussian" else None

    def mean_nll(self, x, y) -> torch.Tensor:
        noise = None if self.log_noise is None else self.log_noise.exp()
        return nll(self.task.likelihood, self.net(x), y, noise, reduction="mean")

    @property
    def noise_scale(self):
        return None if self.log_noise is None else self.log_noise.exp().item()


class MAP(_PlainNet):
    """
    MAP: Adam on the negative log joint per datum, the mean NLL plus
    :math:`\\frac{\\lambda_0}{2N}\\|w\\|^2` (the prior as weight decay;
    ``prior_precision`` :math:`\\lambda_0` defaults to the task's).
    """

    def __init__(self, task: Task, lr: float = 1e-3, prior_precision: Optional[float] = None, name: str = "MAP Adam"):
        super().__init__(task)
        self.name = name
        self.weight_decay = (task.prior_precision if prior_precision is None else prior_precision) / task.num_data
        noise = [] if self.log_noise is None else [self.log_noise]
        self.optim = torch.optim.Adam(list(self.net.parameters()) + noise, lr=lr)

    def step(self, x, y):
        self.optim.zero_grad(set_to_none=True)
        penalty = sum(p.square().sum() for p in self.net.parameters())
        (self.mean_nll(x, y) + 0.5 * self.weight_decay * penalty).backward()
        self.optim.step()


def ivon_installed() -> bool:
    """Whether ivon-opt (an optional baseline) can be imported; says so when it cannot."""
    try:
        import ivon  # noqa: F401
    except ImportError:
        print("ivon-opt is not installed: skipping that baseline (pip install ivon-opt)")
        return False
    return True


class IVON(_PlainNet):
    """
    ivon-opt's ``IVON`` (Shen et al. 2024) in its usual loop: the minibatch's mean
    loss, ``ess = N`` (times the task's augmentation factor) and ``weight_decay``
    :math:`= \\lambda_0 / N`, so that its
    posterior :math:`\\mathcal{N}(m, 1 / (\\mathrm{ess}\\,(h + \\mathrm{weight\\_decay})))`
    has the task's prior. ``hess_init`` is :math:`h` at the start, a Hessian of the
    loss *per datum*: the initial posterior precision is about ``N * hess_init``.
    ``h`` is an average with memory ``1 / (1 - beta2)`` steps (ivon-opt's default
    beta2, 0.99999, keeps it at ``hess_init`` for a run of a few thousand steps).
    A Gaussian likelihood's noise scale is learned by a separate Adam.
    """

    def __init__(self, task: Task, lr: float, hess_init: float, noise_lr: float = 1e-2, name: str = "ivon-opt",
                 **ivon_args):
        import ivon

        super().__init__(task)
        self.name = name
        ess = task.effective_num_data
        self.optim = ivon.IVON(self.net.parameters(), lr=lr, ess=ess, hess_init=hess_init,
                               weight_decay=task.prior_precision / ess, **ivon_args)
        self.noise_optim = None if self.log_noise is None else torch.optim.Adam([self.log_noise], lr=noise_lr)

    def step(self, x, y):
        if self.noise_optim is not None:
            self.noise_optim.zero_grad()
        for _ in range(self.optim.mc_samples):
            with self.optim.sampled_params(train=True):
                self.optim.zero_grad(set_to_none=True)
                self.mean_nll(x, y).backward()
        self.optim.step()
        if self.noise_optim is not None:
            self.noise_optim.step()

    def posterior(self) -> Posterior:
        (group,) = self.optim.param_groups
        std = (group["ess"] * (group["hess"] + group["weight_decay"])).rsqrt()
        params = list(self.net.named_parameters())
        stds = std.split([p.numel() for _, p in params])
        return {name: (p.detach().clone(), s.view_as(p).clone()) for (name, p), s in zip(params, stds)}


class HandVOGN(Method):
    """
    VOGN [Osawa et al. 2019] by hand: plain network, BackPACK, in the same
    coordinates as NGVI (full-data gradient, precision ``lam``)::

        w   = mu + eps / sqrt(lam)                      (copied into the net)
        g   = N/B * grad sum_i l_i,   h = N/B * sum_i (grad l_i)^2 (or the GGN diagonal)
        lam <- (1 - beta) lam + beta (lam0 + h)
        lam <- max(lam, L n / v)                        (noise_limit v; n fan-in, L layers)
        gm  <- momentum gm + (1 - momentum) g           (gm = g on the first step)
        mu  <- mu - lr (gm + lam0 mu) / (lam + damping)

    the update NGVI takes with the same arguments (its ``warm_start`` aside), the
    floor a BayesianNet's ``noise_limit`` (default 1) puts on the precision included
    (``noise_limit=None``: none). Categorical likelihood.
    """

    #: curvature source -> BackPACK extension (``ef``: VOGN's own)
    EXTENSIONS = {"ef": "SumGradSquared", "ggn": "DiagGGNExact", "ggn_mc": "DiagGGNMC"}

    def __init__(self, task: Task, lr=0.1, beta=0.05, damping=0.0, init_scale=0.1, curvature: str = "ef",
                 momentum: float = 0.0, noise_limit: Optional[float] = 1.0):
        import backpack.extensions
        from backpack import extend

        super().__init__(task)
        self.name = f"hand-written VOGN ({self.EXTENSIONS[curvature]})"
        self.net = extend(self.net)
        self.loss = extend(nn.CrossEntropyLoss(reduction="sum"))
        self.extension = getattr(backpack.extensions, self.EXTENSIONS[curvature])()
        self.lr, self.beta, self.damping, self.momentum = lr, beta, damping, momentum
        self.num_data, self.prior_precision = task.num_data, task.prior_precision
        self.params = list(self.net.parameters())
        self.mean = [p.detach().clone() for p in self.params]
        self.precision = [torch.full_like(p, init_scale**-2) for p in self.params]
        self.grad_average = None
        # the precision floor L n / v per parameter (a layer's weight and bias share its fan-in n)
        layers = [m for m in self.net.modules() if getattr(m, "weight", None) is not None and m.weight.dim() >= 2]
        fan_in = {id(p): m.weight[0].numel() for m in layers for p in m.parameters(recurse=False)}
        self.floors = [None if noise_limit is None or id(p) not in fan_in else len(layers) * fan_in[id(p)] / noise_limit
                       for p in self.params]

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
            for p, g, mu, lam, floor in zip(self.params, grads, self.mean, self.precision, self.floors):
                h = getattr(p, self.extension.savefield)
                lam.mul_(1 - self.beta).add_(h, alpha=self.beta * scale).add_(self.beta * self.prior_precision)
                if floor is not None:
                    lam.clamp_(min=floor)
                mu.sub_(self.lr * (g + self.prior_precision * mu) / (lam + self.damping))

    def posterior(self) -> Posterior:
        names = [name for name, _ in self.net.named_parameters()]
        return {name: (mu.clone(), lam.rsqrt()) for name, mu, lam in zip(names, self.mean, self.precision)}


def decaying(start: float, floor: float, halflife: float) -> Callable[[int], float]:
    """A step-size schedule for NGVI: ``start / (1 + t / halflife)``, never below ``floor``."""
    return lambda t: max(start / (1.0 + t / halflife), floor)


def annealed(start: float, end: float, steps: int) -> Callable[[int], float]:
    """A step-size schedule for NGVI: geometric from ``start`` to ``end`` over ``steps`` steps."""
    return lambda t: start * (end / start) ** min(t / max(steps, 1), 1.0)
