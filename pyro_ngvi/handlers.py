"""
:class:`PriorMessenger`: an effect handler that swaps the priors of named latent
sites, so that traces, ELBOs, autoguides and :class:`~pyro.infer.Predictive` all
see the new prior (Pyro's way to change how a model runs without rewriting it).
Under a subsampled plate it picks the prior's rows of the current minibatch.
"""

from typing import Dict, Optional

import torch
from torch.distributions.transforms import ComposeTransform, Transform

import pyro.distributions as dist
from pyro.distributions.torch_distribution import ExpandedDistribution
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.subsample_messenger import SubsampleMessenger, _Subsample

from .arguments import check_priors
from .priors import (
    _SiteTransformedDistribution,
    _bijection_and_u_shape,
    _device_of,
    _is_real,
    _same_map,
    _same_support,
    _tensors_in,
)

__all__ = ["PriorMessenger"]


# --------------------------------------------------------------------------- #
# Selecting the rows of a subsample
# --------------------------------------------------------------------------- #


def _has_batched_tensors(transform: Transform) -> bool:
    return any(t.numel() > 1 for t in _tensors_in(transform))


def _select_rows(fn, dim: int, index: torch.Tensor):
    """
    ``fn`` restricted to the rows ``index`` along batch dimension ``dim``
    (counted from the left of ``fn.batch_shape``; leading batch dimensions keep
    their position through ``Independent``, ``expand`` and transforms).

    :raises NotImplementedError: for a distribution whose parameters cannot be
        indexed this way.
    """
    if isinstance(fn, torch.distributions.Independent):
        return dist.Independent(
            _select_rows(fn.base_dist, dim, index), fn.reinterpreted_batch_ndims
        )
    if isinstance(fn, ExpandedDistribution):
        batch_shape = list(fn.batch_shape)
        batch_shape[dim] = len(index)
        base = fn.base_dist
        base_dim = dim - (len(fn.batch_shape) - len(base.batch_shape))
        if base_dim >= 0 and base.batch_shape[base_dim] != 1:
            base = _select_rows(base, base_dim, index)
        return base.expand(torch.Size(batch_shape))
    params = {k: fn.__dict__[k] for k in fn.arg_constraints if k in fn.__dict__}
    if params:
        batch_ndim = len(fn.batch_shape)
        selected = {}
        for key, value in params.items():
            if (
                not isinstance(value, torch.Tensor)
                or value.shape[:batch_ndim] != fn.batch_shape
            ):
                break
            selected[key] = value.index_select(dim, index.to(value.device))
        else:
            try:
                return type(fn)(**selected)
            except (TypeError, ValueError):
                pass
    if (
        isinstance(fn, torch.distributions.TransformedDistribution)
        and type(fn).log_prob is torch.distributions.TransformedDistribution.log_prob
        and not any(_has_batched_tensors(t) for t in fn.transforms)
    ):
        # keep the support fn reports (LogNormal's, or a site's)
        base = _select_rows(fn.base_dist, dim, index)
        return _SiteTransformedDistribution(base, fn.transforms, fn.support)
    raise NotImplementedError(
        f"cannot select subsample rows of a {type(fn).__name__} prior"
    )


def _plate_indices(name: str) -> Optional[torch.Tensor]:
    """The current subsample of the active plate ``name`` (from Pyro's stack)."""
    for messenger in reversed(_PYRO_STACK):
        if isinstance(messenger, SubsampleMessenger) and messenger.name == name:
            return messenger.indices
    return None


# --------------------------------------------------------------------------- #
# The handler
# --------------------------------------------------------------------------- #


class PriorMessenger(Messenger):
    """
    Replaces the distributions of named latent sample sites by new priors.

    At a site named in ``priors`` the model's ``fn`` is swapped for the prior
    before the site's value is drawn, replayed or scored, so traces, ELBOs,
    autoguides and :class:`~pyro.infer.Predictive` all see the new prior. Apply
    it around the model (as :func:`with_priors` does), so that the model's own
    plates have already broadcast the site when the handler sees it.

    Under a subsampled plate a prior of the plate's full size (as
    :func:`posterior_as_prior` makes) is indexed by the plate's current subsample
    indices; a prior of size 1 along the plate broadcasts. The prior's batch shape
    must otherwise broadcast to the site's, and its event shape equal the site's.

    Each of these is a :class:`ValueError` naming the site: a prior for an
    observed site; a shape mismatch; a support mismatch (supports count as equal
    when their bijections do the same, e.g. ``positive`` and ``nonnegative``; a
    :class:`~torch.distributions.TransformedDistribution` of a real base whose
    transforms do what ``biject_to(site support)`` does takes the site's support,
    whatever its last transform reports); and, when the model returns, a prior
    for a site that never reached the handler.

    :param priors: ``{site name: distribution}``.
    """

    def __init__(self, priors: Dict[str, torch.distributions.Distribution]) -> None:
        super().__init__()
        self.priors = dict(check_priors(priors, "PriorMessenger"))
        self._seen: set = set()

    def __enter__(self):
        self._seen = set()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None:
            unused = sorted(set(self.priors) - self._seen)
            if unused:
                raise ValueError(
                    f"with_priors: the model never sampled site(s) {unused} "
                    "(misspelt, or hidden by poutine.block inside the model?)."
                )

    def _pyro_sample(self, msg) -> None:
        name = msg["name"]
        if name not in self.priors or isinstance(msg["fn"], _Subsample):
            return
        self._seen.add(name)
        if msg["is_observed"]:
            raise ValueError(
                f"with_priors: site '{name}' is observed; priors replace latent sites only."
            )
        msg["fn"] = self._site_prior(name, msg)

    def _site_prior(self, name: str, msg) -> torch.distributions.Distribution:
        site_fn = msg["fn"]
        prior = self.priors[name]
        batch_shape = site_fn.batch_shape
        # 1. rows of the current subsample
        for frame in msg["cond_indep_stack"]:
            if frame.dim is None or frame.full_size is None:
                continue
            if frame.size == frame.full_size:
                continue
            if len(prior.batch_shape) < -frame.dim:
                continue
            size = prior.batch_shape[frame.dim]
            if size == 1:
                continue
            if size != frame.full_size:
                raise ValueError(
                    f"with_priors: prior for site '{name}' has size {size} along "
                    f"plate '{frame.name}' (dim {frame.dim}); expected the plate's "
                    f"full size {frame.full_size} (the subsample's rows are selected) or 1."
                )
            index = _plate_indices(frame.name)
            if index is None:
                raise ValueError(
                    f"with_priors: site '{name}': plate '{frame.name}' is not active."
                )
            try:
                prior = _select_rows(prior, len(prior.batch_shape) + frame.dim, index)
            except NotImplementedError as error:
                raise ValueError(
                    f"with_priors: site '{name}' under subsampled plate "
                    f"'{frame.name}': {error}."
                ) from error
        # 2. shape
        if prior.event_shape != site_fn.event_shape:
            raise ValueError(
                f"with_priors: prior for site '{name}' has event shape "
                f"{tuple(prior.event_shape)}, the site has {tuple(site_fn.event_shape)} "
                "(use .to_event(...) to move batch dims into the event)."
            )
        try:
            broadcast = torch.broadcast_shapes(prior.batch_shape, batch_shape)
        except RuntimeError:
            broadcast = None
        if broadcast != batch_shape:
            raise ValueError(
                f"with_priors: prior for site '{name}' has batch shape "
                f"{tuple(prior.batch_shape)}, which does not broadcast to the site's "
                f"{tuple(batch_shape)}."
            )
        # 3. support
        site_support = site_fn.support
        x_shape = batch_shape + site_fn.event_shape
        device = _device_of(prior)
        if not _same_support(prior.support, site_support, x_shape, device):
            fixed = self._with_site_support(prior, site_support, device)
            if fixed is None:
                raise ValueError(
                    f"with_priors: prior for site '{name}' has support {prior.support}, "
                    f"the site has {site_support}."
                )
            prior = fixed
        if prior.batch_shape != batch_shape:
            prior = prior.expand(batch_shape)
        return prior

    @staticmethod
    def _with_site_support(prior, site_support, device):
        """
        ``prior`` with the site's support when it is a transformed real base whose
        transforms do what ``biject_to(site_support)`` does; else ``None``.
        """
        if not isinstance(prior, torch.distributions.TransformedDistribution):
            return None
        if not _is_real(prior.base_dist.support):
            return None
        if prior.support.event_dim != site_support.event_dim:
            return None
        bijection, u_shape = _bijection_and_u_shape(site_support, prior.batch_shape + prior.event_shape)
        if bijection is None:
            return None
        if not _same_map(ComposeTransform(list(prior.transforms)), bijection, u_shape, device):
            return None
        return _SiteTransformedDistribution(prior.base_dist, prior.transforms, site_support)

