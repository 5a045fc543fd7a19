"""
The point optimizer: parameters that are not Gaussian guide sites (``pyro.param`` values
of the model, BatchNorm weights, the values of ``AutoDelta`` parts) are trained inside
:class:`~pyro_ngvi.NGVI` by an ordinary torch optimizer, through
:class:`~pyro.optim.PyroOptim`'s per-parameter machinery. Everything that could make its
step fail is checked before NGVI writes anything.

The default point optimizer is Adam at step size 0.01 for the model's parameters. The
params of guide parts that are not Gaussians (an ``AutoDelta``, an
``AutoLowRankMultivariateNormal``, a hand-written guide's other sites) are a whole
variational family of their own, trained by it alone: there Adam's step size starts at
0.05 and decays with the number of steps :math:`t` it has taken on the parameter,

.. math:: \\alpha_t = \\alpha_0 / (1 + t / T), \\qquad \\alpha_0 = 0.05, \\quad T = 50,

as fast at the start as the Adam Pyro's own tests train such guides with (0.05) and settling
below the noise of a constant step (Robbins-Monro): at 0.0045 after 500 steps, below the 0.005
that Pyro's exactness tests end on (with T = 100, 0.0083, an AutoGaussian missed their 5 %
on 5 of 10 seeds; ``benchmarks/pyro_suite/misses.py tree``).

The ``loc`` of an ``AutoLowRankMultivariateNormal`` (issue 23) takes that step in units of the
guide's own marginal standard deviations :math:`\\sigma_i = s_i (1 + \\sum_j W_{ij}^2)^{1/2}`
(its covariance is :math:`\\mathrm{diag}(s)(WW^\\top + I)\\mathrm{diag}(s)`), as they stood
before the step, where Adam's is in the loc's own units (:class:`SdUnits`):

.. math:: \\Delta_i = \\alpha_t\\, \\sigma_i \\operatorname{sign}(\\hat m_i) \\max\\Big(
    \\max(1, \\sigma_i |\\hat m_i|)\\, \\frac{|\\hat m_i|}{\\sqrt{\\hat v_i} + \\epsilon},\\;
    \\frac{|\\hat m_i|}{\\hat s_i} - \\kappa\\Big), \\qquad |\\Delta_i| \\le \\sigma_i,

with :math:`\\hat m, \\hat v` Adam's moments of the loc's gradient, :math:`\\hat s_i` its
draw-to-draw noise and :math:`\\kappa = ((1 - \\beta_1) / (1 + \\beta_1))^{1/2} = 0.23`.
Near the optimum the gradient is the draw's noise and Adam's :math:`\\hat m / \\sqrt{\\hat v}` is about
:math:`\\pm 1` in its first steps: a step of :math:`\\alpha_t` in the loc's units is half a
posterior sd of a site of sd 0.1 (Pyro's ``test_median_module`` failed for 5 of 100 seeds,
``misses.py median --seeds 100``) and fifty of one of sd 0.001, where :math:`\\alpha_t \\sigma_i`
is 0.05 of the guide's sd at any scale (0 of 100; Pyro's test's own Adam at 0.005 is 0.05 of
its initial sd 0.1). Far from the optimum :math:`\\sigma_i^2 |\\hat m_i|` (the diagonal
natural-gradient step of the averaged gradient) estimates the distance to it, so that the loc
closes a fraction :math:`\\alpha_t` of it per step instead of :math:`\\alpha_t \\sigma_i` (in plain
sd units the decaying step travels at most :math:`\\alpha_0 T \\log(1 + t/T)` sds: a 200-point
regression's mean, 70 posterior sds away, was still 69 away after 500 steps); one sd per step
bounds it where the guide is much wider than the posterior, which makes that estimate too large
(as NGVI's ``max_step`` bounds its own sampled mean steps in sds).

That estimate is too short where the guide is narrower than the posterior, by
:math:`(\\sigma_i / \\sigma_{\\mathrm{post}})^2`, and Adam's :math:`\\sqrt{\\hat v}` (:math:`\\beta_2 = 0.999`)
remembers the early large gradients and shrinks the step as the loc closes in. For a Gaussian
posterior of precision :math:`H` and a draw :math:`z = \\mathrm{loc} + \\sigma \\varepsilon`, the loc's
gradient :math:`H(z - \\mu)` has mean :math:`H_{ii}(\\mathrm{loc}_i - \\mu_i)` (diagonally) and draw noise
:math:`\\hat s_i = H_{ii} \\sigma_i`, so the distance is :math:`\\sigma_i |\\hat m_i| / \\hat s_i` at any
guide width: :math:`|\\hat m_i| / \\hat s_i` is the distance in guide sds, the gradient's
signal-to-noise ratio (:func:`gradient_noise`). Taken where it is the larger, less
:math:`\\kappa`, the noise of :math:`|\\hat m_i| / \\hat s_i` at the optimum (without it Pyro's
test_exact body ended up to 0.022 off instead of 0.016, 12 seeds; now 0.017): from
``init_scale=0.08`` on a conjugate mean 10 posterior sds (0.218) away, the loc was 3.5, 1.3 and
1.0 posterior sds off after 300, 1,000 and 1,500 steps, now 0.17, 0.06 and 0.04 (seeds 0-1;
ClippedAdam at lr 0.05 decaying to 0.005 over 500 steps 0.26, 0.06, 0.02); the 200-point
regression of ``benchmarks/pyro_suite/low_rank_loc.py`` ends 0.4 sds off after 2,000 steps instead
of 3.1 (20,000 points: 0.3 instead of 1.3); ``misses.py median`` unchanged (0 of 100, largest
error 0.091).

By default each gradient element is clamped to :math:`\\pm 10` before Adam's step (as Pyro's
``ClippedAdam``, whose ``clip_norm`` is 10), with torch's :math:`\\beta_2 = 0.999`; not a low-rank
guide's loc, whose step above is in its marginal sds at any scale and bounded by one. A sparse GP's first
draw (a lengthscale of :math:`e^2` from the autoguides' start, Kuu near singular) gave
``u_scale_tril`` a gradient 2,000 times those that followed; unclamped, Adam's second moment
remembered it for thousands of steps and held the steps on ``u`` a hundred times below their step
size while NGVI's sites moved on to a short lengthscale that explains the data as noise (4 of 5
seeds at -ELBO 70-75 after 2,000 steps; clamped, -25.0 to -25.7 on seeds 1-4, ClippedAdam's -24.6 to
-25.3: ``benchmarks/sparse_gp.py``). A shorter memory instead (:math:`\\beta_2 = 0.99`) trained that
GP less well (-20.8 to -24.3) and made Pyro's ``test_exact_tree[AutoGaussian]`` fail. The params of
a guide site drawn without a reparameterised sample (and not enumerated) are not clamped: their
gradients are score-function estimates, heavy-tailed by nature, and clamped they are biased (two
of Pyro's score-function fits ended off their tolerances).

Arguments given (``point_optim_args``) run as given, for every parameter.
"""

import inspect
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

import pyro
from pyro.infer.autoguide import AutoLowRankMultivariateNormal

#: Adam's step size for the model's parameters by default
POINT_LR = 0.01
#: Adam's averaging rates by default (torch's)
POINT_BETAS = (0.9, 0.999)
#: By default each element of a point parameter's gradient is clamped to +-POINT_CLIP before
#: Adam's step (Pyro's ``ClippedAdam``'s ``clip_norm``; the module docstring says why)
POINT_CLIP = 10.0
#: :math:`\alpha_0` and :math:`T` of the decaying step size of guide parts' params by default
GUIDE_PART_LR = 0.05
GUIDE_PART_DECAY_STEPS = 50.0
#: the most an ``AutoLowRankMultivariateNormal``'s loc moves in one step, in its own marginal sds
LOW_RANK_LOC_TRUST = 1.0
#: the averaging rate of the draw-to-draw noise of a low-rank loc's gradient (:func:`gradient_noise`)
LOW_RANK_NOISE_BETA = 0.99
#: the fewest gradient changes that noise is averaged over before a low-rank loc's step uses it
LOW_RANK_NOISE_COUNT = 10


def clamp_gradients(params: List[torch.Tensor]) -> None:
    """Clamp each element of the ``params``' gradients to :math:`\\pm` :data:`POINT_CLIP`, in place
    (the default point optimizer's first move, as Pyro's ``ClippedAdam``'s)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_clamp_min_(grads, -POINT_CLIP)
        torch._foreach_clamp_max_(grads, POINT_CLIP)


def decay_guide_part_lr(optimizer: torch.optim.Optimizer) -> None:
    """Set each parameter group's step size to :math:`\\alpha_0 / (1 + t / T)`, with
    :math:`t` the steps the optimizer has taken on the group's parameters (Adam's ``step``)."""
    for group in optimizer.param_groups:
        steps = [optimizer.state[p].get("step", 0) for p in group["params"] if p in optimizer.state]
        t = float(max(steps)) if steps else 0.0
        group["lr"] = GUIDE_PART_LR / (1.0 + t / GUIDE_PART_DECAY_STEPS)


def low_rank_locs(parts) -> Dict[torch.Tensor, Tuple[str, str]]:
    """The (unconstrained) ``loc`` of each ``AutoLowRankMultivariateNormal`` among the leaf
    guides ``parts``, with the param names of its ``scale`` and ``cov_factor``; a part stored
    otherwise than pyro 1.9 stores it (``loc`` (D,), positive ``scale`` (D,), ``cov_factor``
    (D, k)) is left out, and its loc takes Adam's plain step."""
    store = pyro.get_param_store()
    found = {}
    for part in parts:
        if not isinstance(part, AutoLowRankMultivariateNormal) or part.prototype_trace is None:
            continue
        prefix = part._pyro_name
        names = (f"{prefix}.loc", f"{prefix}.scale", f"{prefix}.cov_factor")
        if not all(name in store._params for name in names):
            continue
        loc, scale, factor = (store._params[name] for name in names)
        if loc.dim() == 1 and scale.shape == loc.shape and factor.dim() == 2 and factor.shape[0] == loc.shape[0] \
                and store._constraints[names[1]].event_dim == 0:
            found[loc] = names[1:]
    return found


def low_rank_marginal_sd(scale_name: str, factor_name: str) -> torch.Tensor:
    r"""The marginal standard deviations of an ``AutoLowRankMultivariateNormal``,
    :math:`\sigma_i = s_i (1 + \sum_j W_{ij}^2)^{1/2}`: its covariance is
    :math:`\mathrm{diag}(s) (WW^\top + I) \mathrm{diag}(s)` (``get_posterior``; Pyro's
    ``_loc_scale``)."""
    store = pyro.get_param_store()
    with torch.no_grad():
        return store[scale_name] * (1.0 + store._params[factor_name].pow(2).sum(-1)).sqrt()


def gradient_noise(state: Dict, grad: torch.Tensor) -> Optional[torch.Tensor]:
    r"""The draw-to-draw standard deviation :math:`\hat s` of each element of a low-rank loc's
    gradient, from the changes between successive gradients, averaged at rate
    :math:`\beta` = :data:`LOW_RANK_NOISE_BETA` (bias-corrected as Adam's moments):

    .. math:: \hat s_i^2 = \frac{1 - \beta}{1 - \beta^n} \sum_{k=1}^{n} \beta^{n-k}\,
        \tfrac12 (g_{k,i} - g_{k-1,i})^2

    (for independent draws about a slowly moving mean, :math:`E[\tfrac12 (g_k - g_{k-1})^2]` is the
    variance; the mean's own drift only adds to it). Kept in the loc's Adam ``state`` (so that it
    is saved and loaded with it); ``None`` before :data:`LOW_RANK_NOISE_COUNT` changes (from a few,
    :math:`\hat s` is often far below the noise: one change is below a tenth of it one time in 12)."""
    previous = state.get("previous_grad")
    state["previous_grad"] = grad
    if previous is None:
        return None
    count = state["noise_count"] = state.get("noise_count", 0) + 1
    change = (grad - previous).pow(2) / 2
    if "noise_sq" not in state:
        state["noise_sq"] = torch.zeros_like(grad)
    state["noise_sq"].mul_(LOW_RANK_NOISE_BETA).add_(change, alpha=1.0 - LOW_RANK_NOISE_BETA)
    if count < LOW_RANK_NOISE_COUNT:
        return None
    return (state["noise_sq"] / (1.0 - LOW_RANK_NOISE_BETA ** count)).sqrt()


class SdUnits:
    r"""
    Adam's step on an ``AutoLowRankMultivariateNormal``'s ``loc`` measured in the guide's own
    marginal standard deviations :math:`\sigma_i` (``sd``, :func:`low_rank_marginal_sd` as they
    stood before the step): registered as the loc's Adam's step hooks, it rescales Adam's
    :math:`\alpha_t \hat m_i / (\sqrt{\hat v_i} + \epsilon)` to

    .. math:: \Delta_i = \alpha_t\, \sigma_i \max\Big(\max(1, \sigma_i |\hat m_i|)\,
        \frac{|\hat m_i|}{\sqrt{\hat v_i} + \epsilon}, \frac{|\hat m_i|}{\hat s_i} - \kappa\Big)
        \operatorname{sign}(\hat m_i), \qquad |\Delta_i| \le \sigma_i

    with :math:`\hat s_i` the gradient's draw-to-draw noise (:func:`gradient_noise`; the first
    steps, before there is one, leave out its term) and :math:`\kappa = ((1 - \beta_1) / (1 +
    \beta_1))^{1/2}` the sd of :math:`\hat m_i / \hat s_i` where the gradient is pure noise; the
    module docstring says why.
    """

    def __init__(self):
        self.sd: Optional[torch.Tensor] = None
        self._start: List[Optional[torch.Tensor]] = []
        self._grads: List[Optional[torch.Tensor]] = []

    def before(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._start = [p.detach().clone() if self.sd is not None and self.sd.shape == p.shape else None
                       for p in params]
        self._grads = [p.grad.detach().clone() if start is not None else None
                       for p, start in zip(params, self._start)]

    def after(self, optimizer, args, kwargs) -> None:
        with torch.no_grad():
            starts, grads = iter(self._start), iter(self._grads)
            for group in optimizer.param_groups:
                beta1 = group["betas"][0]
                for p, start, grad in zip(group["params"], starts, grads):
                    if start is None:
                        continue
                    state = optimizer.state[p]
                    sd = self.sd.to(p.dtype)
                    mean_grad = state["exp_avg"] / (1.0 - beta1 ** float(state["step"]))  # Adam's m-hat
                    step = sd * torch.clamp(sd * mean_grad.abs(), min=1.0) * (p - start)
                    noise = gradient_noise(state, grad)
                    if noise is not None:  # the distance sigma_i m_i / s_i, whatever the guide's width
                        ratio = mean_grad.abs() / noise.clamp(min=torch.finfo(p.dtype).tiny)
                        shrink = ((1.0 - beta1) / (1.0 + beta1)) ** 0.5  # the sd of m-hat / s at the optimum
                        natural = -group["lr"] * sd * mean_grad.sign() * (ratio - shrink).clamp(min=0.0)
                        step = torch.where(natural.abs() > step.abs(), natural, step)
                    bound = LOW_RANK_LOC_TRUST * sd
                    p.copy_(start + torch.maximum(torch.minimum(step, bound), -bound))
        self._start, self._grads, self.sd = [], [], None


class LowRankLocs:
    """The ``loc`` params of the ``AutoLowRankMultivariateNormal`` parts NGVI has seen (by
    tensor, weakly) and their :class:`SdUnits`."""

    def __init__(self):
        self._names = WeakIdKeyDictionary()  # loc -> (its scale's, its cov_factor's param name)
        self._units = WeakIdKeyDictionary()

    def note(self, parts) -> None:
        """Take note of the low-rank guides among the leaf guides ``parts``."""
        self._names.update(low_rank_locs(parts))

    def others(self, params) -> List[torch.Tensor]:
        """``params`` less the low-rank locs (their step, in marginal sds, is bounded already)."""
        return [p for p in params if p not in self._names]

    def measure(self, params) -> None:
        """Set each low-rank loc's step units to its guide's marginal sds, as they stand."""
        for p in params:
            if p in self._names and p.grad is not None:
                self._units.setdefault(p, SdUnits()).sd = low_rank_marginal_sd(*self._names[p])

    def hook(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Register the step hooks of ``param``'s units on its optimizer, if it is a low-rank loc."""
        if param in self._names:
            units = self._units.setdefault(param, SdUnits())
            optimizer.register_step_pre_hook(units.before)
            optimizer.register_step_post_hook(units.after)


def check_point_optim(point_optim, point_optim_args):
    """
    The point optimizer's arguments: a dict, validated by building the optimizer on a probe
    tensor and taking one step with a zero gradient (a bad value or an unknown key is refused
    here, not at the first step, after the guide sites were updated); or a callable of the
    param name that returns one, as Pyro's optimizers take (``Adam(per_param_args)``), whose
    answer for each param is checked alike before that param's first step (:func:`check_point_args`).
    """
    if not (isinstance(point_optim, type) and issubclass(point_optim, torch.optim.Optimizer)):
        # (Pyro's wrapper pyro.optim.Adam or an instance of it, a torch optimizer instance, a class name)
        torch_class = (point_optim if isinstance(point_optim, str) else type(point_optim).__name__
                       if isinstance(point_optim, torch.optim.Optimizer) else getattr(getattr(
                           point_optim, "pt_optim_constructor", point_optim), "__name__", None))
        hint = (f": pass the class torch.optim.{torch_class} (its arguments as point_optim_args)"
                if isinstance(getattr(torch.optim, str(torch_class), None), type) else "")
        raise ValueError(f"point_optim must be a torch.optim.Optimizer class, got {point_optim!r:.80}{hint}")
    if point_optim_args is None:
        point_optim_args = {"lr": POINT_LR, "betas": POINT_BETAS}
    if callable(point_optim_args) and not isinstance(point_optim_args, dict):
        return point_optim_args
    return check_point_args(point_optim, point_optim_args, "point_optim_args")


def check_point_args(point_optim, args, what: str) -> Dict:
    """``args`` (named ``what`` in errors) if ``point_optim`` can run with them: a dict of finite
    values, numbers (not bools) where ``point_optim``'s defaults are numbers, without
    ``maximize=True`` (SVI minimises), with which a step on a zero gradient writes finite values.

    :raises ValueError: otherwise, naming ``what``."""
    if not isinstance(args, dict):
        raise ValueError(f"{what} must be a dict of {point_optim.__name__}'s arguments (or a callable of the "
                         f"param name returning one), got {args!r}")
    defaults = _numeric_defaults(point_optim)
    for key, value in args.items():  # (a step with an infinite lr writes inf or nan)
        numbers = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ValueError(f"{what}[{key!r}] must be finite, got {value!r}")
        if key in defaults and any(isinstance(v, bool) for v in numbers):
            raise ValueError(f"{what}[{key!r}] must be a number, got {value!r}")
    if args.get("maximize"):
        raise ValueError(f"{what} has maximize=True: SVI minimises its loss, and the point optimizer would "
                         "step the other params uphill; drop it")
    probe = torch.zeros(1, requires_grad=True)
    try:
        optimizer = point_optim([probe], **args)
        probe.grad = torch.zeros(1)
        optimizer.step()
    except Exception as error:
        raise ValueError(
            f"{what} {args!r} are not arguments {point_optim.__name__} "
            f"can run with (SVI calls its step() without a closure): {error}"
        ) from error
    if not torch.isfinite(probe).all():
        raise ValueError(f"{what} {args!r}: a step of {point_optim.__name__} with a zero "
                         "gradient wrote a non-finite value")
    return dict(args)


def _numeric_defaults(point_optim) -> set:
    """The arguments of ``point_optim`` whose defaults are numbers (or tuples of them), not bools."""
    try:
        parameters = inspect.signature(point_optim.__init__).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters
            if all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   for v in (p.default if isinstance(p.default, tuple) else (p.default,)))}


def check_point_states(waiting: Dict, known, others: List[torch.Tensor], constructor, args_of: Callable) -> None:
    """Refuse, before any write, a restored point-optimizer state whose tensors do
    not fit the parameter it would be loaded into (a checkpoint of another model):
    ``waiting`` holds the restored entries not yet loaded, by param name; ``known`` the
    parameters that have their optimizer already; ``args_of(p)`` the point optimizer's arguments for ``p``."""
    if not waiting:
        return
    store = pyro.get_param_store()
    for p in others:
        name = store.param_name(p)
        if p in known or name not in waiting:
            continue
        probe = torch.zeros_like(p, requires_grad=True)
        optimizer = constructor([probe], **args_of(p))
        probe.grad = torch.zeros_like(probe)
        optimizer.step()
        template = {key: value.shape for key, value in optimizer.state[probe].items() if torch.is_tensor(value)}
        for per_param in waiting[name]["state"].values():
            for key, value in per_param.items():
                if torch.is_tensor(value) and key in template and value.shape != template[key]:
                    raise ValueError(
                        f"NGVI's point-optimizer state for '{name}' holds {key!r} of shape "
                        f"{tuple(value.shape)}, the parameter has {tuple(p.shape)}: the "
                        "checkpoint belongs to another model"
                    )


def probe_point_step(p: torch.Tensor, constructor, args: Dict) -> None:
    """
    Probe the point optimizer (``constructor``) on a zero gradient of ``p``'s layout.

    :raises ValueError: when it cannot step ``p`` (e.g. a sparse gradient for an optimizer
        without sparse support), before anything is written.
    """
    probe = torch.zeros_like(p, requires_grad=True)
    probe.grad = torch.zeros_like(p).to_sparse() if p.grad.is_sparse else torch.zeros_like(p)
    try:
        constructor([probe], **args).step()
    except Exception as error:
        raise ValueError(
            f"NGVI's point optimizer {constructor.__name__} cannot update "
            f"'{param_label(p)}' ({error}); nothing was changed. Pass point_optim that supports "
            "it (e.g. torch.optim.SparseAdam for nn.Embedding(sparse=True)).") from error


def param_label(p: torch.Tensor) -> str:
    """The param-store name of ``p``, or its shape."""
    return pyro.get_param_store().param_name(p) or f"tensor of shape {tuple(p.shape)}"
