"""
Which param-store tensors a guide site's ``loc`` and ``scale`` are (:func:`param_of`): the param's
value itself or an expand view of it of the same layout; its rows, picked by a subsampling plate
(``pyro.param`` inside the plate, or ``loc[ind]`` with the plate's indices: :func:`picked_block`);
an expand view along the plate of vectorised particles only (:func:`particle_dims`); some
elements of it, when the guide's sites together draw each element once (:func:`join_pieces`:
``Normal(weights_loc[i], weights_scale[i])``); and for the scale also the ``exp`` or ``softplus``
of an unconstrained param computed in the guide (:func:`computed_scale`). Each form gives the
same mean-field Gaussian of the params, which :func:`~pyro_ngvi.guide_trace.read_trace` reports
as a :class:`GaussianBlock`.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributions import transform_to

from .scales import scale_bijection

#: The plate of vectorised particles (``ELBO(vectorize_particles=True)``): a Gaussian expanded
#: along it is one Gaussian, drawn once per particle.
_PARTICLES = "num_particles_vectorized"


@dataclass(frozen=True)
class GaussianBlock:
    """
    A mean-field Gaussian site of a guide's trace, in the param store's names.

    :param str site: the guide's sample site.
    :param str loc: param-store name of :math:`\\mu` (its unconstrained tensor is the loc).
    :param str scale: param-store name of the raw scale :math:`\\theta_\\sigma`.
    :param str bijection: ``"exp"`` or ``"softplus"``, what :math:`T` computes.
    :param bool subsampled: rows of the params were picked by a subsampling plate.
    :param float weight: the site's ``poutine.scale`` factor beyond its plates' subsampling
        factor (1 for a plain guide): the ELBO's entropy term of the site carries it.
    :param bool computed: the guide computes :math:`\\sigma = T(\\theta_\\sigma)` itself from an
        unconstrained param (``torch.exp(log_scale)``, ``F.softplus(rho)``), rather than the
        param store by the param's constraint.
    :param tuple piece: the flat indices of the elements of ``loc`` and ``scale`` the site
        draws (``weights_loc[0]``), while the site is read alone; sites whose pieces cover the
        params exactly once are one block (:func:`join_pieces`), ``None``.
    """

    site: str
    loc: str
    scale: str
    bijection: str
    subsampled: bool = False
    weight: float = 1.0
    computed: bool = False
    piece: Optional[Tuple[int, ...]] = None


def param_of(t, values: Dict[int, str], store, particles: Tuple[int, ...] = ()) -> Optional[Tuple[str, bool]]:
    """
    The param whose value ``t`` is: ``(name, subsampled)``, or ``None``. ``t`` is the
    param's (constrained) value as the trace recorded it, an expand view of it of the
    same shape and layout, its rows picked by subsampling plates, or an expand view of
    it along the dims ``particles`` of vectorised particles only (:func:`particle_dims`:
    every particle draws from the same Gaussian).
    """
    if not torch.is_tensor(t):
        return None
    for candidate in (t, t._base):  # the tensor, or an expand view of it of the same layout
        if candidate is None or not (candidate.shape == t.shape and candidate.stride() == t.stride()
                                     and candidate.storage_offset() == t.storage_offset()):
            continue
        param = getattr(candidate, "_pyro_unconstrained_param", None)
        if param is not None:  # rows picked by subsampling plates
            return _subsampled(candidate, param, store)
        if id(candidate) in values:
            name = values[id(candidate)]
            return (name, False) if name in store._params else None
    if particles and t._base is not None and id(t._base) in values and _expands_along(t, t._base, particles):
        name = values[id(t._base)]
        return (name, False) if name in store._params else None
    return None


def particle_dims(site, base) -> Tuple[int, ...]:
    """The dims of ``base`` (the site's Normal, event dims included) that vectorised particles
    (``Trace_ELBO(vectorize_particles=True)``'s plate) expand."""
    event = len(base.batch_shape) - len(site["fn"].batch_shape)  # (the site's event dims, in base)
    return tuple(frame.dim - event for frame in site["cond_indep_stack"]
                 if frame.name == _PARTICLES and frame.dim is not None)


def _expands_along(t: torch.Tensor, value: torch.Tensor, dims: Tuple[int, ...]) -> bool:
    """Whether ``t`` is ``value`` expanded along ``dims`` (negative) and by new leading dims of
    size 1 only: stride 0 there, ``value``'s own sizes, strides and offset elsewhere."""
    if t.dim() < value.dim() or t.storage_offset() != value.storage_offset():
        return False
    pad = t.dim() - value.dim()
    for d in range(t.dim()):
        own = d - pad
        if (d - t.dim()) in dims and t.stride(d) == 0 and (own < 0 or value.shape[own] == 1):
            continue
        if own < 0:
            if t.shape[d] != 1:
                return False
        elif t.shape[d] != value.shape[own] or (t.shape[d] > 1 and t.stride(d) != value.stride(own)):
            return False
    return True


def computed_scale(t, values: Dict[int, str], store) -> Optional[Tuple[str, str]]:
    """``(name, "exp")`` or ``(name, "softplus")`` if ``t`` is the exponential or the softplus
    (``F.softplus`` at ``beta=1``, ``threshold >= 20``: the softplus to float precision) of an
    unconstrained param of ``t``'s shape, computed in the guide; else ``None``."""
    node = getattr(t, "grad_fn", None)
    kind = {"ExpBackward0": "exp", "SoftplusBackward0": "softplus"}.get(type(node).__name__)
    if kind is None or len(node.next_functions) != 1:
        return None
    if kind == "softplus" and not (getattr(node, "_saved_beta", None) == 1
                                   and getattr(node, "_saved_threshold", 0) >= 20):
        return None
    leaf = getattr(node.next_functions[0][0], "variable", None)
    name = values.get(id(leaf)) if leaf is not None else None
    if name is None or store._params.get(name) is not leaf or leaf.shape != t.shape or not is_identity(store, name):
        return None
    return name, kind


def _picked(t, values: Dict[int, str], store, producers) -> Optional[Tuple[str, str, int, torch.Tensor]]:
    """``(name, map, dim, index)`` if ``t`` is rows of a param picked by an index tensor along
    ``dim`` (``loc[ind]``, ``scale[ind]``, ``index_select``): ``map`` is ``"identity"`` for the
    param's own tensor, ``"exp"`` or ``"softplus"`` for its map to a scale (its constraint's or
    the guide's); else ``None``."""
    if torch.is_tensor(t) and t._base is not None and t._base.shape == t.shape and t._base.stride() == t.stride():
        t = t._base  # (the tensor, or an expand view of it of the same layout: a plate's broadcast)
    node = getattr(t, "grad_fn", None)
    if type(node).__name__ == "IndexBackward0":
        found = [(d, i) for d, i in enumerate(node._saved_indices) if i is not None]
        if len(found) != 1:
            return None
        dim, index = found[0]
    elif type(node).__name__ == "IndexSelectBackward0":
        dim, index = node._saved_dim, node._saved_index
    else:
        return None
    if index.dim() != 1 or index.dtype == torch.bool:
        return None
    source = node.next_functions[0][0]
    if source in producers:  # a param's constrained value: its constraint's map
        name = producers[source]
        return name, scale_bijection(store._constraints[name]) or "other", dim, index
    mapped = {"ExpBackward0": "exp", "SoftplusBackward0": "softplus"}.get(type(source).__name__, "identity")
    if mapped != "identity":  # (computed in the guide from an unconstrained param)
        if len(source.next_functions) != 1 or (mapped == "softplus" and not (
                getattr(source, "_saved_beta", None) == 1 and getattr(source, "_saved_threshold", 0) >= 20)):
            return None
        source = source.next_functions[0][0]
    name = values.get(id(getattr(source, "variable", None)))
    if name is None or not is_identity(store, name):
        return None
    return name, mapped, dim, index


def picked_block(name, site, base, values, store,
                  producers) -> Optional[Tuple[Optional[GaussianBlock], Optional[str]]]:
    """The :class:`GaussianBlock` of a site whose loc and scale are the rows of their params that a
    subsampling plate's indices pick (``Normal(loc[ind], scale[ind])`` inside ``pyro.plate(...,
    subsample_size=B) as ind``: the rows a step does not pick get no gradient, as with params that
    the plate subsamples), or why not; ``None`` when the loc is not picked rows."""
    loc = _picked(base.loc, values, store, producers)
    if loc is None:
        return None
    scale = _picked(base.scale, values, store, producers)
    if loc[1] != "identity" or scale is None or scale[1] not in ("exp", "softplus") \
            or scale[2] != loc[2] or not torch.equal(scale[3], loc[3]):
        return None, ("its loc and scale are rows of params picked by an index, but not the same rows of an "
                      "unconstrained loc and a positive scale")
    computed = is_identity(store, scale[0])
    dim, index = loc[2] - base.loc.dim(), loc[3]
    event = len(base.batch_shape) - len(site["fn"].batch_shape)
    frames = [f for f in site["cond_indep_stack"] if f.dim is not None and f.dim - event == dim]
    rows = store._params[loc[0]].shape[dim] if store._params[loc[0]].dim() >= -dim else None
    if len(frames) != 1 or frames[0].full_size != rows or frames[0].size != len(index) \
            or torch.unique(index).numel() != len(index) \
            or store._params[scale[0]].shape != store._params[loc[0]].shape \
            or base.loc.shape != base.batch_shape or base.scale.shape != base.batch_shape:
        return None, ("its loc and scale are rows of params picked by an index that is not the subsample of "
                      "the plate over those rows")
    weight = site_weight(site)
    if weight is None:
        return None, "it is scaled by a tensor (poutine.scale), not by a number"
    return GaussianBlock(name, loc[0], scale[0], scale[1], True, weight, computed), None


def piece_of(t, values: Dict[int, str]) -> Optional[Tuple[str, Tuple[int, ...]]]:
    """``(name, flat indices)`` if ``t`` is a view of some elements of a param's value, each once
    (``weights_loc[0]``, ``weights_loc[1:]``: no dim broadcast), else ``None``."""
    base = t._base if torch.is_tensor(t) else None
    if base is None or id(base) not in values or base.shape == t.shape or t.numel() == 0 \
            or any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return None
    index = torch.arange(base.numel()).reshape(base.shape).as_strided(
        t.shape, t.stride(), t.storage_offset() - base.storage_offset())
    return values[id(base)], tuple(index.reshape(-1).tolist())


def piece_block(name, site, base, loc, values, store) -> Tuple[Optional[GaussianBlock], Optional[str]]:
    """The :class:`GaussianBlock` of a site whose loc is the piece ``loc`` of a param
    (:func:`piece_of`), with its scale the same piece of a positive param, or why not."""
    scale = piece_of(base.scale, values)
    if scale is None or scale[1] != loc[1]:
        return None, "its loc is some elements of a pyro.param, and its scale not the same elements of one"
    bijection = scale_bijection(store._constraints[scale[0]])
    if bijection is None or loc[0] == scale[0] or base.loc.shape != base.batch_shape \
            or base.scale.shape != base.batch_shape:
        return None, "its loc and scale are elements of params, but not of a real and a positive one"
    weight = site_weight(site)
    if weight is None:
        return None, "it is scaled by a tensor (poutine.scale), not by a number"
    return GaussianBlock(name, loc[0], scale[0], bijection, False, weight, piece=loc[1]), None


def join_pieces(blocks: Dict[str, GaussianBlock], reasons: Dict[str, str], store) -> None:
    """Sites that each draw some elements of the same loc and scale params (:func:`piece_of`; a
    Pyro tutorial's ``Normal(weights_loc[i], weights_scale[i])``) are one mean-field block of those
    params when together they draw every element exactly once: the block of the whole params,
    under each site's name. Else none of them is a block."""
    pieces: Dict[tuple, List[str]] = {}
    for name, block in blocks.items():
        if block.piece is not None:
            pieces.setdefault((block.loc, block.scale, block.bijection, block.weight), []).append(name)
    for (loc, scale, bijection, weight), names in pieces.items():
        drawn = sorted(i for name in names for i in blocks[name].piece)
        if drawn == list(range(store._params[loc].numel())) and store._params[scale].shape == store._params[loc].shape:
            joined = GaussianBlock(", ".join(names), loc, scale, bijection, False, weight)
            blocks.update({name: joined for name in names})
            continue
        for name in names:
            del blocks[name]
            reasons[name] = (f"its loc is some elements of the param '{loc}', and the guide's sites do not draw "
                             "each of its elements exactly once")


def is_broadcast_param(t, values) -> bool:
    """Whether ``t`` is an expand view of a param's value of another shape (amortised over a plate)."""
    base = t._base if torch.is_tensor(t) else None
    return base is not None and id(base) in values and base.shape != t.shape


def _subsampled(t, param, store) -> Optional[Tuple[str, bool]]:
    """``(name, True)`` if ``t`` is rows of the param ``param`` picked by subsampling plates
    (Pyro's protocol: ``param._pyro_subsample`` maps each dim to the rows picked)."""
    name = store.param_name(param)
    picked = getattr(param, "_pyro_subsample", None)
    if name is None or store._params.get(name) is not param or not picked:
        return None
    shape = list(param.shape)
    for dim, indices in picked.items():
        if -dim > len(shape):
            return None
        shape[dim] = indices.numel()
    return (name, True) if tuple(t.shape) == tuple(shape) else None


def is_identity(store, name: str) -> bool:
    """Whether the param's constrained value is its unconstrained tensor (constraint real)."""
    unconstrained = store._params[name]
    return transform_to(store._constraints[name])(unconstrained) is unconstrained


def site_weight(site) -> Optional[float]:
    """The site's scale over its plates' subsampling factor (``None``: a tensor scale)."""
    scale = site["scale"]
    if torch.is_tensor(scale):
        if scale.numel() != 1:
            return None
        scale = float(scale)
    plates = 1.0
    for frame in site["cond_indep_stack"]:
        full = frame.full_size if frame.full_size is not None else frame.size
        if frame.size:
            plates *= full / frame.size
    weight = scale / plates
    return 1.0 if math.isclose(weight, 1.0, rel_tol=1e-12) else weight
