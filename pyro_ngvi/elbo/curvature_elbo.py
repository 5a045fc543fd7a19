"""
:class:`CurvatureELBO`: the ELBO with explicit curvature for :class:`~pyro_ngvi.NGVI`.
"""

import math
import numbers

from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal
from pyro.infer.elbo import ELBO

from ..curvature import check_source
from ..family import begin_handover, calling_svi, end_handover
from ..hot_path import kept_caller, reference
from .full_covariance import full_covariance_loss_and_grads
from .mean_field import mean_field_loss_and_grads
from .protocol import own_step


class CurvatureELBO(ELBO):
    """
    The evidence lower bound of :class:`~pyro.infer.Trace_ELBO`, whose
    :meth:`loss_and_grads` also hands :class:`~pyro_ngvi.NGVI`, for every site of
    an :class:`~pyro.infer.autoguide.AutoNormal` guide, the gradient :math:`g` and
    a diagonal curvature :math:`h` of the non-conjugate part :math:`\\ell` of the
    negative log joint in the site's unconstrained coordinates ``u``, evaluated at
    :math:`u = \\mu + \\sigma\\epsilon` (or at :math:`u = \\mu` when
    ``deterministic``) and averaged over particles:

    .. math:: -\\log p(x, T(u)) - \\log|\\det J_T(u)|
              = \\underbrace{\\ell(u)}_{\\text{likelihood, other priors}}
              + \\underbrace{\\tfrac{\\lambda_0}{2}(u - m_0)^2}_{\\text{conjugate prior}}
              + \\text{const}.

    A prior that is Normal in ``u`` (:func:`~pyro_ngvi.conjugate_normal`)
    is handed over as :math:`(m_0, \\lambda_0)` and enters the update exactly;
    every other prior term (and ``log|det J|``) stays in :math:`\\ell`. Terms of a
    site under a subsampled plate are divided by its plate scale :math:`N/B`; model
    terms keep their ``poutine.scale`` and ``poutine.mask`` as in Pyro's ELBO (the
    guide is not scaled with them: a scaled prior enters as :math:`c\\lambda_0`, a
    masked one stays in :math:`\\ell`). A
    prior whose ``loc`` or ``scale`` is a ``pyro.param`` of the model is learned
    by the evidence in closed form (:mod:`pyro_ngvi.elbo.learned_priors`).

    Curvature sources for :math:`\\ell` (:mod:`pyro_ngvi.curvature`):

    - ``"reparam"``: :math:`h = g\\,\\epsilon/\\sigma` (Price's theorem), no extra pass;
    - ``"hessian"``: the exact Hessian diagonal by autograd (small models);
    - ``"ef"``: VOGN's Gauss-Newton :math:`\\frac{N}{B}\\sum_{i \\in B} g_i^2`
      from per-example gradients over the data plate;
    - ``"ggn_mc"``: the same at targets drawn from the model's own likelihood;
    - ``"ggn"``: the exact generalised Gauss-Newton diagonal for Categorical,
      Bernoulli and Normal likelihoods.

    With ``BatchNorm`` on minibatch statistics, ``ef``, ``ggn`` and ``ggn_mc`` are
    those of the network with the statistics frozen
    (:mod:`pyro_ngvi.curvature.batch_norm`). For an
    :class:`~pyro.infer.autoguide.AutoMultivariateNormal` the same sources are
    dense ``(D, D)`` matrices over the whole latent vector
    (:mod:`pyro_ngvi.elbo.full_covariance`). A model that computes the statistics
    itself says so (:mod:`pyro_ngvi.elbo.protocol`: ``curvature_sources``,
    ``curvature_step``, ``statistics_hints``), as :class:`~pyro_ngvi.BayesianNet`
    does with BackPACK; the ELBO knows no model class.

    Mean-field sites also hand over, with ``"reparam"``, the draws' mean and mean
    square (NGVI's control variate); with ``antithetic=True`` each particle is a
    pair :math:`\\mu \\pm \\sigma\\epsilon`; when ``deterministic`` (no plate
    subsampled), :math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J_T(\\mu)|` for
    NGVI's Newton safeguard. A latent site the guide does not cover (a
    ``config_enumerate`` site, or any other) is refused with
    :class:`NotImplementedError`; sum discrete sites out with
    :class:`~pyro.infer.TraceEnum_ELBO` and NGVI instead.

    :param str curvature: one of the sources above (default: ``"reparam"``)
    :param int num_particles: Monte-Carlo samples (antithetic: pairs) per step (default: 1)
    :param bool deterministic: evaluate at the mean, "OGN" (default: False)
    :param int mc_samples: target samples per step for ``"ggn_mc"`` (default: 1)
    :param int max_plate_nesting: as in :class:`~pyro.infer.ELBO`
    :param bool antithetic: draw each particle as the pair :math:`\\pm\\epsilon`
        (sampled evaluations of mean-field guides; a model's own fast path is not
        used then) (default: False)

    The value returned by :meth:`loss_and_grads` is the single-sample estimate
    Trace_ELBO would return at the same sample. When ``deterministic`` it is the
    likelihood part at the mean plus, for sites with a conjugate Normal prior,
    the closed-form :math:`\\mathrm{KL}(q \\| p_0)` (for other sites
    :math:`\\log q - \\log p` at the mean), the same value on the traced and
    :class:`~pyro_ngvi.BayesianNet` paths. :meth:`loss` is Trace_ELBO's.

    **References**

    1. Khan, M. E., Nielsen, D., Tangkaratt, V., Lin, W., Gal, Y., Srivastava, A.
       (2018). Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam.
    2. Opper, M., Archambeau, C. (2009). The Variational Gaussian Approximation Revisited.
    3. Martens, J. (2020). New Insights and Perspectives on the Natural Gradient Method.
    """

    def __init__(
        self,
        curvature: str = "reparam",
        num_particles: int = 1,
        deterministic: bool = False,
        mc_samples: int = 1,
        max_plate_nesting: float = math.inf,
        antithetic: bool = False,
    ):
        if not isinstance(curvature, str):
            raise ValueError(f"curvature must be a string naming a source, got {curvature!r}")
        check_source(curvature)
        for name, value in (("num_particles", num_particles), ("mc_samples", mc_samples)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
        if not ((isinstance(max_plate_nesting, float) and max_plate_nesting == math.inf) or (
                isinstance(max_plate_nesting, numbers.Integral) and not isinstance(max_plate_nesting, bool)
                and max_plate_nesting >= 0)):
            raise ValueError(
                f"max_plate_nesting must be a non-negative integer or math.inf, got {max_plate_nesting!r}"
            )
        if deterministic and curvature == "reparam":
            raise ValueError(
                "curvature='reparam' is estimated from the sampling noise and needs "
                "deterministic=False; with deterministic=True use 'hessian', 'ggn' or 'ef'."
            )
        if deterministic and num_particles != 1:
            raise ValueError("deterministic=True evaluates at the mean: use num_particles=1")
        if not isinstance(antithetic, bool):
            raise ValueError(f"antithetic must be True or False, got {antithetic!r}")
        if deterministic and antithetic:
            raise ValueError("antithetic=True pairs sampled draws eps, -eps: it needs deterministic=False")
        super().__init__(num_particles=num_particles, max_plate_nesting=max_plate_nesting)
        self.curvature = curvature
        self.deterministic = deterministic
        self.mc_samples = mc_samples
        self.antithetic = antithetic
        # prior params found to enter the model outside conjugate priors (no closed form)
        self._shared_prior_params = set()
        self._svi = None  # (the SVI that last ran this ELBO, its optimizer: weak references), see loss_and_grads
        self._own_step = None  # (model, guide: weak references; curvature, antithetic) served by the model's own step

    #: :class:`~pyro_ngvi.NGVI` takes the statistics of an ELBO that says so (others'
    #: steps leave nothing it could take).
    produces_curvature = True

    def _get_trace(self, model, guide, args, kwargs):
        raise NotImplementedError("CurvatureELBO traces model and guide in loss_and_grads")

    def loss(self, model, guide, *args, **kwargs) -> float:
        """The negative ELBO, estimated exactly as :class:`~pyro.infer.Trace_ELBO` does."""
        elbo = Trace_ELBO(num_particles=self.num_particles, max_plate_nesting=self.max_plate_nesting)
        return elbo.loss(model, guide, *args, **kwargs)

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """
        Estimate the loss, attach a :class:`~pyro_ngvi.handover.SiteCurvature` to every
        guide site's ``loc`` and set ``.grad`` of the other parameters: by the
        model's own ``curvature_step`` where it serves the source, else by tracing
        (:mod:`~pyro_ngvi.elbo.mean_field`, :mod:`~pyro_ngvi.elbo.full_covariance`).

        An exception in any particle leaves no ``.grad`` and no statistics behind,
        and undoes the side effects registered for the step (a
        :class:`~pyro_ngvi.BayesianNet`'s BatchNorm running statistics).

        :raises RuntimeError: when run by an ``SVI`` whose optimizer is not
            :class:`~pyro_ngvi.NGVI` (any other would find no ``.grad`` on the
            guide and train nothing).
        """
        svi = kept_caller(self._svi, "loss_and_grads", self.loss_and_grads)  # (checked when found)
        if svi is None:
            svi = calling_svi("loss_and_grads", self.loss_and_grads)
            if svi is not None and not getattr(svi.optim, "consumes_curvature", False):
                raise RuntimeError(
                    "CurvatureELBO hands its gradient and curvature to pyro_ngvi.NGVI only; this "
                    f"SVI's optimizer is {type(svi.optim).__name__}, which would find no .grad on "
                    "the guide and train nothing. Use NGVI, or Trace_ELBO with this optimizer."
                )
            self._svi = None if svi is None else (reference(svi), reference(svi.optim))
        begin_handover()  # (protocol.handing_over, inline: no context-manager objects per step)
        try:
            # the model's own step, as own_step found it for these (model, guide, source, antithetic)
            # (weak references: an optimizer's plan keeps this ELBO, not the fits it ran)
            kept = self._own_step
            if kept is not None and kept[0]() is model and kept[1]() is guide and kept[2] == self.curvature \
                    and kept[3] == self.antithetic:
                step = model.curvature_step
            else:
                step = own_step(model, self.curvature, self.antithetic, guide)
                self._own_step = None if step is None else (reference(model), reference(guide), self.curvature,
                                                            self.antithetic)
            if step is not None:
                loss = step(guide, *args, curvature=self.curvature, num_particles=self.num_particles,
                            deterministic=self.deterministic, mc_samples=self.mc_samples, **kwargs)
                return float(loss)
            if isinstance(guide, AutoMultivariateNormal):
                if self.antithetic:
                    raise NotImplementedError("antithetic=True pairs the draws of mean-field guides "
                                              "(AutoNormal); use it without for AutoMultivariateNormal")
                return full_covariance_loss_and_grads(self, model, guide, args, kwargs)
            return mean_field_loss_and_grads(self, model, guide, args, kwargs)
        except BaseException:
            end_handover(accepted=False)  # undo the evaluation's side effects
            raise
