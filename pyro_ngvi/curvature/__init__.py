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
