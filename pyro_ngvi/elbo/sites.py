"""
Reading a model's trace for :class:`~pyro_ngvi.CurvatureELBO`: the terms of

.. math:: -\\log p(x, T(u)) - \\log|\\det J_T(u)|
          = \\ell(u) + \\tfrac{\\lambda_0}{2}(u - m_0)^2 + \\text{const}

(:func:`split_terms`: the likelihood and the non-conjugate priors make
:math:`\\ell`, conjugate priors are handed over apart), the gradients of
:math:`\\ell`, the rows of subsampled plates, and the checks on what a trace holds.
"""

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

import pyro.poutine as poutine
from pyro.infer.autoguide import AutoNormal
from pyro.poutine.util import site_is_subsample
from pyro.util import check_site_shape

from ..curvature.batch_norm import frozen_batch_statistics, uses_batch_statistics
from ..curvature.traced import Terms
from ..kronecker import KroneckerNormal

Tensor = torch.Tensor


def split_terms(model_trace, guided, max_plate_nesting, prior_term: Callable[[str, dict], Optional[Tensor]]) -> Terms:
    """
    The :class:`~pyro_ngvi.curvature.traced.Terms` of :math:`\\ell` in a model trace
    (log-probabilities computed): every observed site's ``log_prob_sum`` (not
    ``pyro.deterministic`` records), and for each site in ``guided``,
    ``prior_term(name, site)``: its prior's term of :math:`\\ell`, or ``None`` when the
    prior is conjugate and handed over apart.
    """
    likelihood, prior_terms, observed = [], [], []
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample":
            continue
        if site["is_observed"]:
            if site["infer"].get("_deterministic"):
                continue  # pyro.deterministic: a recorded value, no log-density
            if max_plate_nesting < math.inf:
                check_site_shape(site, max_plate_nesting)
            likelihood.append(site["log_prob_sum"])
            observed.append(site)
            continue
        if name not in guided:
            continue
        term = prior_term(name, site)
        if term is not None:
            prior_terms.append(term)
    nonconjugate_prior = -sum(prior_terms) if prior_terms else None
    nll = -sum(likelihood) if likelihood else None
    return Terms(_add(nll, nonconjugate_prior), nonconjugate_prior, observed)


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def gradients(objective, inputs: List[Tensor], others: List[Tensor]) -> Tuple[List[Tensor], List]:
    """:math:`\\nabla\\ell` in each of ``inputs`` (zeros where it does not depend on one),
    and in each of ``others`` (``None`` there)."""
    if objective is None or not objective.requires_grad:  # none, or constant (every term masked)
        return [torch.zeros_like(x) for x in inputs], [None] * len(others)
    all_grads = torch.autograd.grad(objective, inputs + others, allow_unused=True, retain_graph=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(all_grads[: len(inputs)], inputs)]
    return grads, all_grads[len(inputs):]


def negative_log_joint(trace) -> float:
    """:math:`-\\log p` of every sample site of a trace (the model's, or the guide's)."""
    return -float(sum(site["log_prob_sum"] for site in trace.nodes.values() if site["type"] == "sample"))


def other_params(model_trace, guide_trace, guide) -> List[Tensor]:
    """Unconstrained parameters that are not the guide's locs and scales."""
    prefix = guide._pyro_name + "."
    params = {}
    for trace in (model_trace, guide_trace):
        for name, site in trace.nodes.items():
            if site["type"] == "param" and not name.startswith(prefix):
                value = site["value"].unconstrained()
                params[id(value)] = value
    return [p for p in params.values() if p.requires_grad]


def subsampled_dims(guide, name):
    """``(frame, dim, full size)`` of each subsampled plate of a guide site (``dim``
    counted from the right of the site's value, event dims included)."""
    event_dim = guide._event_dims[name]
    for frame in guide.prototype_trace.nodes[name]["cond_indep_stack"]:
        full_size = frame.full_size or frame.size
        if frame.vectorized and full_size != frame.size:
            yield frame, frame.dim - event_dim, full_size


def scatter_rows(values, guide, name, guide_trace, fill=0.0):
    """Place a subsampled site's rows into a full-size tensor; count touched rows."""
    full = values
    count = torch.ones_like(values)
    for frame, dim, full_size in subsampled_dims(guide, name):
        index = guide_trace.nodes[frame.name]["value"]
        shape = list(full.shape)
        shape[dim] = full_size
        full = torch.full(shape, fill, dtype=values.dtype, device=values.device).index_copy(dim, index, full)
        count = torch.zeros(shape, dtype=values.dtype, device=values.device).index_copy(dim, index, count)
    return full, count


def subsampled(model_trace) -> bool:
    """Whether any site is under a subsampled plate (then F at the mean changes with
    the minibatch, and values of two steps cannot be compared)."""
    return any(frame.full_size is not None and frame.full_size != frame.size
               for site in model_trace.nodes.values() if site["type"] == "sample"
               for frame in site["cond_indep_stack"])


def minibatch_sites(model_trace, names) -> set:
    """The latent sites of ``names`` outside some subsampled plate of the model: terms summed
    over a minibatch of that plate's rows reach them, so their statistics are estimates of a sum,
    noisy at the mean too (a site inside every subsampled plate, a local latent, gets the exact
    terms of its own rows)."""
    frames = {frame.name for site in model_trace.nodes.values() if site["type"] == "sample"
              for frame in site["cond_indep_stack"] if frame.full_size is not None and frame.full_size != frame.size}
    return {name for name in names
            if frames - {frame.name for frame in model_trace.nodes[name]["cond_indep_stack"]}}


def replayed(model, guide_trace, guided, args, kwargs):
    """The model's trace at the guide trace's values, log-probabilities computed
    (refused when a latent site is not in ``guided``: :func:`check_unguided`)."""
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
    check_unguided(model_trace, guided)
    model_trace.compute_log_prob()
    return model_trace


def check_guide(guide, args, kwargs) -> None:
    """Refuse a guide other than AutoNormal on the mean-field path; run it once if it has not run."""
    if isinstance(guide, KroneckerNormal):
        raise ValueError("A KroneckerNormal guide takes Kronecker factors from a BayesianNet's fast path: "
                         "curvature 'ggn' (BackPACK KFLR) or 'ggn_mc' (KFAC)")
    if not isinstance(guide, AutoNormal):
        raise NotImplementedError(
            f"CurvatureELBO supports AutoNormal and AutoMultivariateNormal guides (and KroneckerNormal on a "
            f"BayesianNet), got "
            f"{type(guide).__name__}. For AutoDiagonalNormal or an AutoGuideList use Trace_ELBO "
            "with NGVI (reparam curvature)."
        )
    run_once(guide, args, kwargs)


def run_once(guide, args, kwargs) -> None:
    """Run an autoguide once (blocked) if it has not run, so that it knows its sites."""
    if guide.prototype_trace is None:
        with poutine.block():
            guide(*args, **kwargs)


def check_unguided(model_trace, guided) -> None:
    """
    Refuse a model with a latent site the guide does not cover (a discrete site
    marked for enumeration, or any other): CurvatureELBO neither enumerates nor
    samples such sites, and running the model would draw them from the prior every
    step, a silently wrong answer.
    """
    unguided = [name for name, site in model_trace.nodes.items()
                if site["type"] == "sample" and not site["is_observed"] and name not in guided
                and not site_is_subsample(site)]
    if not unguided:
        return
    enumerated = [name for name in unguided if model_trace.nodes[name]["infer"].get("enumerate")]
    if enumerated:
        raise NotImplementedError(
            f"CurvatureELBO does not enumerate discrete sites: {', '.join(map(repr, enumerated))} "
            "is marked for enumeration (config_enumerate) and has no guide site. Train it with "
            "NGVI and pyro.infer.TraceEnum_ELBO(max_plate_nesting=...), which sums it out "
            "(NGVI then uses the reparameterisation curvature of the continuous sites)."
        )
    raise NotImplementedError(
        f"CurvatureELBO needs a guide site for every latent site of the model; "
        f"{', '.join(map(repr, unguided))} has none (the guide must cover all latent sites, "
        "as AutoNormal does for continuous ones). Discrete sites can be summed out with "
        "config_enumerate and pyro.infer.TraceEnum_ELBO."
    )


# ------------------------------------------------------------ BatchNorm on minibatch statistics
def torch_rng_state():
    """torch's random state (CPU, and CUDA where initialised), to rerun a model on the same draws."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_torch_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def frozen_observed(model, model_trace, observed, rng_state, curvature, args, kwargs) -> List[Dict]:
    """
    ``observed`` as they are, or, when their log-likelihood normalises with minibatch
    statistics (``BatchNorm`` in train mode), the observed sites of a second run of
    the model, replaying ``model_trace`` (the same latent values, subsamples) from the
    random state ``rng_state`` the first run started with (the same dropout masks),
    under :func:`~pyro_ngvi.curvature.batch_norm.frozen_batch_statistics`: the
    likelihood of the network whose ``BatchNorm`` layers hold the minibatch's
    statistics fixed, per-example separable, for the per-example curvature.
    """
    if not uses_batch_statistics([site["log_prob_sum"] for site in observed]):
        return observed
    state_after = torch_rng_state()
    _set_torch_rng_state(rng_state)
    try:
        with frozen_batch_statistics():
            trace = poutine.trace(poutine.replay(model, trace=model_trace)).get_trace(*args, **kwargs)
    finally:
        _set_torch_rng_state(state_after)
    observed = [trace.nodes[site["name"]] for site in observed]
    trace.compute_log_prob()
    if uses_batch_statistics([site["log_prob_sum"] for site in observed]):
        raise NotImplementedError(
            f"curvature='{curvature}' needs per-example terms, but the model normalises "
            "with minibatch statistics outside torch.nn.functional.batch_norm (e.g. "
            "torch.batch_norm called directly), which cannot be frozen. Use nn.BatchNorm* "
            "or F.batch_norm, or curvature='hessian' or 'reparam'."
        )
    return observed
