"""
Curvature sources: where the curvature :math:`h` of the negative log-likelihood
comes from, and which source applies where.

=========== ==================================== ====================================
source      traced path (any Pyro model)         BackPACK (:class:`~pyro_ngvi.BayesianNet`)
=========== ==================================== ====================================
reparam     :math:`g\\epsilon/\\sigma`, no extra   the same, from one backward pass
            pass
hessian     exact, by autograd (small models)    --
ef          per-example, needs a data plate      ``SumGradSquared``
ggn         Categorical, Bernoulli, Normal        ``DiagGGNExact`` (``KFLR``: Kronecker)
            likelihoods; needs a data plate
ggn_mc      any likelihood with ``.sample()``;   ``DiagGGNMC`` (``KFAC``: Kronecker)
            needs a data plate
=========== ==================================== ====================================

:data:`SOURCES` names them; :mod:`.traced` computes them at a traced particle
(:data:`.traced.ESTIMATORS`: diagonals by :mod:`.autograd`, dense matrices by
:mod:`.dense`); :mod:`.backpack` serves plain networks
(:data:`.backpack.CURVATURE_EXTENSIONS`), with :mod:`.batch_norm` for networks that
normalise with minibatch statistics, :mod:`.embedding` for ``nn.Embedding`` tables and :mod:`.mlp` computing plain MLPs' gradients and
every one of these curvatures in closed form.
"""

#: source name -> what it estimates
SOURCES = {
    "reparam": "g * eps / sigma from the ordinary ELBO gradients (any model, no extra pass)",
    "hessian": "exact Hessian diagonal by autograd (small models)",
    "ef": "VOGN's Gauss-Newton: N/B * sum of squared per-example gradients (needs a data plate)",
    "ggn_mc": "Monte-Carlo GGN: squared per-example gradients at sampled targets (needs a data plate)",
    "ggn": "exact GGN diagonal (Categorical, Bernoulli, Normal likelihoods; needs a data plate)",
}

#: Sources summing per-example terms over a data plate.
PER_EXAMPLE = ("ef", "ggn", "ggn_mc")


def check_source(curvature: str) -> str:
    """Return ``curvature`` if it names a source, else raise a ValueError listing them."""
    if not isinstance(curvature, str) or curvature not in SOURCES:
        listing = "; ".join(f"'{k}': {v}" for k, v in SOURCES.items())
        raise ValueError(f"curvature must be one of {list(SOURCES)}, got {curvature!r}. Sources: {listing}")
    return curvature


def refuse_random_modules(model, caller: str) -> None:
    """Raise a ValueError naming ``model``'s modules that draw noise in training mode (``Dropout``
    of any kind with :math:`p > 0`), for a ``caller`` that evaluates the model's density
    :math:`p(\\mathcal{D}, w)` at given weights as a function of them (the Laplace search): with
    them the function is random, and a line search on it halves its step to nothing. A ``model`` that
    is not callable raises :class:`~pyro_ngvi.arguments.ArgumentError` naming it."""
    from torch import nn

    from ..arguments import check_callable

    check_callable(model, f"{caller}: model", "a Pyro model (a callable)")

    found = [name or type(module).__name__ for name, module in model.named_modules()
             if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0
             ] if isinstance(model, nn.Module) else []
    if found:
        raise ValueError(f"{caller}: the model runs {', '.join(found)} (Dropout) in training mode, so its log "
                         "joint at the mean is random and has no mode to find; call model.eval() first (BatchNorm "
                         "then reads its running statistics) or put only the Dropout modules in eval mode")
