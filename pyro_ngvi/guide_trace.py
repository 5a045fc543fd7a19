"""
The Gaussian sites of a guide, read off its trace.

A guide is whatever ``SVI`` is handed: an autoguide, a function, an autoguide inside
poutine handlers, a ``functools.partial``, a ``PyroModule``. What it *does* is in its
trace: which sites it samples, from which distributions, built from which params.
:func:`read_trace` takes natural-gradient steps only where the trace shows a
mean-field Gaussian over param tensors, in the coordinates ``u`` it samples:

.. math:: u \\sim \\mathcal{N}(\\mu, \\sigma^2) \\;[\\text{.to\\_event}(k)], \\qquad
          \\mu = \\theta_\\mu, \\qquad \\sigma = T(\\theta_\\sigma),

where :math:`\\theta_\\mu` *is* the unconstrained tensor of a ``pyro.param`` (constraint
real: the distribution's ``loc`` is the param-store tensor itself), :math:`\\theta_\\sigma`
that of a positive param whose bijection :math:`T` acts as ``exp`` or ``softplus``
(recognised by what it computes, not by ``==``), both of the site's batch shape (no
broadcasting), in any form :mod:`~pyro_ngvi.param_views` reads (rows a subsampling plate picks,
elements that several sites draw once each, a scale the guide computes as ``exp`` or
``softplus``). A site whose value is then transformed to a
constrained support (AutoNormal's ``<name>_unconstrained``, then a ``Delta``) is the
Gaussian on ``u``; the ``Delta`` trains nothing of its own.

Everything else that depends on params (a ``Delta``, another family, a ``Normal`` whose
``loc`` is a network's output or whose ``scale`` is not a param, params shared between
sites) is a :class:`NotGaussian` part: its params get the ordinary ELBO gradient from the
point optimizer. Which params a site depends on is read off the autograd graph of its
distribution and value, stopping at the values of Gaussian sites (a site built from
another site's draw depends on that draw, not on how it was drawn).
"""

import math
import random
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import ELBO, TraceTMC_ELBO

from .graph import graph_nodes
from .param_views import (GaussianBlock, computed_scale, is_broadcast_param, is_identity, join_pieces, param_of,
                          particle_dims, picked_block, piece_block, piece_of, site_weight)
from .scales import scale_bijection

#: Distribution classes read as a Gaussian (subclasses may sample otherwise).
_NORMALS = (dist.Normal, torch.distributions.Normal)


@dataclass(frozen=True)
class NotGaussian:
    """
    A guide site that gets no natural-gradient step: its params (``params``, param-store
    names) are trained by the point optimizer with the ordinary ELBO gradient.

    :param str site: the guide's sample site.
    :param str reason: why it is not read as a Gaussian.
    :param tuple params: the param-store names it trains.
    :param bool score_function: whether the site is drawn without a reparameterised sample
        (``has_rsample`` false) and not enumerated: its params' gradients are score-function
        estimates, which the point optimizer does not clamp (:mod:`pyro_ngvi.point`).
    """

    site: str
    reason: str
    params: Tuple[str, ...]
    score_function: bool = False


# --------------------------------------------------------------------------- #
# Tracing the guide without a trace left behind
# --------------------------------------------------------------------------- #


def trace_guide(guide, *args, **kwargs) -> poutine.Trace:
    """
    ``poutine.trace(guide).get_trace(*args, **kwargs)``, leaving the run as it was: the
    random streams (torch's, on the CPU and on every initialised CUDA device, Python's
    and NumPy's) are restored afterwards, so a run's draws do not change for having been
    read, and so are the buffers of a guide that is a module (BatchNorm running
    statistics of an encoder).
    """
    with _untouched(guide):
        try:
            return poutine.trace(guide).get_trace(*args, **kwargs)
        except TypeError as error:
            if args or kwargs:
                raise
            raise TypeError(
                f"NGVI reads the guide's sites off a run of it, and a run without arguments failed ({error}). "
                "Outside SVI.step NGVI does not know the guide's arguments: step it through pyro.infer.SVI, "
                "or bind them, guide = functools.partial(guide, *args), for the loss and NGVI(guide=guide)"
            ) from error


def model_params(model, guide_trace: poutine.Trace, *args, **kwargs) -> Set[str]:
    """
    The names of the params ``model`` reads when replayed against ``guide_trace`` (as an
    ELBO runs it), under :func:`trace_guide`'s guarantees (random streams and the model's
    buffers as they were). A guide param the model reads too (Pyro's ``test_median_module``:
    a ``PyroModule`` model and a guide that both call ``x_loc``) is not the guide's own.
    """
    with _untouched(model):
        trace = poutine.trace(poutine.replay(model, trace=guide_trace), param_only=True).get_trace(*args, **kwargs)
    return {name for name, site in trace.nodes.items() if site["type"] == "param"}


def elbo_traces(elbo, model, guide, *args, **kwargs) -> Optional[Tuple[poutine.Trace, poutine.Trace]]:
    """
    One ``(model_trace, guide_trace)`` as the ELBO ``elbo`` makes them (its enumeration and
    vectorised particles included: Pyro's ``ELBO._get_traces``), under :func:`trace_guide`'s
    guarantees (random streams and the modules' buffers as they were); ``None`` where ``elbo`` is
    not one of Pyro's ELBOs or ``model`` is unknown.
    """
    if model is None or not isinstance(elbo, ELBO) or not hasattr(elbo, "_get_traces"):
        return None
    with _untouched(model), _untouched(guide), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return next(iter(elbo._get_traces(model, guide, args, kwargs)))


def read_runs(guide, args, kwargs: dict, model, elbo) -> Tuple[poutine.Trace, Set[str]]:
    """The guide's trace and the names of the params the model reads (for
    :func:`~pyro_ngvi.family.guide_view`): from plain runs (:func:`trace_guide`, :func:`model_params`), or,
    where one fails (outside the ELBO's handlers a guide or model that asserts its enumerated or
    vectorised shapes raises), from the run the ELBO makes of what failed (:func:`elbo_traces`): the guide's
    plain trace is kept where only the model's replay failed (a vectorised run broadcasts the guide's params
    over the particles). Where that fails too, the plain run's error is raised."""
    trace = None
    try:
        trace = trace_guide(guide, *args, **kwargs)
        return trace, model_params(model, trace, *args, **kwargs) if model is not None else set()
    except Exception as error:
        try:
            traces = elbo_traces(elbo, model, guide, *args, **kwargs)
        except Exception:
            traces = None
        if traces is None:
            raise error
    model_trace, elbo_guide_trace = traces
    return (elbo_guide_trace if trace is None else trace,
            {name for name, node in model_trace.nodes.items() if node["type"] == "param"})


def subsampling(model, *args, **kwargs) -> float:
    """
    :math:`N/B - 1` of the most subsampled sample site of ``model`` run on ``args`` (its plates'
    ``full_size / size``, multiplied; for an observed site also its ``poutine.scale`` over the
    latents' least one, at least 1: a minibatch weighted by N/B by hand; 0 when none subsamples):
    how much noise a minibatch adds to the statistics of the latents its sites depend on, beyond one draw's
    (:func:`~pyro_ngvi.policies.noise_constants`). The model runs once, its draws from the prior, under
    ``_untouched`` (random streams and buffers as they were) and without its warnings; a model that
    cannot run alone (it needs the guide's values) counts as not subsampled.
    """
    try:
        with _untouched(model), warnings.catch_warnings(), poutine.block():
            warnings.simplefilter("ignore")
            trace = poutine.trace(model).get_trace(*args, **kwargs)
    except Exception:  # (the ELBO ran it against the guide already: its errors are the ELBO's to report)
        return 0.0
    sites = [site for site in trace.nodes.values() if site["type"] == "sample"]
    plates = [math.prod(frame.full_size / frame.size for frame in site["cond_indep_stack"]
                        if frame.full_size is not None and frame.size) for site in sites]
    # (a site's scale holds its plates' N/B already: what is left is the scale set by hand)
    latent = min((_largest(site["scale"]) / plate for site, plate in zip(sites, plates) if not site["is_observed"]),
                 default=1.0)
    factors = [max(plate, _largest(site["scale"]) / max(latent, 1.0)) if site["is_observed"] else plate
               for site, plate in zip(sites, plates)]
    return max(max(factors, default=1.0) - 1.0, 0.0)


def _largest(scale) -> float:
    return float(scale.max()) if torch.is_tensor(scale) else float(scale)


def forked_rng():
    """:func:`torch.random.fork_rng` over the CPU's stream and those of the CUDA devices in use
    (``torch.manual_seed`` inside reseeds both; restoring the CPU's alone left CUDA's changed)."""
    return torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else [])


#: How many ``_untouched`` blocks are open: a guide called inside one is read, not stepped, and
#: its draws are none of a step's (:mod:`~pyro_ngvi.draws` skips them).
_reading = [0]


def reading() -> bool:
    """Whether NGVI is running a guide or model to read it (inside ``_untouched``)."""
    return _reading[0] > 0


@contextmanager
def _untouched(module):
    """Run a block and restore the random streams and ``module`` 's buffers (if it is one); the
    guide's calls inside are no step's (:func:`reading`)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()] if isinstance(module, torch.nn.Module) else []
    python_state = random.getstate()
    numpy_state = _numpy_state()
    _reading[0] += 1
    try:
        with forked_rng():
            if _redraw[0] is not None:  # (another draw than the run's: :func:`first_consistent`)
                _seed(_redraw[0])
            yield
    finally:
        _reading[0] -= 1
        random.setstate(python_state)
        if numpy_state is not None:
            import numpy

            numpy.random.set_state(numpy_state)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


#: The seed of the draws ``_untouched`` blocks make, when not the run's own streams (None).
_redraw: List[Optional[int]] = [None]


def _seed(seed: int) -> None:
    """Seed torch's CPU stream, those of the CUDA devices in use, Python's and NumPy's (inside
    ``_untouched``, which restores them all; ``torch.manual_seed`` would also queue a seed for
    CUDA devices not yet initialised, a change left behind)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        for device in range(torch.cuda.device_count()):
            torch.cuda.default_generators[device].manual_seed(seed)
    random.seed(seed)
    if _numpy_state() is not None:
        import numpy

        numpy.random.seed(seed)


def first_consistent(read, consistent, tries: int = 16):
    """
    ``read()`` (a reading of the guide off a run of it), or, where that is not ``consistent``,
    the first of up to ``tries - 1`` readings off other draws that is (seeds 1, 2, ...; the run's
    random streams stay as they were), else the first. A guide whose structure depends on its own
    draws (a branch on a discrete site it samples) may take another branch when NGVI runs it than
    it took in the step: the reading then shows sites whose params SVI did not hand over (and hides
    the step's own Gaussians among the other params), which must not stand for the step's structure.
    """
    first = read()
    if consistent(first):
        return first
    for seed in range(1, tries):
        _redraw[0] = seed
        try:
            view = read()
        finally:
            _redraw[0] = None
        if consistent(view):
            return view
    return first


def hidden_sites(view, present: Set[int], store) -> List[str]:
    """The sites of ``view`` (a :class:`~pyro_ngvi.family.GuideView`) whose params SVI did not hand
    over (``present``: their ids): Gaussians whose ``loc`` is not among them, other parts none of whose
    params is (``store``: the param store's dict of tensors)."""
    return ([site.name for site in view.sites if id(site.loc) not in present]
            + [part.site for part in view.others if not any(id(store.get(name)) in present for name in part.params)])


def consistent_reading(view, present: Set[int], store) -> bool:
    """Whether ``view`` (a :class:`~pyro_ngvi.family.GuideView`) can stand for the structure of the step
    that handed over the tensors of ids ``present``: it shows no site whose params SVI did not hand over
    (:func:`hidden_sites`), and its run of the guide, with the model's replay, read every param SVI did
    hand over (``view.read``, where the guide and the model were run). A guide that samples a site only
    on some of its own draws (a coin decides whether ``b`` is drawn) may leave the site out of a reading
    of a step that drew it: ``b`` 's params, handed over but read by no run, were then left to the point
    optimizer, for good."""
    if hidden_sites(view, present, store):
        return False
    if view.read is None:
        return True
    read = {id(store[name]) for name in view.read if name in store}
    return present <= read


def _numpy_state():
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with pyro
        return None
    return numpy.random.get_state()


# --------------------------------------------------------------------------- #
# Reading the trace
# --------------------------------------------------------------------------- #


def read_trace(trace: poutine.Trace, claimed: Iterable[torch.Tensor] = (), store=None,
               model_reads: Iterable[str] = ()) -> Tuple[List[GaussianBlock], List[NotGaussian]]:
    """
    The Gaussian sites of a guide's ``trace`` and the other parts that depend on params.

    :param trace: a trace of the guide (:func:`trace_guide`).
    :param claimed: param-store tensors already taken by a site found otherwise (an
        ``AutoMultivariateNormal`` part): sites built from them are neither returned nor
        reported.
    :param store: the param store (default: Pyro's global one).
    :param model_reads: names of the params the model reads (:func:`model_params`): a
        Gaussian built from one of them is not a Gaussian of the guide alone.
    :returns: ``(gaussians, others)``: :class:`~pyro_ngvi.param_views.GaussianBlock` s in trace order, and a
        :class:`NotGaussian` per site that depends on params outside them (sites that
        depend on no param, e.g. AutoNormal's ``Delta`` after its Gaussian, are neither).
    """
    store = pyro.get_param_store() if store is None else store
    claimed_ids = {id(t) for t in claimed}
    values = {id(site["value"]): name for name, site in trace.nodes.items() if site["type"] == "param"}
    producers = {site["value"].grad_fn: name for name, site in trace.nodes.items()  # (a constrained value's)
                 if site["type"] == "param" and getattr(site["value"], "grad_fn", None) is not None}
    sites = [(name, site) for name, site in trace.nodes.items() if site["type"] == "sample"]
    blocks: Dict[str, GaussianBlock] = {}
    reasons: Dict[str, str] = {}
    for name, site in sites:
        block, reason = _gaussian_block(name, site, values, store, producers)
        if block is not None and (id(store._params[block.loc]) in claimed_ids
                                  or id(store._params[block.scale]) in claimed_ids):
            block, reason = None, None  # found otherwise
        if block is not None:
            blocks[name] = block
        elif reason is not None:
            reasons[name] = reason
    join_pieces(blocks, reasons, store)
    _drop_shared(blocks, reasons)
    model_reads = set(model_reads)
    for name in [name for name, b in blocks.items() if b.loc in model_reads or b.scale in model_reads]:
        block = blocks.pop(name)
        read = block.loc if block.loc in model_reads else block.scale
        reasons[name] = f"its param '{read}' is read by the model too"
    # a site built from another site's draw depends on that site, not on how it was drawn: the
    # autograd graph is read up to the draws (sample values) of the sites
    stop = {site["value"].grad_fn for _, site in sites if torch.is_tensor(site["value"])} - {None}
    while True:  # a Gaussian's params must enter no other site directly
        own = {id(store._params[p]): (name, p) for name, b in blocks.items() for p in (b.loc, b.scale)}
        uses = {name: _param_leaves(site, stop) for name, site in sites if name not in blocks}
        entered = {}
        for user, leaves in uses.items():
            for leaf in leaves:
                if id(leaf) in own:
                    entered.setdefault(own[id(leaf)][0], user)
        if not entered:
            break
        for name, user in entered.items():
            del blocks[name]
            reasons[name] = f"its params also enter site '{user}' directly"
    others = []
    for name, site in sites:
        if name in blocks or site["is_observed"]:  # an observed site (a model run inside the guide,
            continue  # as AutoMessenger guides do) is no guide part: its params are the model's
        params = []
        for leaf in uses[name]:
            if id(leaf) in claimed_ids:
                continue
            param = store.param_name(leaf)
            if param is not None and param not in params:
                params.append(param)
        if params:
            score = not getattr(site["fn"], "has_rsample", True) and not site["infer"].get("enumerate")
            others.append(NotGaussian(name, reasons.get(name, "it depends on params"), tuple(sorted(params)), score))
    unique = {id(blocks[name]): blocks[name] for name, _ in sites if name in blocks}  # (a joined block once)
    return list(unique.values()), others


def _gaussian_block(name, site, values, store, producers) -> Tuple[Optional[GaussianBlock], Optional[str]]:
    """The :class:`~pyro_ngvi.param_views.GaussianBlock` of a sample site, or ``None`` and why not."""
    fn = site["fn"]
    base = fn
    while isinstance(base, (torch.distributions.Independent, torch.distributions.TransformedDistribution)):
        if isinstance(base, torch.distributions.TransformedDistribution) and not all(
                t.bijective for t in base.transforms):
            return None, "it transforms a distribution by a map that is not a bijection"
        base = base.base_dist
    if type(base) not in _NORMALS:
        return None, _family_reason(base)
    if isinstance(fn, torch.distributions.TransformedDistribution) or isinstance(
            getattr(fn, "base_dist", None), torch.distributions.TransformedDistribution):
        if any(t.requires_grad for transform in _transforms(fn) for t in _tensors(transform)):
            return None, "it is a Normal transformed by maps with params of their own (a flow)"
    if site["is_observed"]:
        return None, "its value is given (observed or conditioned), not drawn from the guide"
    if not fn.has_rsample or not getattr(base, "has_rsample", True):
        return None, ("it has no reparameterised sampler (score-function gradients): no "
                      "curvature can be recovered from its gradients")
    if site["mask"] is not None and site["mask"] is not True:
        return None, "it is masked (poutine.mask): masked elements carry no entropy term"
    particles = particle_dims(site, base)
    loc = param_of(base.loc, values, store, particles)
    piece = piece_of(base.loc, values) if loc is None else None
    if piece is not None and is_identity(store, piece[0]):
        return piece_block(name, site, base, piece, values, store)
    picked = picked_block(name, site, base, values, store, producers) if loc is None else None
    if picked is not None:
        return picked
    if loc is None and is_broadcast_param(base.loc, values):
        return None, "its loc is a pyro.param broadcast over the site (one value shared by several elements)"
    hidden = [_hidden_param(t, values, store) for t in (base.loc, base.scale)]
    for part, param in zip(("loc", "scale"), hidden):
        if param is not None:
            return None, f"its {part} is the param '{param}', hidden from SVI (poutine.block): held fixed"
    if loc is not None and not is_identity(store, loc[0]):
        return None, (f"its loc is the param '{loc[0]}' of constraint {store._constraints[loc[0]]}: a Gaussian's "
                      "loc must be an unconstrained (real) param")
    if loc is None:
        return None, ("its loc is not a pyro.param's unconstrained tensor itself (it is computed: a network's "
                      "output, a sum, a transform)")
    scale = param_of(base.scale, values, store, particles)
    computed = computed_scale(base.scale, values, store) if scale is None else None
    if scale is None and computed is None:
        return None, ("its scale is neither a positive pyro.param of the site's shape nor the exp or softplus "
                      "of an unconstrained one")
    if computed is not None:
        scale, bijection = (computed[0], False), computed[1]
    else:
        bijection = scale_bijection(store._constraints[scale[0]])
    if bijection is None:
        return None, (f"its scale's constraint {store._constraints[scale[0]]} is not one whose bijection "
                      "is exp or softplus")
    shape = base.batch_shape
    if base.loc.shape != shape or base.scale.shape != shape:
        return None, "its loc and scale are broadcast to the site's shape"
    if loc[0] == scale[0]:
        return None, "its loc and scale are the same param"
    weight = site_weight(site)
    if weight is None:
        return None, "it is scaled by a tensor (poutine.scale), not by a number"
    return GaussianBlock(name, loc[0], scale[0], bijection, loc[1] or scale[1], weight, computed is not None), None


def _hidden_param(t, values: Dict[int, str], store) -> Optional[str]:
    """The name of a param ``t`` is computed from that the trace does not record (hidden by
    ``poutine.block``: SVI never hands it over), or ``None``."""
    if not torch.is_tensor(t) or not t.requires_grad:
        return None
    traced = set(values.values())
    leaves = [t] if t.grad_fn is None else [getattr(n, "variable", None) for n in graph_nodes([t], set())]
    names = [store.param_name(leaf) for leaf in leaves if leaf is not None]
    return next((name for name in names if name is not None and name not in traced), None)


def refuse_sampled_tmc(trace, elbo) -> None:
    """Refuse ``TraceTMC_ELBO`` where the guide draws a site several times (``num_samples`` in its
    ``infer``): the loss is then a tensor Monte Carlo bound, importance-weighted over the draws, whose
    gradients are not the ELBO's (read as the ELBO's, a Poisson model's guide diverged to a mean of 53).

    :raises NotImplementedError: naming the sites and the losses NGVI takes."""
    if not isinstance(elbo, TraceTMC_ELBO):
        return
    sampled = [name for name, node in trace.nodes.items() if node["type"] == "sample" and not node["is_observed"]
               and node["infer"].get("num_samples", 1) > 1]
    if sampled:
        raise NotImplementedError(
            f"NGVI reads the ELBO's gradients as the Bayesian learning rule's statistics; TraceTMC_ELBO with "
            f"guide sites drawn several times ({', '.join(repr(n) for n in sampled)}: num_samples) is an "
            "importance-weighted bound whose gradients are not those, and the guide would diverge. Draw each "
            "guide site once (TraceTMC_ELBO then sums the model's enumerated sites out, as TraceEnum_ELBO does), "
            "or use Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO or CurvatureELBO with NGVI, "
            "or a Pyro optimizer (pyro.optim.Adam) with this loss")


def full_covariance_prefixes(trace: poutine.Trace) -> List[str]:
    """
    The prefixes of the ``AutoMultivariateNormal`` guides that a guide's ``trace`` shows inside a
    wrapper (a partial, a messenger, ``poutine.block`` / ``condition`` / ``mask(True)`` around one):
    a ``MultivariateNormal`` site ``_{prefix}_latent``, of weight 1 and unmasked, whose ``loc`` is
    the param ``{prefix}.loc`` and whose ``scale_tril`` is ``{prefix}.scale[:, None] *
    {prefix}.scale_tril``, as pyro 1.9's ``AutoMultivariateNormal`` builds it.
    """
    found = []
    for name, site in trace.nodes.items():
        fn = site.get("fn")
        if site["type"] != "sample" or not (name[:1] == "_" and name.endswith("_latent")) or \
                type(fn) is not dist.MultivariateNormal:
            continue
        prefix = name[1:-len("_latent")]
        params = [trace.nodes.get(f"{prefix}.{p}", {}) for p in ("loc", "scale", "scale_tril")]
        scale = site["scale"]
        weighted = torch.is_tensor(scale) and scale.numel() != 1 or float(scale) != 1
        if any(p.get("type") != "param" for p in params) or not (site["mask"] is None or site["mask"] is True) \
                or weighted:
            continue
        loc, sd, tril = (p["value"].detach() for p in params)
        with torch.no_grad():
            if loc.shape == fn.loc.shape[-1:] and tril.shape == loc.shape * 2 and \
                    torch.equal(fn.loc, loc.expand_as(fn.loc)) and \
                    torch.allclose(fn.scale_tril, (sd[..., None] * tril).expand_as(fn.scale_tril)):
                found.append(prefix)
    return found


def _family_reason(base) -> str:
    if isinstance(base, dist.Delta):
        density = base.log_density
        if torch.is_tensor(density) and (density.requires_grad or bool((density != 0).any())):
            return ("it is a Delta carrying a density: a transform of another draw (AutoStructured's sites are; "
                    "for its 'normal' or 'mvn' conditionals, AutoNormal or AutoMultivariateNormal take "
                    "natural-gradient steps)")
        return "it is a Delta (a point estimate)"
    if type(base).__name__ == "LowRankPrecisionMultivariateNormal":  # pyro_ngvi.LowRankPrecisionNormal's
        return ("NGVI takes LowRankPrecisionNormal's natural-gradient steps on the guide handed to SVI "
                "itself, not on one wrapped in a handler or a subclass of it")
    if isinstance(base, dist.LowRankMultivariateNormal):
        return ("its LowRankMultivariateNormal covariance is not closed under the natural-gradient step; "
                "pyro_ngvi.LowRankPrecisionNormal is (low-rank-plus-diagonal precision)")
    if isinstance(base, dist.MultivariateNormal):
        return ("it is a MultivariateNormal: NGVI takes full-covariance steps only on an AutoMultivariateNormal "
                "(handed to SVI, in an AutoGuideList or wrapped in a handler that neither scales nor masks it), "
                "not on one under poutine.scale / mask, nor on another guide's (AutoGaussian's, a hand-written one)")
    return f"it is a {type(base).__name__}, not a Normal"


def _drop_shared(blocks: Dict[str, GaussianBlock], reasons: Dict[str, str]) -> None:
    """Sites that share a param are not mean-field blocks of their own."""
    users: Dict[str, List[str]] = {}
    for name, block in blocks.items():
        for param in (block.loc, block.scale):
            users.setdefault(param, []).append(name)
    for param, names in users.items():
        if len({id(blocks[name]) for name in names if name in blocks}) > 1:  # (a joined block: one)
            for name in names:
                if name in blocks:
                    del blocks[name]
                    reasons[name] = f"it shares the param '{param}' with site(s) " + ", ".join(
                        repr(n) for n in names if n != name)


def _param_leaves(site, stop: Set) -> List[torch.Tensor]:
    """The leaf tensors requiring grad that a site's distribution and value are computed
    from, not looking behind the autograd nodes in ``stop`` (the sites' draws: a site's own
    params are reached through its distribution's tensors)."""
    roots = list(_tensors(site["fn"]))
    value = site["value"]
    if torch.is_tensor(value):
        roots.append(value)
        try:
            roots.append(site["fn"].log_prob(value))
        except Exception:  # a log density that cannot be evaluated here: its tensors suffice
            pass
    roots = [t for t in roots if torch.is_tensor(t) and t.requires_grad]
    leaves: Dict[int, torch.Tensor] = {id(t): t for t in roots if t.grad_fn is None}
    for node in graph_nodes(roots, stop):
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves[id(variable)] = variable
    return list(leaves.values())


def _transforms(fn):
    """The transforms of the TransformedDistributions a site's distribution is made of."""
    while isinstance(fn, (torch.distributions.Independent, torch.distributions.TransformedDistribution)):
        if isinstance(fn, torch.distributions.TransformedDistribution):
            yield from fn.transforms
        fn = fn.base_dist


def _tensors(obj, depth: int = 0, seen=None):
    """Tensors held by a distribution (its parameters, its base distribution's, its
    transforms', a transform module's parameters)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, torch.nn.Module):  # a transform module (a flow's layers)
        yield from obj.parameters()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1, seen)
    elif isinstance(obj, (torch.distributions.Distribution, torch.distributions.Transform)):
        for key, item in vars(obj).items():
            if not key.startswith("_cache"):  # a transform's cache holds its last (x, y), not params
                yield from _tensors(item, depth + 1, seen)
