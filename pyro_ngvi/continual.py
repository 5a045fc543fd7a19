"""
Continual learning: yesterday's posterior is today's prior.

A fitted :class:`~pyro.infer.autoguide.AutoNormal` becomes a dict of priors
(:func:`~pyro_ngvi.posterior_as_prior`), a model takes them (:func:`~pyro_ngvi.with_priors`, a
:class:`~pyro_ngvi.handlers.PriorMessenger`, or a model's own ``with_priors``),
and the next task's guide starts at them or afresh, as the caller chooses
(:func:`~pyro_ngvi.start_task`). Those priors are Normal in the guide's coordinates, so
:class:`~pyro_ngvi.NGVI` meets them conjugately (:mod:`pyro_ngvi.priors`): for a
linear-Gaussian model, training task by task ends on the posterior of all data.

**References**

[1] Cuong V. Nguyen, Yingzhen Li, Thang D. Bui, Richard E. Turner (2018),
    "Variational Continual Learning",
    https://arxiv.org/abs/1710.10628
"""

from typing import Callable, Dict, Iterable, List

import torch
from torch.distributions import biject_to

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from .arguments import ArgumentError, check_callable, check_guide, check_priors
from .family import _full_covariance_site, _is_automultivariatenormal
from .handlers import PriorMessenger
from .priors import (
    _SiteTransformedDistribution,
    _is_real,
    _normal_and_transforms,
    conjugate_gaussian,
    conjugate_normal,
)

__all__ = ["posterior_as_prior", "start_task", "with_priors"]


def _guide_sites(guide) -> List[str]:
    return [name for name, _ in guide.prototype_trace.iter_stochastic_nodes()]


def posterior_as_prior(guide, sites=None) -> Dict[str, torch.distributions.Distribution]:
    """
    Yesterday's posterior as today's prior (variational continual learning [2]).

    For each latent site of a fitted :class:`~pyro.infer.autoguide.AutoNormal`,
    whose factor is :math:`q(u) = \\mathcal{N}(u; \\mu, \\sigma^2)` in the site's
    unconstrained coordinates, returns the same law in the site's own
    coordinates :math:`x = T(u)`, :math:`T = \\text{biject_to}(\\text{support})`:

    .. math:: p_0(x) = \\mathcal{N}(T^{-1}(x); \\mu, \\sigma^2)\\,
              |\\det J_{T^{-1}}(x)|,

    i.e. ``Normal(mu, sigma).to_event(d)`` for a real site and a
    :class:`~pyro.distributions.TransformedDistribution` of it through ``T``
    otherwise (its ``support`` is the site's). Such a prior is conjugate
    (:func:`conjugate_normal`). ``mu`` and ``sigma`` are detached clones: training
    the guide further leaves the priors unchanged. Under a subsampled plate the
    prior has the plate's full size, like the guide; :func:`with_priors` picks
    the rows of each minibatch.

    **Full covariance.** For a fitted
    :class:`~pyro.infer.autoguide.AutoMultivariateNormal` over one latent site
    with ``d`` unconstrained coordinates, :math:`q(u) = \\mathcal{N}(\\mu, C C^\\top)`
    becomes ``MultivariateNormal(mu, scale_tril=C)`` (``Normal`` for a scalar
    site), through the site's bijection as above: a correlated prior that
    :class:`~pyro_ngvi.CurvatureELBO` hands to NGVI as its precision matrix
    (:func:`~pyro_ngvi.priors.conjugate_multivariate_normal`), so it enters exactly.
    A guide over several sites is refused: per-site priors cannot carry the
    correlations between sites.

    :param guide: a fitted :class:`~pyro.infer.autoguide.AutoNormal` or
        :class:`~pyro.infer.autoguide.AutoMultivariateNormal` (of one site).
    :param sites: names of the sites to return (default: all latent sites).
    :returns: ``{site name: prior distribution}``.
    :raises NotImplementedError: for any other guide, a full-covariance guide
        over several sites or over a site that is not a vector or a scalar.
    :raises ValueError: if the guide has not been run yet, or for an unknown site; a
        ``guide`` that is no guide (not callable) or ``sites`` of another type raise
        :class:`~pyro_ngvi.arguments.ArgumentError` (a ``ValueError`` and a ``TypeError``).
    """
    check_guide(guide, "posterior_as_prior", "a fitted AutoNormal or AutoMultivariateNormal")
    if not (sites is None or isinstance(sites, (str, Iterable))):  # (before either kind of guide reads it)
        raise ArgumentError(f"posterior_as_prior: sites must be a site name or a list of them, got {sites!r}")
    if isinstance(guide, AutoMultivariateNormal):
        return _full_posterior_as_prior(guide, sites)
    if not isinstance(guide, AutoNormal):
        raise NotImplementedError(
            f"posterior_as_prior supports AutoNormal and AutoMultivariateNormal (of one site) guides; got {type(guide).__name__}."
        )
    if guide.prototype_trace is None:
        raise ValueError(
            "posterior_as_prior: the guide has not been initialised; run the guide "
            "once (guide(*args)) or take an SVI step first."
        )
    known = _guide_sites(guide)
    if sites is None:
        names = known
    else:
        names = [sites] if isinstance(sites, str) else list(sites)
        for name in names:
            if name not in known:
                raise ValueError(
                    f"posterior_as_prior: site '{name}' is not a latent site of the "
                    f"guide; its sites are {known}."
                )
    priors = {}
    for name in names:
        support = guide.prototype_trace.nodes[name]["fn"].support
        loc, scale = guide._get_loc_and_scale(name)
        loc, scale = loc.detach().clone(), scale.detach().clone()
        base = dist.Normal(loc, scale).to_event(guide._event_dims[name])
        if _is_real(support):
            priors[name] = base
        else:
            priors[name] = _SiteTransformedDistribution(base, biject_to(support), support)
    return priors


def _full_posterior_as_prior(guide, sites) -> Dict[str, torch.distributions.Distribution]:
    """:func:`posterior_as_prior` of an AutoMultivariateNormal over one site."""
    if not _is_automultivariatenormal(guide):
        raise NotImplementedError(
            f"posterior_as_prior cannot read the Gaussian of {type(guide).__name__}"
        )
    if guide.prototype_trace is None:
        raise ValueError(
            "posterior_as_prior: the guide has not been initialised; run the guide "
            "once (guide(*args)) or take an SVI step first."
        )
    known = _guide_sites(guide)
    if len(known) != 1:
        raise NotImplementedError(
            f"posterior_as_prior: this AutoMultivariateNormal covers the sites {known} jointly; "
            "per-site priors cannot carry the correlations between them. Put the correlated "
            "latents into one vector site, or give each site its own AutoMultivariateNormal "
            "inside an AutoGuideList."
        )
    (name,) = known
    if sites is not None and list([sites] if isinstance(sites, str) else sites) != [name]:
        raise ValueError(f"posterior_as_prior: the guide's only latent site is '{name}', got {sites!r}")
    site = _full_covariance_site(guide, pyro.get_param_store())
    support = guide.prototype_trace.nodes[name]["fn"].support
    u_shape = guide._unconstrained_shapes[name]
    mean, factor = site.mean.clone(), site.factor.clone()
    if len(u_shape) == 0:
        base = dist.Normal(mean[0], factor[0, 0])
    elif len(u_shape) == 1:
        base = dist.MultivariateNormal(mean, scale_tril=factor)
    else:
        raise NotImplementedError(
            f"posterior_as_prior: site '{name}' has unconstrained shape {tuple(u_shape)}; a "
            "full-covariance prior is made for vector (or scalar) sites"
        )
    prior = base if _is_real(support) else _SiteTransformedDistribution(base, biject_to(support), support)
    return {name: prior}


def with_priors(
    model: Callable, priors: Dict[str, torch.distributions.Distribution]
) -> Callable:
    """
    The same model with the priors of some latent sites replaced, e.g. by
    :func:`posterior_as_prior` of yesterday's guide::

        priors = posterior_as_prior(guide)
        model_t2 = with_priors(model, priors)
        svi = SVI(model_t2, AutoNormal(model_t2), optim, Trace_ELBO())

    A model that knows how to swap its own priors says so with a ``with_priors``
    method and is asked to: a :class:`~pyro_ngvi.BayesianNet` returns a
    :class:`~pyro_ngvi.BayesianNet` on the same plain network with those
    weights' Normal priors replaced, so that :class:`~pyro_ngvi.CurvatureELBO`
    keeps its BackPACK fast path. Any other model is wrapped in a
    :class:`~pyro_ngvi.handlers.PriorMessenger`.

    :param model: a Pyro model.
    :param priors: ``{site name: distribution}``; see :class:`~pyro_ngvi.handlers.PriorMessenger`
        (and :meth:`~pyro_ngvi.BayesianNet.with_priors`) for the checks made.
    :returns: the new model.
    :raises ValueError: (an :class:`~pyro_ngvi.arguments.ArgumentError`) naming ``model`` when it is
        not callable, ``priors`` when it is not a dict.
    """
    check_callable(model, "with_priors: model", "a Pyro model (a callable)")
    own = getattr(model, "with_priors", None)
    if not (isinstance(priors, dict) and callable(own)):  # (a model's own with_priors checks the values)
        check_priors(priors, "with_priors")
    if callable(own):
        return own(priors)
    return PriorMessenger(priors)(model)


# --------------------------------------------------------------------------- #
# Where the next task's guide starts
# --------------------------------------------------------------------------- #


def start_task(guide, priors, *args, carry: bool, **kwargs):
    """
    Set up a new task's :class:`~pyro.infer.autoguide.AutoNormal` guide and make
    where it starts an explicit choice.

    Pyro's param store outlives guides: a new ``AutoNormal`` named like an old
    one (the default name is ``"AutoNormal"``) silently takes the old guide's
    ``locs.<site>`` / ``scales.<site>`` for every site of the same name, i.e.
    starts at yesterday's posterior, mean *and* precision, and may even reuse
    a tensor of another shape for a site that only shares a name (a new task's
    head). This helper first removes every ``locs.*`` / ``scales.*`` entry under
    the guide's name, sets the guide up on ``args`` (one minibatch is enough; the
    guide's run draws from :math:`q` and so advances the global RNG, as any run
    of it does), and then

    - ``carry=True``: starts each site named in ``priors`` at that prior, which
      must be Normal in the site's unconstrained coordinates (what
      :func:`posterior_as_prior` gives): :math:`\\mu = m_0`,
      :math:`\\sigma = s_0`. With ``priors = posterior_as_prior(old_guide)`` the
      new guide starts at the previous posterior, so the natural-gradient
      precision :math:`\\lambda = \\sigma^{-2}` of :class:`~pyro_ngvi.NGVI` is
      carried from task to task, and the initial KL to the new prior is zero;
    - ``carry=False``: every site starts at the guide's own initialisation
      (``init_loc_fn``, ``init_scale``), as on the first task.

    Sites not named in ``priors`` start at the guide's initialisation either way.
    The optimizer's own per-site state (momentum, :class:`~pyro_ngvi.NGVI`'s
    first-step warm start) belongs to the optimizer instance: use a new
    :class:`~pyro_ngvi.NGVI` per task, as in::

        priors = None
        for data in tasks:
            guide = start_task(AutoNormal(model), priors, *data[0], carry=True)
            svi = SVI(model, guide, NGVI(...), CurvatureELBO("ggn"))
            ...                                       # train on data
            priors = posterior_as_prior(guide)
            model = with_priors(model, priors)

    For an :class:`~pyro.infer.autoguide.AutoMultivariateNormal` the guide's
    ``loc``, ``scale`` and ``scale_tril`` are removed instead, and ``carry=True``
    sets each named site's block of the mean and covariance to its prior's
    (Gaussian in ``u``: :func:`~pyro_ngvi.priors.conjugate_gaussian`), with no
    correlation to the other sites.

    :param guide: a new :class:`~pyro.infer.autoguide.AutoNormal` or
        :class:`~pyro.infer.autoguide.AutoMultivariateNormal`, not run yet.
    :param priors: ``{site name: prior}`` (or ``None`` for none), usually
        :func:`posterior_as_prior` of the previous guide; every name must be a
        latent site of the guide.
    :param args: model arguments to set the guide up with (e.g. a minibatch).
    :param bool carry: start at the priors (``True``) or at the guide's
        initialisation (``False``); required, there is no default.
    :param kwargs: model keyword arguments.
    :returns: ``guide``, set up.
    :raises ValueError: if the guide has been run already, for a name that is
        not a latent site, and with ``carry=True`` for a prior that is not
        Normal in the site's unconstrained coordinates or whose shape does not
        broadcast to the site's (the site is named). A refused call leaves the param
        store as it was and the guide not set up, so that it may be called again.
        A ``guide`` that is no guide (not callable), ``priors`` that are not a dict of
        distributions by site name, or a ``carry`` that is not a bool raise
        :class:`~pyro_ngvi.arguments.ArgumentError` (a ``ValueError`` and a ``TypeError``)
        naming the argument, before the param store is touched.
    """
    check_guide(guide, "start_task", "a new AutoNormal or AutoMultivariateNormal")
    full = _is_automultivariatenormal(guide)
    if not (isinstance(guide, AutoNormal) or full):
        raise NotImplementedError(
            f"start_task supports AutoNormal and AutoMultivariateNormal guides; got {type(guide).__name__}."
        )
    if not isinstance(carry, bool):
        raise ArgumentError(f"start_task: carry must be True or False, got {carry!r}")
    if guide.prototype_trace is not None:
        raise ValueError(
            "start_task: the guide has already been run; pass a new AutoNormal "
            "(its initial values are gone once it is set up)."
        )
    priors = check_priors(priors, "start_task", allow_none=True)
    store = pyro.get_param_store()
    prefixes = (f"{guide._pyro_name}.locs.", f"{guide._pyro_name}.scales.")
    full_names = {f"{guide._pyro_name}.{part}" for part in ("loc", "scale", "scale_tril")}

    def owned():  # the guide's own entries of the param store
        return [n for n in store.keys() if (n in full_names if full else n.startswith(prefixes))]

    removed = {name: (store._params[name], store._constraints[name]) for name in owned()}
    for param_name in removed:
        del store[param_name]
    try:
        with poutine.block():
            guide(*args, **kwargs)
        known = _guide_sites(guide)
        for name in priors:
            if name not in known:
                raise ValueError(
                    f"start_task: site '{name}' is not a latent site of the guide; "
                    f"its sites are {known}."
                )
        if carry and full:
            _start_full_at(guide, priors)
        elif carry:
            for name, prior in priors.items():
                _start_at(guide, name, prior)
    except BaseException:  # refused: the param store as it was, the guide not set up (a retry may follow)
        for param_name in owned():
            del store[param_name]
        for param_name, (param, constraint) in removed.items():
            store._params[param_name], store._constraints[param_name] = param, constraint
            store._param_to_name[param] = param_name
        guide.prototype_trace = None
        raise
    return guide


@torch.no_grad()
def _start_full_at(guide, priors) -> None:
    """Start an AutoMultivariateNormal at Gaussian priors: each named site's block of
    the mean and covariance is the prior's (in ``u``), uncorrelated with the rest."""
    site = _full_covariance_site(guide, pyro.get_param_store())
    mean, factor = site.mean.clone(), site.factor
    covariance = factor @ factor.T
    position = 0
    for name, _ in guide.prototype_trace.iter_stochastic_nodes():
        size = int(torch.Size(guide._unconstrained_shapes[name]).numel())
        block = slice(position, position + size)
        position += size
        if name not in priors:
            continue
        support = guide.prototype_trace.nodes[name]["fn"].support
        prior = conjugate_gaussian(priors[name], support)
        if prior is None or prior[0].numel() != size:
            raise ValueError(
                f"start_task(carry=True): prior for site '{name}' is not Gaussian over the "
                f"site's {size} unconstrained coordinates (support {support}), so the guide "
                "cannot start at it; posterior_as_prior gives such priors. Use carry=False."
            )
        factor, info = torch.linalg.cholesky_ex(prior[1])  # (of the precision)
        usable = int(info) == 0 and bool(torch.isfinite(prior[0]).all()) and bool((factor.diagonal() > 0).all())
        block_covariance = torch.cholesky_inverse(factor) if usable else factor
        if not (usable and torch.isfinite(block_covariance).all()):
            raise ValueError(f"start_task: prior for site '{name}' has a non-finite mean or a precision that is not "
                             "finite and positive definite; the guide cannot start at it")
        mean[block] = prior[0]
        covariance[block, :] = 0.0
        covariance[:, block] = 0.0
        covariance[block, block] = block_covariance
    factor, info = torch.linalg.cholesky_ex(covariance)
    if int(info) != 0:
        raise ValueError("start_task: the guide's covariance with the priors' blocks is not numerically positive "
                         "definite; the guide cannot start at it")
    site.write(mean, factor)


@torch.no_grad()
def _start_at(guide, name: str, prior) -> None:
    """Write ``prior``'s Normal (in ``u``) into the guide's loc and scale of ``name``."""
    support = guide.prototype_trace.nodes[name]["fn"].support
    if conjugate_normal(prior, support) is None:
        raise ValueError(
            f"start_task(carry=True): prior for site '{name}' is not Normal in the "
            f"site's unconstrained coordinates (support {support}), so the guide "
            "cannot start at it; posterior_as_prior gives such priors. Use carry=False."
        )
    normal, _ = _normal_and_transforms(prior)
    store = pyro.get_param_store()
    loc = store._params[f"{guide._pyro_name}.locs.{name}"]  # real: loc is unconstrained
    scale_name = f"{guide._pyro_name}.scales.{name}"
    raw_scale = store._params[scale_name]
    shape = loc.shape
    try:
        broadcast = torch.broadcast_shapes(normal.loc.shape, normal.scale.shape, shape)
    except RuntimeError:
        broadcast = None
    if broadcast != shape:
        raise ValueError(
            f"start_task: prior for site '{name}' has loc {tuple(normal.loc.shape)} and "
            f"scale {tuple(normal.scale.shape)} in unconstrained coordinates; the "
            f"guide's are {tuple(shape)}."
        )
    if not (torch.isfinite(normal.loc).all() and torch.isfinite(normal.scale).all() and (normal.scale > 0).all()):
        raise ValueError(f"start_task: prior for site '{name}' has a non-finite loc or a scale that is not "
                         "positive and finite; the guide cannot start at it")
    loc.copy_(normal.loc.expand(shape))
    raw_scale.copy_(biject_to(store._constraints[scale_name]).inv(normal.scale.expand(shape)))
