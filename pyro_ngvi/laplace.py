"""
The Laplace approximation and its model evidence, from the curvature
:class:`~pyro_ngvi.CurvatureELBO` already computes for :class:`~pyro_ngvi.NGVI`.

Everything lives in the unconstrained coordinates ``u`` of an
:class:`~pyro.infer.autoguide.AutoNormal` guide, :math:`x = T(u)`,
:math:`T` = ``biject_to(support)``. The negative log joint there is

.. math:: F(u) = -\\log p(\\mathcal{D}, T(u)) - \\log|\\det J_T(u)|,

so :math:`\\int e^{-F(u)}\\,du = p(\\mathcal{D})`: the change of variables keeps
the evidence, but the *mode* :math:`u^*` of :math:`F` is not the image of the
mode of :math:`p(\\mathcal{D}, x)` (on a positive site it is the mode of
:math:`x\\,p(\\mathcal{D}, x)`). The Laplace approximation expands :math:`F` to
second order at :math:`u^*`,

.. math::

    q(u) = \\mathcal{N}(u^*, \\Lambda^{-1}), \\qquad
    \\Lambda = \\mathrm{diag}(\\lambda), \\quad
    \\lambda = \\lambda_0 + h(u^*), \\\\
    \\log p(\\mathcal{D}) \\approx -F(u^*)
        + \\tfrac12 \\sum_i \\log \\frac{2\\pi}{\\lambda_i},

with :math:`\\lambda_0` the precision of a prior that is Normal in ``u``
(conjugate) and :math:`h` the diagonal curvature of everything else: the exact
Hessian diagonal (``"hessian"``), the generalised Gauss-Newton (``"ggn"``) or
the empirical Fisher (``"ef"``) of the likelihood, plus the exact Hessian
diagonal of any non-conjugate prior term (see :class:`~pyro_ngvi.CurvatureELBO`).

**Why NGVI finds the mode.** With exact curvature, evaluation at the mean
(``deterministic=True``, the "OGN" mode) and ``beta = 1``, one NGVI step is

.. math:: \\lambda' = \\lambda_0 + h(\\mu), \\qquad
          \\mu' = \\mu - \\alpha\\, \\frac{\\nabla F(\\mu)}{\\lambda'},

a diagonal Newton step of size :math:`\\alpha` = ``lr`` on :math:`F`. Its fixed
point is :math:`\\nabla F(u^*) = 0` with :math:`\\lambda = \\lambda_0 + h(u^*)`:
the diagonal Laplace approximation. For a single site, or whenever
:math:`\\nabla^2 F` is diagonal, ``lr = 1`` is Newton's method; for a
correlated quadratic it is a Jacobi iteration, convergent only for
``lr < 2 / lambda_max(D^-1 A)``, which is why :func:`laplace` halves ``lr``
whenever a step does not decrease :math:`F`.

**Full covariance.** With ``covariance="full"`` (or an
:class:`~pyro.infer.autoguide.AutoMultivariateNormal` as ``guide``) the same
search runs on the whole latent vector: :math:`\\Lambda = S_0 + H(u^*)` is the
dense precision (the exact Hessian, GGN or empirical-Fisher matrix of
:mod:`pyro_ngvi.curvature.dense`, plus the precision of priors Gaussian in
``u``), an NGVI step with ``lr = beta = 1`` is a full Newton step (exact in one step on a quadratic), and

.. math:: \\log p(\\mathcal{D}) \\approx -F(u^*) + \\tfrac{D}{2}\\log 2\\pi
          - \\tfrac12 \\log\\det \\Lambda,

exact for a linear-Gaussian model with correlated features.

**Diagonal evidence and the mean-field ELBO.** For a linear-Gaussian model with posterior
precision :math:`A` the full Laplace evidence is exact, and the diagonal one is below it by
:math:`\\tfrac12(\\sum_i \\log A_{ii} - \\log\\det A) \\ge 0` (Hadamard's
inequality), which is also the gap of the optimal mean-field ELBO: there the two
numbers coincide.

**References**

[1] `Accurate Approximations for Posterior Moments and Marginal Densities`,
    Luke Tierney, Joseph B. Kadane (JASA 1986)
[2] `A Practical Bayesian Framework for Backpropagation Networks`,
    David J. C. MacKay (Neural Computation 1992)
[3] `Scalable Marginal Likelihood Estimation for Model Selection in Deep Learning`,
    Alexander Immer, Matthias Bauer, Vincent Fortuin, Gunnar Ratsch,
    Mohammad Emtiyaz Khan (ICML 2021)
[4] `Laplace Redux -- Effortless Bayesian Deep Learning`, Erik Daxberger,
    Agustinus Kristiadi, Alexander Immer, Runa Eschenhagen, Matthias Bauer,
    Philipp Hennig (NeurIPS 2021)
[5] `The Bayesian Learning Rule`, Mohammad Emtiyaz Khan, Havard Rue
    (JMLR 2023)
"""

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Union

import torch
from torch.distributions import biject_to

import pyro
import pyro.poutine as poutine
from pyro.infer import SVI
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible

from .curvature import check_source, refuse_random_modules
from .elbo import CurvatureELBO
from .family import FullCovarianceSite, GaussianSite, _full_covariance_site, _is_automultivariatenormal, pop_curvature
from .optim import NGVI
from .arguments import check_callable, check_guide
from .policies import check_schedule, positive_numbers

__all__ = ["LaplaceResult", "LaplaceWarning", "PriorPrecisionSearch", "laplace", "optimize_prior_precision"]

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)
#: ``lr`` is halved at most this many times in a row before the search gives up.
_MAX_HALVINGS = 30
#: with momentum, a step is accepted when F is below its largest value over this many accepted
#: means (a heavy ball need not descend every step; Grippo et al. 1986); without, every step descends.
_WINDOW = 10


def _unbounded(guide) -> str:
    """What is said of a search that ran off to a far mean (|u| > 30: exp(u) under 1e-13)."""
    far = [repr(name) for name, (_, u) in _unconstrained_means(guide).items() if float(u.abs().max()) > 30]
    return (f" The mean of {', '.join(far)} is beyond |u| = 30 in unconstrained coordinates: F may fall without "
            "bound there (a scale driven to 0, as in a funnel), and then no Laplace approximation exists." if far else "")


class LaplaceWarning(UserWarning):
    """Warned when :func:`laplace` stops before the mean has stopped moving."""


@dataclass
class LaplaceResult:
    """
    A diagonal Laplace approximation, per latent site, in the guide's unconstrained coordinates ``u``.

    :ivar guide: the :class:`~pyro.infer.autoguide.AutoNormal` holding ``loc = map`` and ``scale =
        precision ** -0.5`` (usable with :class:`~pyro.infer.Predictive`; ``guide.median()`` gives
        :math:`T(u^*)`), or the :class:`~pyro.infer.autoguide.AutoMultivariateNormal` holding the mode
        and the covariance :math:`\\Lambda^{-1}`.
    :ivar float log_evidence: :math:`-F(u^*) + \\frac12\\sum_i \\log(2\\pi/\\lambda_i)`.
    :ivar float log_joint: :math:`-F(u^*) = \\log p(\\mathcal{D}, T(u^*)) + \\log|\\det J_T(u^*)|` (scales applied).
    :ivar dict map: site name -> :math:`u^*` (the mode of :math:`F`, unconstrained).
    :ivar dict precision: site name -> :math:`\\lambda = \\lambda_0 + h(u^*)`; for a full covariance one
        entry, the guide's name -> the ``(D, D)`` matrix :math:`\\Lambda` (``map``: -> the latent vector).
    :ivar str curvature: the curvature source used.
    :ivar int num_steps: NGVI steps taken (rejected ones included).
    :ivar float newton_step: the largest element of the next diagonal Newton step at :math:`u^*`, in
        posterior standard deviations: :math:`\\max_i |\\partial_i F(u^*)| / \\sqrt{\\lambda_i}`.
    :ivar bool converged: ``newton_step <= tol``.
    :ivar bool full_covariance: the precision is one dense matrix.
    """

    guide: Union[AutoNormal, AutoMultivariateNormal]
    log_evidence: float
    log_joint: float
    map: Dict[str, torch.Tensor]
    precision: Dict[str, torch.Tensor]
    curvature: str
    num_steps: int
    newton_step: float
    converged: bool
    full_covariance: bool = False

    @property
    def scale(self) -> Dict[str, torch.Tensor]:
        """Site name -> posterior standard deviation in ``u``: :math:`\\lambda^{-1/2}`,
        or :math:`\\sqrt{\\mathrm{diag}\\,\\Lambda^{-1}}` for a full covariance."""
        if self.full_covariance:
            return {name: torch.cholesky_inverse(torch.linalg.cholesky(p)).diagonal().sqrt()
                    for name, p in self.precision.items()}
        return {name: p.rsqrt() for name, p in self.precision.items()}

    @property
    def num_latents(self) -> int:
        """Number of scalar latent coordinates."""
        if self.full_covariance:
            return sum(p.shape[-1] for p in self.precision.values())
        return sum(p.numel() for p in self.precision.values())


def laplace(
    model: Callable,
    *args,
    curvature: str = "hessian",
    guide: Optional[Union[AutoNormal, AutoMultivariateNormal]] = None,
    num_steps: int = 500,
    lr: float = 1.0,
    tol: float = 1e-6,
    line_search: bool = True,
    momentum: float = 0.0,
    covariance: str = "diagonal",
    **kwargs,
) -> LaplaceResult:
    """
    Fit a diagonal Laplace approximation to ``model(*args, **kwargs)`` and
    estimate its log evidence (see the module docstring for the maths).

    The mode is found by Pyro's own ``SVI`` with
    ``NGVI(lr, beta=1, momentum)`` and ``CurvatureELBO(curvature,
    deterministic=True)``, i.e. diagonal Newton steps of size ``lr`` on
    :math:`F`, until the next Newton step moves no element of the mean by more
    than ``tol`` posterior standard deviations. With ``line_search`` a step that
    does not decrease :math:`F` (with momentum: below its largest value over the
    last 10 accepted steps) is undone, ``lr`` halved for the rest of the run and
    the momentum restarted. At the
    mode one more :meth:`~pyro_ngvi.CurvatureELBO.loss_and_grads` gives the
    precision, which is written into the guide with the mode.

    Without momentum the search is a Jacobi iteration on correlated problems:
    linear convergence with a rate set by the condition number of the
    diagonally scaled Hessian. On networks and strongly correlated designs
    ``momentum=0.9`` (a heavy ball, with ``lr`` of 0.1 to 3) is much faster;
    ``lr = 1`` without momentum is Newton's method exactly where the Hessian is
    diagonal.

    ``args`` must be the full data: a subsampled plate over a latent site is not
    supported (its rows would need a pass over all minibatches), while an
    observed site under a subsampling plate is scaled to the full data as in
    any Pyro ELBO. Parameters that are not guide sites (``pyro.param``, a learned
    noise scale) move with NGVI's point optimizer during the search and are held
    fixed in the evidence. A model's priors learned in closed form (``BayesianNet(learn_prior=True)``) move
    with the mode, to the prior at which the evidence is stationary, :math:`\\alpha = P / (|\\mu|^2 + \\mathrm{tr}\\,\\Sigma)`
    (the line search, which compares :math:`F` at one prior, is then off).

    :param model: a Pyro model, e.g. a :class:`~pyro_ngvi.BayesianNet` (whose
        BackPACK path serves ``"ggn"`` and ``"ef"``; ``"hessian"`` is computed by
        tracing the model).
    :param args: the model's arguments (the data).
    :param str curvature: ``"hessian"``, ``"ggn"``, ``"ef"`` or ``"ggn_mc"``
        (random) (default: ``"hessian"``).
    :param guide: an :class:`~pyro.infer.autoguide.AutoNormal` of ``model``
        whose mean is the starting point; ``None`` creates ``AutoNormal(model)``,
        which as any autoguide reads existing values of its parameters from the
        param store (a :class:`~pyro_ngvi.BayesianNet` starts at its network's
        weights) (default: None).
    :param int num_steps: most NGVI steps (rejected ones count); ``0`` takes the
        guide's mean as the mode (e.g. a network trained elsewhere) (default: 500).
    :param float lr: initial (and largest) step size :math:`\\alpha` on the mean
        (default: 1).
    :param float tol: convergence threshold on the Newton step, in posterior
        standard deviations (default: 1e-6).
    :param bool line_search: undo steps that increase :math:`F`, halve ``lr``
        (default: True).
    :param float momentum: NGVI's momentum :math:`\\rho` on the mean gradient
        (default: 0).
    :param str covariance: ``"diagonal"`` or ``"full"`` (a dense precision over
        all latents, in an :class:`~pyro.infer.autoguide.AutoMultivariateNormal`);
        a given ``guide`` decides it by its type (an ``AutoNormal`` refuses ``"full"``; default: ``"diagonal"``).
    :param kwargs: the model's keyword arguments.
    :returns: a :class:`LaplaceResult`.
    :raises ValueError: for a ``model`` or ``guide`` that is not callable (naming it),
        for ``curvature="reparam"`` (a sampling estimate), a model (an ``nn.Module``)
        with ``Dropout`` in training mode (a random log joint), or a non-positive or non-finite precision at the mode.
    """
    check_source(curvature)
    refuse_random_modules(model, "laplace")
    if curvature == "reparam":
        raise ValueError("laplace needs curvature evaluated at the mean: use 'hessian', 'ggn' or 'ef' "
                         "('reparam' is estimated from sampling noise)")
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative integer, got {num_steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if not callable(momentum):  # (a callable is refused by NGVI; checked before a guide is made)
        check_schedule("momentum", momentum, 0.0, 1.0, low_open=False, high_open=True)
    if not isinstance(line_search, bool):
        raise ValueError(f"line_search must be True or False, got {line_search!r}")
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 < tol < math.inf:
        raise ValueError(f"tol must be a positive finite number, got {tol!r}")
    if covariance not in ("diagonal", "full"):
        raise ValueError(f"covariance must be 'diagonal' or 'full', got {covariance!r}")
    if guide is None:
        # a model may say where its guide should start (BayesianNet: at its network's weights)
        guide_class = AutoMultivariateNormal if covariance == "full" else AutoNormal
        guide = guide_class(model, init_loc_fn=getattr(model, "init_loc_fn", init_to_feasible))
    elif not (isinstance(guide, AutoNormal) or _is_automultivariatenormal(guide)):
        check_guide(guide, "laplace", "an AutoNormal or AutoMultivariateNormal, or None")  # (not callable: no guide)
        raise NotImplementedError(f"laplace writes its result into an AutoNormal or AutoMultivariateNormal guide, got "
                                  f"{type(guide).__name__}")
    elif covariance == "full" and isinstance(guide, AutoNormal):
        raise ValueError("covariance='full' needs an AutoMultivariateNormal guide (a given guide decides), got AutoNormal")
    sites = _guide_sites(guide, args, kwargs)
    rows = len(args[0]) if args and torch.is_tensor(args[0]) and args[0].dim() else None
    if isinstance(getattr(model, "num_data", None), int) and rows is not None and rows != model.num_data:
        warnings.warn(f"laplace: x has {rows} rows, the model's num_data is {model.num_data}: the likelihood is "
                      f"scaled by {model.num_data / rows:.3g}, so mode, precision and evidence are estimates from a "
                      "subset (they are the full data's only when x is the whole data set)", LaplaceWarning, stacklevel=2)
    line_search = line_search and not getattr(model, "learn_prior", False)  # (F moves with the prior)
    elbo = CurvatureELBO(curvature, deterministic=True)

    step_size = {"lr": float(lr)}
    optim = NGVI(lr=lambda _: step_size["lr"], beta=1.0, momentum=momentum, damping=0.0, max_step=None,
                 warm_start=False)
    optim.watch_elbo = False  # (the line search judges the steps by F; the ELBO's KL rises with the precision)
    svi = SVI(model, guide, optim, elbo)
    window = _WINDOW if momentum else 1
    recent = [negative_log_joint(model, guide, *args, **kwargs)] if line_search and num_steps else []
    steps, halvings = 0, 0
    while steps < num_steps:
        steps += 1
        saved = [[t.detach().clone() for t in site.tensors] for site in sites]
        skipped = optim.num_skipped_steps
        svi.step(*args, **kwargs)
        if optim.num_skipped_steps > skipped:
            raise ValueError(
                "laplace: non-finite gradient or curvature at the current mean (see the "
                "NGVIWarning above); start from another mean or use another curvature"
            )
        if line_search:
            objective = negative_log_joint(model, guide, *args, **kwargs)
            reference = max(recent)  # F at the last accepted means
            slack = 16 * torch.finfo(sites[0].loc.dtype).eps * max(1.0, abs(reference))
            if not objective <= reference + slack:  # also when not finite
                with torch.no_grad():
                    for site, tensors in zip(sites, saved):
                        for tensor, value in zip(site.tensors, tensors):
                            tensor.copy_(value)
                step_size["lr"] /= 2
                optim._restart_momentum()  # restart the heavy ball
                halvings += 1
                if halvings > _MAX_HALVINGS:
                    break
                continue
            halvings = 0
            recent = (recent + [objective])[-window:]
        # the step moved the mean by lr times the Newton step at the old mean
        # (with momentum, by lr times the averaged one)
        movement = max(_in_standard_deviations(site, site.mean - tensors[0])
                       for site, tensors in zip(sites, saved))
        if movement <= step_size["lr"] * tol:
            if momentum == 0 or _precision_at_mean(model, guide, elbo, sites, args, kwargs)[1] <= tol:
                break

    precision, newton_step = _precision_at_mean(model, guide, elbo, sites, args, kwargs)
    full = isinstance(sites[0], FullCovarianceSite)
    with torch.no_grad():
        for site in sites:
            (site.write_precision if full else site.write)(site.mean, precision[site.name])
    log_joint = -negative_log_joint(model, guide, *args, **kwargs)
    log_det = sum(float(torch.logdet(p) if full else p.log().sum()) for p in precision.values())
    num_latents = sum(p.shape[-1] if full else p.numel() for p in precision.values())
    log_evidence = log_joint + num_latents * _HALF_LOG_TWO_PI - 0.5 * log_det
    converged = newton_step <= tol
    if num_steps > 0 and not converged:
        warnings.warn(f"laplace stopped after {steps} steps (lr {step_size['lr']:.3g}) with a next Newton "
                      f"step of {newton_step:.3g} posterior standard deviations > tol = {tol:g}; the mode "
                      "and the evidence are approximate. Raise num_steps or tol, lower lr, or add momentum."
                      + _unbounded(guide), LaplaceWarning, stacklevel=2)
    return LaplaceResult(guide=guide, log_evidence=log_evidence, log_joint=log_joint,
                         map={site.name: site.mean.clone() for site in sites}, precision=precision,
                         curvature=curvature, num_steps=steps, newton_step=newton_step, converged=converged,
                         full_covariance=full)


def negative_log_joint(model: Callable, guide: AutoNormal, *args, **kwargs) -> float:
    """
    :math:`F(\\mu) = -\\log p(\\mathcal{D}, T(\\mu)) - \\log|\\det J_T(\\mu)|` at the
    guide's mean :math:`\\mu` (each site's scale and mask applied to its log p, as in an ELBO).
    """
    values, jacobians = {}, {}
    with torch.no_grad():
        for name, (site, loc) in _unconstrained_means(guide).items():
            transform = biject_to(site["fn"].support)
            values[name] = transform(loc)
            jacobians[name] = transform.log_abs_det_jacobian(loc, values[name]).sum()
        try:
            with poutine.block():
                trace = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
        except ValueError as error:  # (Pyro's validation: e.g. a scale that underflowed to 0)
            raise ValueError(f"laplace: the model cannot be evaluated at the current mean ({error})."
                             + _unbounded(guide)) from error
        trace.compute_log_prob()
        total = 0.0
        for name, site in trace.nodes.items():
            if site["type"] != "sample":
                continue
            total += float(site["log_prob_sum"])
            if name in jacobians:  # the change of variables, not scaled with the site's log p
                total += float(jacobians[name])
    return -total


# ------------------------------------------------------------------ helpers
def _unconstrained_means(guide) -> Dict[str, tuple]:
    """Site name -> (prototype site, its unconstrained mean), for either guide kind."""
    store = pyro.get_param_store()
    if isinstance(guide, AutoNormal):
        return {name: (site, store._params[f"{guide._pyro_name}.locs.{name}"].detach())
                for name, site in guide.prototype_trace.iter_stochastic_nodes()}
    loc = store._params[f"{guide._pyro_name}.loc"].detach()
    return {site["name"]: (site, u) for site, u in guide._unpack_latent(loc)}


def _in_standard_deviations(site, step: torch.Tensor) -> float:
    """The largest element of ``step`` in units of the site's marginal standard
    deviations: :math:`\\max_i |\\delta_i| \\sqrt{\\lambda_i}`, or
    :math:`\\max_i |\\delta_i| / \\sqrt{(\\Lambda^{-1})_{ii}}` for a full covariance."""
    if isinstance(site, FullCovarianceSite):
        factor = site.factor
        return float((step.abs() / factor.square().sum(-1).sqrt()).max())
    return float((step.abs() * site.precision.sqrt()).max())


def _guide_sites(guide, args, kwargs) -> List[Union[GaussianSite, FullCovarianceSite]]:
    """The guide's Gaussian sites from the param store; sets the guide up if needed."""
    if guide.prototype_trace is None:
        with poutine.block():
            guide(*args, **kwargs)
    store = pyro.get_param_store()
    prefix = guide._pyro_name
    sites = []
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        for frame in site["cond_indep_stack"]:
            if frame.vectorized and frame.full_size is not None and frame.full_size != frame.size:
                raise NotImplementedError(
                    f"laplace: latent site '{name}' lies in the subsampled plate '{frame.name}'; "
                    "pass the full data (no subsample) for a Laplace approximation"
                )
        if isinstance(guide, AutoNormal):
            scale_name = f"{prefix}.scales.{name}"
            sites.append(GaussianSite(name, store._params[f"{prefix}.locs.{name}"],
                                      store._params[scale_name], scale_name))
    if not isinstance(guide, AutoNormal) and guide.prototype_trace is not None:
        sites = [_full_covariance_site(guide, store)]
    if not sites:
        raise ValueError("laplace: the model has no latent sample site")
    return sites


def _precision_at_mean(model, guide, elbo, sites, args, kwargs):
    """:math:`\\lambda = \\lambda_0 + h` and the next Newton step's size at the mean."""
    with poutine.trace(param_only=True) as capture:
        elbo.loss_and_grads(model, guide, *args, **kwargs)
    for node in capture.trace.nodes.values():  # leave no .grad behind
        node["value"].unconstrained().grad = None
    precision, newton_step = {}, 0.0
    for site in sites:
        stats = pop_curvature(site.loc)
        if stats is None or stats.mask is not None:
            raise RuntimeError(f"laplace: CurvatureELBO gave no full curvature for site '{site.name}'")
        lam = stats.curvature.detach().clone()
        grad = stats.grad.detach()
        if isinstance(site, FullCovarianceSite):
            if stats.prior_precision is not None:
                lam = lam + stats.prior_precision
                grad = grad + stats.prior_precision @ (site.mean - stats.prior_loc)
            factor, info = torch.linalg.cholesky_ex(lam)
            if int(info) != 0 or not bool(torch.isfinite(lam).all()):
                raise ValueError(
                    f"laplace: the precision matrix of '{site.name}' is not positive definite and "
                    f"finite (smallest eigenvalue {float(torch.linalg.eigvalsh(lam).min()):.3g}): "
                    "the mean is not a minimum of the negative log joint under curvature "
                    f"'{elbo.curvature}', or the latents are not identified by prior and data"
                )
            covariance = torch.cholesky_inverse(factor)
            step = covariance @ grad  # the next full Newton step, in marginal standard deviations
            precision[site.name] = lam
            newton_step = max(newton_step, float((step.abs() / covariance.diagonal().sqrt()).max()))
            continue
        if stats.prior_precision is not None:
            lam = lam + stats.prior_precision
            grad = grad + stats.prior_precision * (site.mean - stats.prior_loc)
        bad = ~(torch.isfinite(lam) & (lam > 0))
        if bad.any():
            raise ValueError(
                f"laplace: the precision of site '{site.name}' is not positive and finite at "
                f"{int(bad.sum())} of {lam.numel()} elements (smallest {float(lam.min()):.3g}): "
                f"the mean is not a minimum of the negative log joint under curvature "
                f"'{elbo.curvature}', or the site is not identified by prior and data"
            )
        precision[site.name] = lam
        newton_step = max(newton_step, float((grad.abs() * lam.rsqrt()).max()))
    return precision, newton_step


# ------------------------------------------------------------ prior precision
class PriorPrecisionSearch(NamedTuple):
    """What :func:`~pyro_ngvi.optimize_prior_precision` returns (unpacks as a 4-tuple)."""

    best: Union[float, Dict[str, float]]
    evidence: Dict
    result: LaplaceResult
    model: Callable


def optimize_prior_precision(
    make_model: Callable,
    candidates: Iterable[float],
    *args,
    curvature: str = "ggn",
    guide: Optional[AutoNormal] = None,
    refit: bool = True,
    sites: Optional[Sequence[str]] = None,
    callback: Optional[Callable] = None,
    **kwargs,
) -> PriorPrecisionSearch:
    """
    Choose the prior precision :math:`\\alpha` by the Laplace evidence
    (MacKay's evidence framework [2], with a grid instead of fixed-point updates):

    .. math:: \\hat\\alpha = \\arg\\max_{\\alpha \\in \\text{candidates}}
              \\log p(\\mathcal{D} \\mid \\alpha) \\approx
              -F_\\alpha(u^*_\\alpha) + \\tfrac12 \\sum_i \\log\\frac{2\\pi}{\\lambda_{\\alpha,i}}.

    **Scalar** (``sites=None``): ``make_model(alpha)`` gets a float, one value
    for every weight. **Per site** (``sites`` a list of site names):
    ``make_model(alphas)`` gets a dict ``{site: alpha}``; the search starts at
    the best common value (the scalar grid, every site alike) and then does
    one sweep of coordinate ascent: for each site in turn, every candidate with
    the other sites held at their best so far. Where the evidence separates over
    the sites (e.g. a linear model with an orthogonal design) this finds the
    maximum over the whole product grid.

    ``refit=True`` finds the mode :math:`u^*_\\alpha` of every candidate model,
    each search starting where the previous one ended (the candidates share
    guide parameters in the param store): the evidence proper. ``refit=False``
    keeps one mean for all (the guide's, or the first candidate's mode) and only
    re-evaluates prior, precision and log joint there, as post-hoc Laplace
    libraries do: cheaper, but away from a candidate's own mode the Laplace
    formula no longer approximates that candidate's evidence.

    :param make_model: returns the Pyro model for a prior precision, e.g.
        ``lambda a: BayesianNet(net, "categorical", n, prior=a ** -0.5)``, or with
        ``sites``, ``lambda a: BayesianNet(net, ..., prior={s: v ** -0.5 for s, v in a.items()})``.
    :param candidates: the prior precisions to try, in this order.
    :param args: the models' arguments (the data).
    :param str curvature: as in :func:`laplace` (default: ``"ggn"``).
    :param guide: an AutoNormal to start from (default: None, see :func:`laplace`).
    :param bool refit: re-find the mode for every candidate (default: True).
    :param sites: choose one precision per named site (default: None, one for all).
    :param callback: called as ``callback(alpha, result)`` after each evaluation
        (``alpha`` a float, or a dict with ``sites``), while the guide holds that
        approximation (to evaluate it on held-out data, or to report progress)
        (default: None).
    :param kwargs: passed on to :func:`laplace` (``num_steps``, ``lr``, ``tol``,
        ``line_search``) or to the models.
    :returns: ``(best, evidence, result, model)``: the best precision (a float,
        or ``{site: alpha}``), the log evidence of every evaluation (keyed by
        alpha, or by the tuple of per-site alphas in ``sites`` order), the best
        evaluation's :class:`LaplaceResult`, and ``make_model(best)``, the model
        with that prior. The param store (and the result's guide) holds the best
        approximation.
    """
    check_callable(make_model, "optimize_prior_precision: make_model", "a function of the prior precision")
    candidates = positive_numbers("candidates", candidates, one=True)
    if not isinstance(refit, bool) or not (callback is None or callable(callback)):
        raise ValueError(f"refit must be True or False and callback callable or None, got {refit!r} and {callback!r}")
    if sites is not None:
        sites = list(sites) if isinstance(sites, Iterable) and not isinstance(sites, str) else [sites]  # (one name too)
        if not sites or len(set(sites)) != len(sites) or not all(isinstance(n, str) for n in sites):
            raise ValueError(f"sites must be a non-empty list of distinct site names, got {sites!r}")
    results: Dict = {}
    fixed_mean: List = []
    state = {"guide": guide}  # (the guide the next evaluation starts from)

    def evaluate(alpha):
        key = alpha if sites is None else tuple(alpha[n] for n in sites)
        if key in results:
            return results[key].log_evidence
        options = dict(kwargs)
        if not refit and fixed_mean:
            _write_mean(state["guide"], fixed_mean[0])
            options["num_steps"] = 0
        result = laplace(make_model(alpha), *args, curvature=curvature, guide=state["guide"], **options)
        known = [name for name, _ in result.guide.prototype_trace.iter_stochastic_nodes()]
        if not set(sites or ()) <= set(known):  # (known once the model has run)
            raise ValueError(f"sites: {sorted(set(sites) - set(known))} are not latent sites of the model: {known}")
        results[key] = result
        if callback is not None:
            callback(alpha, result)
        if not refit:
            state["guide"] = result.guide
            if not fixed_mean:
                fixed_mean.append({name: u.clone() for name, u in result.map.items()})
        return result.log_evidence

    def common(alpha):
        return alpha if sites is None else {n: alpha for n in sites}

    best = common(max(candidates, key=lambda a: evaluate(common(a))))
    for name in sites or []:
        for alpha in candidates:
            trial = dict(best, **{name: alpha})
            if evaluate(trial) > evaluate(best):
                best = trial
    result = results[best if sites is None else tuple(best[n] for n in sites)]
    store = pyro.get_param_store()
    prefix = result.guide._pyro_name
    with torch.no_grad():
        for name, mean in result.map.items():
            if result.full_covariance:
                _full_covariance_site(result.guide, store).write_precision(mean, result.precision[name])
                continue
            scale_name = f"{prefix}.scales.{name}"
            site = GaussianSite(name, store._params[f"{prefix}.locs.{name}"], store._params[scale_name], scale_name)
            site.write(mean, result.precision[name])
    evidence = {key: r.log_evidence for key, r in results.items()}
    if len(evidence) > 1 and len(set(evidence.values())) == 1:  # (a prior that moves nothing: not used)
        warnings.warn(f"optimize_prior_precision: all {len(evidence)} candidates gave the same evidence "
                      f"{result.log_evidence:.6g}; does make_model(alpha) put alpha into the prior?", LaplaceWarning, 2)
    return PriorPrecisionSearch(best, evidence, result, make_model(best))


def _write_mean(guide, means: Dict[str, torch.Tensor]) -> None:
    store = pyro.get_param_store()
    with torch.no_grad():
        for name, mean in means.items():
            store._params[f"{guide._pyro_name}.locs.{name}" if isinstance(guide, AutoNormal)
                          else f"{guide._pyro_name}.loc"].copy_(mean)
