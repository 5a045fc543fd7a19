"""
The one protocol by which an ELBO hands curvature to :class:`~pyro_ngvi.NGVI`:
:class:`SiteCurvature`, attached to the site's unconstrained ``loc`` tensor with
:func:`attach_curvature` (BackPACK style: the result lives on the parameter) and taken
off by :func:`pop_curvature`, under a hand-over that the ELBO begins
(:func:`begin_handover`) and the optimizer ends (:func:`end_handover`), accepting or
rejecting the step; side effects of the evaluation that a rejected step must not leave
behind (BatchNorm running statistics) are registered with :func:`on_rejected`.
"""

import operator
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

_CURVATURE_ATTR = "_pyro_ngvi_curvature"
#: The id of the live hand-over (one per ELBO evaluation), see :func:`begin_handover`.
_live_handover = [0]
#: How to undo the live hand-over's side effects, should the optimizer reject the step.
_undo: List[Callable[[], None]] = []

@dataclass
class PriorParam:
    """
    A ``pyro.param`` of the model that the ``loc`` or the ``scale`` of a site's
    conjugate Normal prior (in ``u``) is, broadcast over the site: the prior
    hyperparameter :class:`~pyro_ngvi.NGVI` sets by type-II maximum likelihood
    (:func:`~pyro_ngvi.priors.update_learned_priors`) instead of the point
    optimizer.

    :param str name: the param's name in the param store.
    :param torch.Tensor unconstrained: its unconstrained tensor there (written in place).
    :param constraint: its constraint (the value is ``transform_to(constraint)(unconstrained)``).
    :param torch.Tensor index: integer tensor of the site's ``loc`` shape: element
        :math:`i` of the site has the prior loc (or scale) ``value.reshape(-1)[index[i]]``.
    """

    name: str
    unconstrained: torch.Tensor
    constraint: object
    index: torch.Tensor


@dataclass
class SiteCurvature:
    """
    What an ELBO hands :class:`~pyro_ngvi.NGVI` for one guide site. Every tensor
    has the shape of the site's ``loc`` (all rows, also under a subsampled plate),
    except for a :class:`~pyro_ngvi.family.FullCovarianceSite` (``loc`` of shape ``(D,)``), whose
    ``curvature`` and ``prior_precision`` are symmetric ``(D, D)`` matrices.

    :param torch.Tensor grad: gradient of the non-conjugate part :math:`\\ell`
        of the negative log joint w.r.t. ``u`` (likelihood plus any prior that is
        not Normal in ``u``), averaged over particles and divided by the site's
        own plate scale, so touched rows carry their full-data value.
    :param torch.Tensor curvature: diagonal curvature :math:`h` of the same part.
    :param prior_loc: mean :math:`m_0` of a conjugate Normal prior in ``u``,
        or ``None`` when the prior is already inside ``grad``/``curvature``.
    :param prior_precision: precision :math:`\\lambda_0` of that prior, or ``None``.
    :param mask: boolean tensor of the rows this step touched (``None``: all).
    :param bool sampled: ``grad`` and ``curvature`` are noisy estimates: taken at a draw
        (any source; the Price estimate :math:`g\\epsilon/\\sigma`, whose noise grows with
        :math:`|g|`), or at the mean from a minibatch of a subsampled plate; the optimizer
        averages them (the adaptive steps) and bounds the mean step (the trust region).
    :param bool nonnegative: ``curvature`` is :math:`\\ge 0` by construction
        (Gauss-Newton, Fisher): with a conjugate prior the precision target is
        then positive and the optimizer skips its positivity correction.
    :param scale: the guide's :math:`\\sigma` the ELBO read this step, or ``None``
        (the optimizer then reads it from the param store itself).
    :param bool whitened: (full-covariance sites) ``curvature`` is
        :math:`C^\\top H C`, in the coordinates that whiten the guide's Gaussian
        (:func:`~pyro_ngvi.full_covariance.whiten`): what the Price estimate gives
        without an inverse.
    :param prior_loc_param: the :class:`PriorParam` that ``prior_loc`` is, or ``None``
        (a fixed prior loc).
    :param prior_scale_param: the :class:`PriorParam` that the prior scale
        :math:`\\lambda_0^{-1/2}` is, or ``None`` (a fixed prior scale).
    :param float prior_weight: the weight of each row's :math:`\\mathrm{KL}(q \\| p_0)`
        in the full-data ELBO (a ``poutine.scale`` factor; 1 for a plain model),
        used to pool sites that share a learned prior param.
    :param eps_mean: for a Price estimate whose draws are known, the mean over
        particles of the standard-normal draws :math:`\\epsilon` (``u = mu + sigma eps``);
        with ``eps_sq_mean`` (the mean of :math:`\\epsilon^2`) NGVI subtracts a
        control variate from ``(grad, curvature)``; ``None`` otherwise.
    :param eps_sq_mean: see ``eps_mean``; ``None`` beside ``eps_mean`` when ``curvature`` is
        exact at the draws (not a Price estimate): then only the gradient's control variate applies.
    :param float objective: for statistics evaluated at the mean (``deterministic``),
        :math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J_T(\\mu)|` there (the same
        for every site of the evaluation), whose Newton step the update is; NGVI's
        step safeguard compares it between steps. ``None`` otherwise.
    :param list arguments: what ``objective`` was evaluated on, the model and its arguments
        (:func:`~pyro_ngvi.safeguards.evaluated_on`): the safeguard compares values of
        :math:`F` on the same ones only. ``None``: not known (compared).
    :param int num_data: set when ``grad`` and ``curvature`` are minibatch
        estimates of sums over ``num_data`` examples (a
        :class:`~pyro_ngvi.BayesianNet`'s): :class:`~pyro_ngvi.NGVI` then resolves
        its defaults for minibatch training, the damping relative to ``num_data``
        included (``None``: full-batch statistics).
    :param min_precision: the least precision :math:`\\lambda_{\\min}` the
        variational family allows the site (a cap :math:`\\lambda_{\\min}^{-1/2}` on
        its standard deviation; a tensor of the ``loc``'s shape: an expanded view of
        one number costs no memory), or ``None``:
        :class:`~pyro_ngvi.NGVI` keeps :math:`\\lambda' \\ge \\lambda_{\\min}` (the
        step projected on the family).
    :param loss: the ELBO evaluation's loss (the negative ELBO estimate ``SVI.step``
        returns; a 0-d tensor or a float, the same for every site of the
        evaluation), for :class:`~pyro_ngvi.NGVI`'s watch on a worsening ELBO, or
        ``None``.
    :param bool watched: ``False`` where the evaluation's loss is not one family's ELBO (a
        family that moves with its means, ``noise_limit_mode="mean"``): the watch is then not
        fed, not even with the loss ``SVI.step`` computed.
    :param int handover: the ELBO evaluation that made these statistics
        (set by :func:`attach_curvature`).
    :param bool fitted: every tensor already has the dtype, device and shape of the
        site's ``loc`` (an ELBO that makes them so says it; NGVI then checks nothing).
    :param bool gradients: ``grad`` and ``curvature`` are still the ordinary gradients of the
        site's ``loc`` and raw scale (:mod:`~pyro_ngvi.statistics`): the element-wise pass
        recovers :math:`g` and :math:`h` from them, span by span (and the draws too where
        ``draws``), instead of a pass of its own over the site.
    :param bool draws: with ``gradients``, the draws are recoverable (one draw per step).
    :param int particles: the number of draws ``eps_mean`` averages (1: one draw).
    """

    grad: torch.Tensor
    curvature: torch.Tensor
    prior_loc: Optional[torch.Tensor] = None
    prior_precision: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    sampled: bool = False
    nonnegative: bool = False
    scale: Optional[torch.Tensor] = None
    prior_loc_param: Optional[PriorParam] = None
    prior_scale_param: Optional[PriorParam] = None
    prior_weight: float = 1.0
    handover: int = 0
    whitened: bool = False
    eps_mean: Optional[torch.Tensor] = None
    eps_sq_mean: Optional[torch.Tensor] = None
    objective: Optional[float] = None
    arguments: Optional[list] = None
    num_data: Optional[int] = None
    min_precision: Optional[torch.Tensor] = None
    loss: Optional[torch.Tensor] = None
    watched: bool = True
    fitted: bool = False
    gradients: bool = False
    draws: bool = False
    particles: int = 1

    def prior_params(self) -> List[PriorParam]:
        """The learned prior params of this site (none, one or two)."""
        return [p for p in (self.prior_loc_param, self.prior_scale_param) if p is not None]


def begin_handover() -> int:
    """
    Start a new hand-over: an ELBO calls this once per evaluation, before it
    attaches anything. Statistics attached under an earlier hand-over (an
    evaluation whose optimizer step never came: an exception, an interrupt, a
    call outside ``SVI``) are stale from now on and never reach the optimizer;
    that evaluation's side effects stay (as after any forward pass).
    """
    _live_handover[0] += 1
    del _undo[:]  # (clear, without a call)
    return _live_handover[0]


def live_handover() -> int:
    """The id of the live hand-over."""
    return _live_handover[0]


def on_rejected(undo: Callable[[], None]) -> None:
    """
    Register how to undo a side effect of the live evaluation (a model's
    BatchNorm running statistics), run by :func:`end_handover` should the
    optimizer reject the step (skip it, or fail before its update).
    """
    _undo.append(undo)


def end_handover(accepted: bool) -> None:
    """
    The optimizer's verdict on the live hand-over: when not ``accepted``, undo
    the side effects registered with :func:`on_rejected` (latest first). Either
    way the hand-over closes: statistics still attached are stale.
    """
    undo = _undo[::-1]
    del _undo[:]  # (clear, without a call)
    _live_handover[0] += 1
    if not accepted:
        for action in undo:
            action()


def attach_curvature(loc: torch.Tensor, stats: SiteCurvature) -> None:
    """Hand ``stats`` to the optimizer on the site's unconstrained ``loc`` tensor,
    under the live hand-over (replacing anything stale left there)."""
    stats.handover = _live_handover[0]
    setattr(loc, _CURVATURE_ATTR, stats)


def attach_curvatures(locs: List[torch.Tensor], stats: List[SiteCurvature]) -> None:
    """:func:`attach_curvature` of each of ``stats`` to its site's ``loc``."""
    live = _live_handover[0]
    for loc, s in zip(locs, stats):
        s.handover = live
        loc.__dict__[_CURVATURE_ATTR] = s  # (setattr's effect on a tensor, without a call per site)


def pop_curvature(loc: torch.Tensor) -> Optional[SiteCurvature]:
    """Take the :class:`SiteCurvature` of the live hand-over off ``loc`` (``None``
    when there is none; stale statistics are dropped)."""
    stats = getattr(loc, _CURVATURE_ATTR, None)
    if stats is None:
        return None
    delattr(loc, _CURVATURE_ATTR)
    return stats if stats.handover == _live_handover[0] else None


def take_curvatures(locs: List[torch.Tensor]) -> list:
    """:func:`pop_curvature` of each of ``locs``, stale statistics included (the caller compares
    their ``handover`` with :func:`live_handover`), in one call: each tensor's attribute taken off
    its ``__dict__`` (where ``setattr`` put it) by ``map``, not one call per tensor."""
    return list(map(_TAKE, map(vars, locs)))


def give_back(locs: List[torch.Tensor], taken: list) -> None:
    """Attach what :func:`take_curvatures` took off ``locs`` again (as it was)."""
    for loc, stats in zip(locs, taken):
        if stats is not None:
            setattr(loc, _CURVATURE_ATTR, stats)


_TAKE = operator.methodcaller("pop", _CURVATURE_ATTR, None)
