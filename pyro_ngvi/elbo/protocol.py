"""
The protocol around :class:`~pyro_ngvi.CurvatureELBO`: what a model may offer it,
and how it hands its statistics to :class:`~pyro_ngvi.NGVI`. The ELBO never asks
what class a model is.

**A model's own fast path.** A model that computes the statistics faster than
tracing says so:

- ``model.curvature_sources``: the sources it serves (a tuple of names);
- ``model.serves_guide(guide)`` (optional): whether its fast path takes this guide
  (``False``: the traced path serves it, as any model's; default: every guide);
- ``model.curvature_step(guide, *args, curvature=, num_particles=,
  deterministic=, mc_samples=, **kwargs)``: does what
  :meth:`~pyro_ngvi.CurvatureELBO.loss_and_grads` does (attach a
  :class:`~pyro_ngvi.handover.SiteCurvature` to every guide site's ``loc``, set
  ``.grad`` of the other parameters) and returns the loss (:func:`own_step`);
- ``model.statistics_hints(site, deterministic)`` (optional, also read on the
  traced path): a dict of further :class:`~pyro_ngvi.handover.SiteCurvature` fields
  for the site (``num_data``, ``min_precision``: what NGVI's defaults and the
  variational family follow) (:func:`statistics_hints`).

:class:`~pyro_ngvi.BayesianNet` is one.

**The hand-over to NGVI** (:mod:`pyro_ngvi.family`): one ELBO evaluation is one
hand-over (:func:`handing_over`): begun before anything is attached
(:func:`~pyro_ngvi.handover.begin_handover`), each site's statistics attached to its
unconstrained ``loc`` (:func:`~pyro_ngvi.handover.attach_curvature`), the gradient of
every other parameter in its ``.grad``; the optimizer ends it, accepting or
rejecting the step (:func:`~pyro_ngvi.handover.end_handover`). An evaluation that
fails ends it rejected, undoing the side effects registered for the step
(:func:`~pyro_ngvi.handover.on_rejected`).
"""

from contextlib import contextmanager
from typing import Callable, Dict, Optional

from ..family import begin_handover, end_handover


def own_step(model, curvature: str, antithetic: bool, guide=None) -> Optional[Callable]:
    """``model.curvature_step`` when the model serves ``curvature`` and ``guide`` itself (and
    the draws are not antithetic pairs, which only the traced path makes), else ``None``."""
    serves_guide = getattr(model, "serves_guide", None)
    if (curvature in getattr(model, "curvature_sources", ()) and not antithetic
            and (serves_guide is None or serves_guide(guide))):
        return model.curvature_step
    return None


def _no_hints(site: str, deterministic: bool) -> Dict[str, object]:
    return {}


def statistics_hints(model) -> Callable[[str, bool], Dict[str, object]]:
    """The model's own word on its statistics, ``model.statistics_hints`` (nothing when it has none)."""
    hints = getattr(model, "statistics_hints", None)
    return _no_hints if hints is None else hints


@contextmanager
def handing_over():
    """One ELBO evaluation as a hand-over: begun on entry, ended rejected on any exception."""
    begin_handover()
    try:
        yield
    except BaseException:
        end_handover(accepted=False)  # undo the evaluation's side effects
        raise
