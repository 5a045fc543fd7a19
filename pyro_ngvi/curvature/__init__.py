"""
Curvature sources: where the diagonal curvature :math:`h` of the negative
log-likelihood comes from. :mod:`.autograd` works for any Pyro model;
:mod:`.backpack` serves plain networks (:class:`~pyro_ngvi.nn.BayesianNet`).
"""

#: source name -> what it estimates
SOURCES = {
    "reparam": "g * eps / sigma from the ordinary ELBO gradients (any model, no extra pass)",
    "hessian": "exact Hessian diagonal by autograd (small models)",
    "ef": "VOGN's Gauss-Newton: N/B * sum of squared per-example gradients (needs a data plate)",
    "ggn_mc": "Monte-Carlo GGN: squared per-example gradients at sampled targets (needs a data plate)",
    "ggn": "exact GGN diagonal (Categorical, Bernoulli, Normal likelihoods; needs a data plate)",
}


def check_source(curvature: str) -> str:
    """Return ``curvature`` if it names a source, else raise a ValueError listing them."""
    if curvature not in SOURCES:
        listing = "; ".join(f"'{k}': {v}" for k, v in SOURCES.items())
        raise ValueError(f"curvature must be one of {list(SOURCES)}, got {curvature!r}. Sources: {listing}")
    return curvature
