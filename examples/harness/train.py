"""
The training loop (timed steps, scored checkpoints, a progress bar) and the
one evaluation every method is scored by.
"""

import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

import pyro
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, start_task

from .methods import MAP, Method, Posterior, PyroSVI
from .task import Task, minibatches, nll, predictive_metrics


@dataclass
class History:
    """
    One run. At each scored epoch ``epoch[k]`` (0: before training): ``time[k]``,
    the training seconds so far (scoring excluded, and the first step, which pays
    one-off set-up costs), and ``scores[key][k]``. ``step_times``: every timed step.
    """

    name: str
    epoch: List[int] = field(default_factory=list)
    time: List[float] = field(default_factory=list)
    scores: Dict[str, List[float]] = field(default_factory=dict)
    step_times: List[float] = field(default_factory=list)

    @property
    def seconds_per_step(self) -> float:
        """Median time of a training step."""
        return statistics.median(self.step_times) if self.step_times else math.nan

    def at(self, epoch: int) -> Optional[Dict[str, float]]:
        """The scores at ``epoch`` (``None`` if it was not scored)."""
        if epoch not in self.epoch:
            return None
        k = self.epoch.index(epoch)
        return {key: values[k] for key, values in self.scores.items()}


def train(name: str, step: Callable, batches: Callable[[], Sequence[Tuple]], epochs: int,
          evaluate: Optional[Callable[[], Dict[str, float]]] = None,
          eval_epochs: Optional[Sequence[int]] = None) -> History:
    """
    ``step(*batch)`` for every batch of ``batches()`` (called once an epoch), for
    ``epochs`` epochs; ``evaluate()`` scores after the epochs in ``eval_epochs``
    (default: every epoch; 0 scores the start). Only the steps are timed.
    """
    history = History(name)
    eval_epochs = set(range(1, epochs + 1) if eval_epochs is None else eval_epochs)

    def score(epoch, bar):
        if evaluate is not None and epoch in eval_epochs:
            history.epoch.append(epoch)
            history.time.append(sum(history.step_times))
            for key, value in evaluate().items():
                history.scores.setdefault(key, []).append(value)
            bar.set_postfix({key: f"{values[-1]:.4g}" for key, values in history.scores.items()}, refresh=False)

    with tqdm(total=epochs, desc=f"{name:>14}", unit="epoch", dynamic_ncols=True, mininterval=0.5) as bar:
        score(0, bar)
        first = True
        for epoch in range(1, epochs + 1):
            for batch in batches():
                start = time.perf_counter()
                step(*batch)
                if not first:
                    history.step_times.append(time.perf_counter() - start)
                first = False
            bar.update()
            score(epoch, bar)
    return history


def fit(method: Method, epochs: int, evaluate: Optional[Callable[[Method], Dict[str, float]]] = None,
        eval_epochs: Optional[Sequence[int]] = None) -> History:
    """
    Train ``method`` on its task's training set for ``epochs`` epochs of minibatches
    (a permutation per epoch from a generator seeded with the task's seed: the same
    order for every method), scored by ``evaluate(method)``.
    """
    task = method.task
    generator = torch.Generator().manual_seed(task.seed)

    def batches():
        epoch = minibatches(task.split.x_train, task.split.y_train, task.batch_size, generator)
        if task.augment is None:
            return epoch
        return [(task.augment(x, generator), y) for x, y in epoch]

    with method.active():
        return train(method.name, method.step, batches, epochs,
                     None if evaluate is None else lambda: evaluate(method), eval_epochs)


def fit_every(method: Method, epochs: int, every: int, report: Callable[[Method, int], None]) -> History:
    """:func:`fit`, calling ``report(method, epoch)`` after every ``every`` epochs (a probe's printout)."""
    marks = list(range(every, epochs + 1, every))
    due = iter(marks)

    def evaluate(m):
        report(m, next(due))
        return {}

    return fit(method, epochs, evaluate, marks)


def after_epochs(method: Method, task, burn: int, action: Callable[[int], None]) -> None:
    """Make ``method.step`` call ``action(steps_taken)`` at the end of every epoch from epoch
    ``burn`` on (a probe that rewrites the prior during training)."""
    per_epoch, taken, step = math.ceil(task.num_data / task.batch_size), [0], method.step

    def step_and_act(x, y):
        step(x, y)
        taken[0] += 1
        if taken[0] % per_epoch == 0 and taken[0] // per_epoch >= burn:
            action(taken[0])

    method.step = step_and_act


def compare(factories: Dict[str, Callable[[], Method]], epochs: int,
            evaluate: Callable[[Method], Dict[str, float]]) -> Dict[str, Tuple[Method, History]]:
    """Build and :func:`fit` each method in turn; ``{name: (method, history)}``."""
    runs = {}
    for name, make in factories.items():
        method = make()
        runs[name] = method, fit(method, epochs, evaluate)
    return runs


# ------------------------------------------------------------------ MAP, tuned on the validation split
#: Weight decays per datum MAP's search tries (``None``: the prior's, ``lambda_0 / N``).
MAP_WEIGHT_DECAYS = (None, 1e-4, 1e-3, 1e-2)


def validation_loss(task: Task, method: Method, num_samples: int = 32) -> float:
    """What MAP's search minimises on the validation split: the NLL, or for regression the negative
    predictive log-likelihood (``inf`` for a diverged run)."""
    outputs = method.predict(task.split.x_valid, num_samples, torch.Generator().manual_seed(task.seed))
    scores = predictive_metrics(task.likelihood, outputs, task.split.y_valid, method.noise_scale)
    value = -scores["loglik"] if task.likelihood == "gaussian" else scores["nll"]
    return math.inf if math.isnan(value) else value


def tuned_map(task: Task, epochs: int, weight_decays=MAP_WEIGHT_DECAYS, checkpoints: int = 20,
              lr: float = 1e-3):
    """
    MAP with its weight decay and epoch chosen on the task's validation split: Adam
    (``lr``) for every weight decay per datum of ``weight_decays``, scored every
    ``epochs / checkpoints`` epochs; returns the :class:`~harness.methods.MAP` holding
    the network of the best (weight decay, epoch), with ``weight_decay``, ``epoch`` and
    ``seconds`` (training time of the whole search) set on it.
    """
    every = max(1, epochs // checkpoints)
    eval_epochs = sorted(set(range(every, epochs + 1, every)) | {epochs})
    best = (math.inf, None, None, None)
    seconds = 0.0
    for decay in weight_decays:
        method = MAP(task, lr=lr, prior_precision=None if decay is None else decay * task.num_data,
                     name="MAP (tuned)")
        states = {}

        def evaluate(m):
            states[len(states)] = copy.deepcopy(m.net.state_dict()), copy.deepcopy(m.log_noise)
            return {"valid": validation_loss(task, m)}

        history = fit(method, epochs, evaluate, eval_epochs)
        seconds += sum(history.step_times)
        for k, (epoch, value) in enumerate(zip(history.epoch, history.scores["valid"])):
            if value < best[0]:
                best = (value, method.weight_decay, epoch, states[k])
    _, decay, epoch, (state, log_noise) = best
    method = MAP(task, lr=lr, name="MAP (tuned)")
    method.net.load_state_dict(state)
    method.log_noise = log_noise
    method.weight_decay, method.epoch, method.seconds = decay, epoch, seconds
    return method


def validated_ngvi(task: Task, epochs: int, checkpoints: int = 20, curvature: str = "ggn",
                   name: str = "NGVI ggn (validated)"):
    """
    The recipe with its prior scale and epoch chosen on the task's validation split, the budget
    :func:`tuned_map` gets (:func:`pyro_ngvi.nn.selection.select_by_validation`: the task's prior and
    the priors of precision per datum 1e-4, 1e-3, 1e-2, ``checkpoints`` epochs each); returns a
    :class:`~harness.methods.PyroSVI` holding the chosen model and guide, with ``prior_scale``,
    ``epoch`` and ``seconds`` (the whole search, scoring included) set on it.
    """
    from pyro_ngvi.nn.selection import select_by_validation

    method = PyroSVI(task, NGVI(), CurvatureELBO(curvature), None, name)
    split = task.split
    start = time.perf_counter()
    with method.active():
        chosen = select_by_validation(task.network(), task.likelihood, split.x_train, split.y_train,
                                      split.x_valid, split.y_valid, epochs, checkpoints=checkpoints,
                                      batch_size=task.batch_size, curvature=curvature, seed=task.seed,
                                      prior=task.prior_scale, augmentation_factor=task.augmentation_factor)
    method.bnn, method.guide, method.net = chosen.bnn, chosen.guide, chosen.bnn.net
    method.prior_scale, method.epoch, method.seconds = chosen.prior_scale, chosen.epoch, time.perf_counter() - start
    return method


# ------------------------------------------------------------------ scoring a method
def gaussian_kl(posterior: Posterior, prior_scale: float) -> float:
    """:math:`\\mathrm{KL}(q \\| p_0)` of a mean-field Gaussian from :math:`\\mathcal{N}(0, s_0^2)`,
    summed over every weight."""
    total = 0.0
    for mean, std in posterior.values():
        if std is None:  # a point estimate (BatchNorm): not a latent
            continue
        ratio = (std / prior_scale).square()
        total += float(0.5 * (ratio + (mean / prior_scale).square() - 1 - ratio.log()).sum())
    return total


def elbo(method: Method, x: torch.Tensor, y: torch.Tensor, num_samples: int,
         generator: Optional[torch.Generator] = None) -> Optional[float]:
    """
    The ELBO of ``method``'s posterior on ``(x, y)``: the expected log-likelihood
    by ``num_samples`` draws of :meth:`Method.predict`, minus the closed-form KL
    to the task's prior; ``None`` for a point estimate.
    """
    posterior = method.posterior()
    if posterior is None:
        return None
    outputs = method.predict(x, num_samples, generator)
    log_likelihood = -float(nll(method.task.likelihood, outputs, y, method.noise_scale).sum()) / num_samples
    return log_likelihood - gaussian_kl(posterior, method.task.prior_scale)


def evaluator(task: Task, elbo_samples: int = 8, predictive_samples: int = 32, seed: int = 0):
    """
    ``evaluate(method)``: the ELBO on the training set (``elbo_samples`` draws) and
    the test metrics of the predictive (``predictive_samples`` draws; a point
    estimate predicts once). Each draws from a generator seeded with ``seed`` at
    every call: common random numbers for every method and checkpoint, and the
    training's RNG untouched.
    """
    split = task.split

    def evaluate(method: Method) -> Dict[str, float]:
        outputs = method.predict(split.x_test, predictive_samples, torch.Generator().manual_seed(seed))
        scores = predictive_metrics(task.likelihood, outputs, split.y_test, method.noise_scale)
        value = elbo(method, split.x_train, split.y_train, elbo_samples, torch.Generator().manual_seed(seed))
        if value is not None:
            scores["elbo"] = value
        return scores

    return evaluate


def trace_elbo(task: Task, posterior: Posterior, noise_scale: Optional[float] = None,
               num_particles: int = 64) -> float:
    """
    The same ELBO by Pyro's own ``Trace_ELBO``, of an ``AutoNormal`` guide that holds
    ``posterior`` on a fresh :class:`~pyro_ngvi.BayesianNet` of the task (with the
    Gaussian likelihood's ``noise_scale`` fixed): the independent check of :func:`elbo`.
    """
    split = task.split
    with pyro.get_param_store().scope(), torch.no_grad():
        bnn = BayesianNet(task.make_net(), task.likelihood, num_data=task.num_data, prior=task.prior_scale,
                          noise_scale=noise_scale)
        priors = {site: torch.distributions.Normal(mean, std) for site, (mean, std) in posterior.items()
                  if std is not None}
        guide = start_task(AutoNormal(bnn), priors, split.x_train[:2], split.y_train[:2], carry=True)
        return -Trace_ELBO(num_particles=num_particles).loss(bnn, guide, split.x_train, split.y_train)


# ------------------------------------------------------------------ plain Pyro models, full batch
def log_spaced(steps: int, points: int = 40) -> List[int]:
    """About ``points`` steps spread evenly on a log scale over ``1..steps``."""
    grid = torch.logspace(0, math.log10(max(steps, 1)), points)
    return sorted({int(round(float(s))) for s in grid} | {steps})


def precise_elbo(model, guide, data: Tuple, num_particles: int = 1000, seed: int = 0) -> float:
    """
    The ELBO from ``num_particles`` vectorised samples (the model must broadcast
    over a leading particle dimension), drawn from the same seeded noise every
    call: common random numbers, so a curve of it shows the guide moving, not
    the estimator's noise. The training RNG is left as it was.
    """
    estimator = Trace_ELBO(num_particles=num_particles, vectorize_particles=True, max_plate_nesting=1)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        return -estimator.loss(model, guide, *data)


def run_full_batch(name: str, model, guide, optim, loss, data: Tuple, steps: int,
                   elbo_particles: int = 1000) -> History:
    """``steps`` full-batch SVI steps (an epoch is one step), scored by :func:`precise_elbo` at log-spaced steps."""
    svi = SVI(model, guide, optim, loss)
    return train(name, svi.step, lambda: [data], steps,
                 lambda: {"elbo": precise_elbo(model, guide, data, elbo_particles)}, log_spaced(steps))


def steps_to_within(history: History, best: float, tolerance: float = 1.0) -> Optional[int]:
    """The first scored step from which the ELBO stays within ``tolerance`` of ``best``."""
    values = history.scores["elbo"]
    for k in range(len(values)):
        if all(v >= best - tolerance for v in values[k:]):
            return history.epoch[k]
    return None
