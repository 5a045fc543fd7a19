"""
The guides of a :class:`~pyro_ngvi.BayesianNet`: the recipe's mean-field
:class:`~pyro.infer.autoguide.AutoNormal` (:meth:`GuideFactory.guide`), started at
the network's own weights with the data-relative standard deviation

.. math:: \\sigma_0 = \\min\\big((\\lambda_0 + N h_0)^{-1/2}, \\ \\text{the noise limit's cap}\\big),

and the layers a :class:`~pyro_ngvi.KroneckerNormal` reads
(:meth:`GuideFactory.kronecker_layers`).
"""

from typing import List, Optional

import torch
from torch import nn

from pyro.distributions import constraints
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible

from ..arguments import check_callable
from ..family import CURVATURE_PER_EXAMPLE
from ..kronecker import KroneckerLayer
from .checks import positive_finite


class GuideFactory:
    """
    The guide side of :class:`~pyro_ngvi.BayesianNet` (a mixin of the model: it reads
    ``_latents``, the prior buffers, ``effective_num_data`` and :meth:`max_scale`).
    """

    def initial_scale(self) -> float:
        """
        The guide's initial standard deviation for minibatch training, relative to
        the data: :math:`(\\lambda_{0} + N h_0)^{-1/2}` with :math:`N` the effective
        data size, :math:`\\lambda_0` the largest prior precision and :math:`h_0` =
        :data:`~pyro_ngvi.family.CURVATURE_PER_EXAMPLE` (the precision a Gaussian
        posterior has after :math:`N` examples of unit curvature each; ivon-opt's
        ``ess * hess_init``), and at most :meth:`max_scale` of every site.
        """
        prior_precision = max(float(self._prior_buffers(j)[2].max()) for j in range(len(self._latents)))
        scale = (prior_precision + self.effective_num_data * CURVATURE_PER_EXAMPLE) ** -0.5
        caps = [c for c in map(self.max_scale, self.latent_sites) if c is not None]
        return min([scale] + caps)

    def guide(self, init_scale: Optional[float] = None, **kwargs) -> AutoNormal:
        """
        The mean-field guide of the recipe: an
        :class:`~pyro.infer.autoguide.AutoNormal` that starts each weight at the
        network's own initialisation (:meth:`init_loc_fn`) with the
        data-relative standard deviation :meth:`initial_scale`, its scales stored as
        their logarithms (``scale_constraint = constraints.positive``, where AutoNormal's
        default is the softplus: NGVI writes them with one ``log`` per element, and the
        fast path reads them with one ``exp``)::

            svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("ggn"))

        :param init_scale: another initial standard deviation, a positive finite
            number (default: None, :meth:`initial_scale`).
        :param kwargs: other arguments of ``AutoNormal`` (an ``init_loc_fn`` given
            replaces :meth:`init_loc_fn`; one that is not callable raises ``ValueError`` naming it).
        """
        init_scale = self.initial_scale() if init_scale is None else positive_finite("init_scale", init_scale)
        kwargs.setdefault("init_loc_fn", self.init_loc_fn)
        check_callable(kwargs["init_loc_fn"], "BayesianNet.guide: init_loc_fn", "a function of a site, as Pyro's init_to_*")
        guide = AutoNormal(self, init_scale=init_scale, **kwargs)
        guide.scale_constraint = constraints.positive  # sigma = exp(r): one exp or log per step
        return guide

    def init_loc_fn(self, site) -> torch.Tensor:
        """
        An autoguide ``init_loc_fn`` that starts each weight site at the value
        the network holds now (e.g. PyTorch's initialisation), other sites as
        :func:`~pyro.infer.autoguide.initialization.init_to_feasible`::

            guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=1e-2)
        """
        for weight in self._latents:
            if weight.site == site["name"]:
                return weight.param.detach().clone()
        return init_to_feasible(site)

    def kronecker_layers(self) -> List[KroneckerLayer]:
        """
        The network's fully-connected layers, for a
        :class:`~pyro_ngvi.kronecker.KroneckerNormal` guide (the protocol it reads):
        one :class:`~pyro_ngvi.kronecker.KroneckerLayer` per ``Linear`` module with
        its weight and bias sites.

        :raises NotImplementedError: when a latent weight belongs to a module
            other than ``nn.Linear`` (K-FAC factors are served for those only).
        """
        layers, seen = [], set()
        for weight in self._latents:
            module = weight.module
            if type(module) is not nn.Linear:
                raise NotImplementedError(
                    f"KroneckerNormal puts a matrix normal on nn.Linear layers only; site "
                    f"'{weight.site}' belongs to a {type(module).__name__}. Use AutoNormal."
                )
            if id(module) in seen:
                continue
            seen.add(id(module))
            sites = {w.param_name: w.site for w in self._latents if w.module is module}
            if "weight" not in sites:
                raise NotImplementedError(
                    f"KroneckerNormal puts a matrix normal on a Linear layer's weight (with its bias); "
                    f"site '{sites['bias']}' is latent while its layer's weight is frozen "
                    "(requires_grad=False). Freeze the bias too, or use AutoNormal."
                )
            name = sites["weight"][: -len(".weight")]
            layers.append(KroneckerLayer(name, sites["weight"], sites.get("bias"),
                                         module.out_features, module.in_features))
        return layers
