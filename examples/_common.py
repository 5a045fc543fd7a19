"""
What the examples share: the command line, data from scikit-learn, the training
loop (one progress bar, one history format for every method), the baselines
that are not Pyro SVI (a MAP network, ivon-opt), Bayesian predictions, figures
and markdown tables.

Not part of the package: the examples import it as ``_common`` (their own
folder is on ``sys.path`` when run as ``python examples/NAME.py``).
"""

import argparse
import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import pyro  # noqa: E402
from pyro.infer import SVI, Predictive, Trace_ELBO  # noqa: E402

from pyro_ngvi import metrics  # noqa: E402

try:  # the ivon-opt baseline is optional
    import ivon
except ImportError:  # pragma: no cover - depends on the environment
    ivon = None

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


# ------------------------------------------------------------------ command line
def make_parser(name: str, description: str, epochs: int, unit: str = "epochs") -> argparse.ArgumentParser:
    """The options every example has: ``--epochs`` (or steps), ``--quick``, ``--out``, ..."""
    parser = argparse.ArgumentParser(
        prog=f"python examples/{name}.py",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=epochs, help=f"training {unit} per method")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: a few {unit}, few samples")
    parser.add_argument("--out", type=Path, default=Path("out") / name, help="folder for the figures")
    parser.add_argument("--seed", type=int, default=0, help="random seed (data split and training)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser


@contextlib.contextmanager
def session(args):
    """
    Seed, thread count, an empty param store and the output folder for one run;
    Pyro's argument validation is off inside (it costs ~25 % of a step) and the
    global settings are restored afterwards, so tests can call ``main`` in-process.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    try:
        with pyro.validation_enabled(False):
            yield
    finally:
        torch.set_num_threads(threads)


def seed_method(seed: int) -> None:
    """Every method starts from the same seed and an empty param store."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)


# ------------------------------------------------------------------ data
@dataclass
class Split:
    """A standardised train/test split as float32 tensors (class labels as int64)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_train(self) -> int:
        return len(self.x_train)


def load_split(loader: Callable, classification: bool, test_size: float = 0.2, seed: int = 0) -> Split:
    """
    A scikit-learn dataset (``load_digits``, ``load_diabetes``, ...), split into train
    and test (stratified for classification); features standardised with the training
    mean and standard deviation, regression targets too.
    """
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = loader(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y if classification else None
    )
    scaler = StandardScaler().fit(x_train)
    x_train, x_test = scaler.transform(x_train), scaler.transform(x_test)
    if classification:
        y_train, y_test = torch.as_tensor(y_train).long(), torch.as_tensor(y_test).long()
    else:
        mean, std = y_train.mean(), y_train.std()
        y_train = torch.as_tensor((y_train - mean) / std, dtype=torch.float32)
        y_test = torch.as_tensor((y_test - mean) / std, dtype=torch.float32)
    as_float = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    return Split(as_float(x_train), y_train, as_float(x_test), y_test)


def load_full(loader: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    """A whole scikit-learn dataset, features standardised, as float32 tensors."""
    from sklearn.preprocessing import StandardScaler

    x, y = loader(return_X_y=True)
    x = StandardScaler().fit_transform(x)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)


# ------------------------------------------------------------------ training loop
@dataclass
class History:
    """
    One method's run. ``elbo[k]`` is the mean of the step estimates of the ELBO
    during epoch ``epoch[k]`` (for MAP: of the log joint, ``objective == "log joint"``);
    ``time[k]`` the training seconds so far, evaluation excluded; ``metrics`` what
    ``evaluate`` returned at the epochs in ``eval_epoch``.
    """

    name: str
    objective: str = "ELBO"
    epoch: List[int] = field(default_factory=list)
    time: List[float] = field(default_factory=list)
    elbo: List[float] = field(default_factory=list)
    eval_epoch: List[int] = field(default_factory=list)
    eval_time: List[float] = field(default_factory=list)
    metrics: Dict[str, List[float]] = field(default_factory=dict)
    steps: int = 0

    @property
    def seconds_per_step(self) -> float:
        """Mean training time of a step (the untimed first step left out)."""
        return self.time[-1] / max(self.steps - 1, 1) if self.time else math.nan

    def record(self, values: Dict[str, float], epoch: int, seconds: float) -> None:
        self.eval_epoch.append(epoch)
        self.eval_time.append(seconds)
        for key, value in values.items():
            self.metrics.setdefault(key, []).append(float(value))


def train(
    name: str,
    step: Callable[[Optional[torch.Tensor]], float],
    epochs: int,
    num_data: Optional[int] = None,
    batch_size: Optional[int] = None,
    evaluate: Optional[Callable[[], Dict[str, float]]] = None,
    eval_epochs: Optional[Sequence[int]] = None,
    epoch_offset: Optional[Callable[[], float]] = None,
    objective: str = "ELBO",
) -> History:
    """
    Run ``step`` over ``epochs`` epochs with a tqdm bar showing the running ELBO.

    ``step(index)`` takes one optimiser step on the minibatch ``index`` (a random
    permutation of ``range(num_data)`` is split into ``batch_size`` chunks each
    epoch; with ``num_data=None`` an epoch is one full-batch step and ``index`` is
    ``None``) and returns that step's estimate of the objective (ELBO, or log joint).
    ``epoch_offset()``, when given, is added to each epoch's mean (ivon-opt's
    KL term). The clock runs during steps only, from the second step on (the
    first pays one-off costs: the guide's set-up, lazy imports). ``evaluate()``
    runs after the epochs in ``eval_epochs`` (1-based; default: every epoch),
    outside the clock and on a forked RNG, so how often a run is scored does not
    change its trajectory.
    """
    history = History(name, objective)
    eval_epochs = set(range(1, epochs + 1) if eval_epochs is None else eval_epochs)
    steps_per_epoch = 1 if num_data is None else math.ceil(num_data / batch_size)
    running = None
    seconds = 0.0
    label = "ELBO" if objective == "ELBO" else "log joint"
    with tqdm(total=epochs * steps_per_epoch, desc=f"{name:>14}", unit="step", leave=True,
              dynamic_ncols=True, mininterval=0.5) as bar:
        for epoch in range(1, epochs + 1):
            batches = [None] if num_data is None else torch.randperm(num_data).split(batch_size)
            total = 0.0
            for index in batches:
                start = time.perf_counter()
                value = float(step(index))
                if bar.n > 0:  # the first step (guide set-up, lazy imports) is not timed
                    seconds += time.perf_counter() - start
                total += value
                running = value if running is None or not math.isfinite(running) else 0.9 * running + 0.1 * value
                bar.update()
                history.steps += 1
                bar.set_postfix_str(f"running {label} {running:.1f}", refresh=False)
            offset = epoch_offset() if epoch_offset is not None else 0.0  # reporting only: untimed
            history.epoch.append(epoch)
            history.time.append(seconds)
            history.elbo.append(total / len(batches) + offset)
            if evaluate is not None and epoch in eval_epochs:
                with torch.random.fork_rng():  # scoring never moves the training's RNG
                    history.record(evaluate(), epoch, seconds)
    return history


def evaluation_epochs(epochs: int, points: int = 10) -> List[int]:
    """About ``points`` evenly spread epochs, always the last one."""
    every = max(1, epochs // points)
    return sorted(set(range(every, epochs + 1, every)) | {epochs})


def log_spaced(steps: int, points: int = 40) -> List[int]:
    """About ``points`` steps spread evenly on a log scale over ``1..steps``."""
    grid = torch.logspace(0, math.log10(max(steps, 1)), points)
    return sorted({int(round(float(s))) for s in grid} | {steps})


def decaying(start: float, floor: float, halflife: float) -> Callable[[int], float]:
    """A step-size schedule for NGVI: ``start / (1 + t / halflife)``, never below ``floor``."""
    return lambda t: max(start / (1.0 + t / halflife), floor)


def annealed(start: float, end: float, steps: int) -> Callable[[int], float]:
    """A step-size schedule for NGVI: geometric from ``start`` to ``end`` over ``steps`` steps."""
    return lambda t: start * (end / start) ** min(t / max(steps, 1), 1.0)


def ngvi(settings: Dict, steps: int):
    """:class:`~pyro_ngvi.NGVI` from ``settings`` whose ``lr=(start, end)`` is annealed over ``steps``."""
    from pyro_ngvi import NGVI

    start, end = settings["lr"]
    return NGVI(**{**settings, "lr": annealed(start, end, steps)})


def svi_step(svi: SVI, x: torch.Tensor, y: torch.Tensor) -> Callable:
    """A :func:`train` step for Pyro's ``SVI``: minus the loss is the ELBO estimate."""

    def step(index):
        if index is None:
            return -svi.step(x, y)
        return -svi.step(x[index], y[index])

    return step


def precise_elbo(model, guide, data: Tuple, num_particles: int = 1000, seed: int = 0) -> float:
    """
    The ELBO from ``num_particles`` vectorised samples (the model must broadcast
    over a leading particle dimension), drawn from the same seeded noise every
    call: common random numbers, so a curve of it shows the guide moving, not
    the estimator's noise. The training RNG is left as it was.
    """
    elbo = Trace_ELBO(num_particles=num_particles, vectorize_particles=True, max_plate_nesting=1)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        return -elbo.loss(model, guide, *data)


def run_full_batch(name: str, model, guide, optim, loss, data: Tuple, steps: int,
                   elbo_particles: int = 1000, eval_steps: Optional[Sequence[int]] = None) -> History:
    """
    ``steps`` full-batch SVI steps (an epoch is one step here); the history's
    metric ``"elbo"`` is :func:`precise_elbo` at ``eval_steps`` (default: log-spaced).
    """
    svi = SVI(model, guide, optim, loss)

    def step(_):
        return -svi.step(*data)

    def evaluate():
        return {"elbo": precise_elbo(model, guide, data, elbo_particles)}

    return train(name, step, steps, evaluate=evaluate,
                 eval_epochs=log_spaced(steps) if eval_steps is None else eval_steps)


def steps_to_within(history: History, best: float, tolerance: float = 1.0) -> Optional[int]:
    """The first evaluated step from which the precise ELBO stays within ``tolerance`` of ``best``."""
    values, steps = history.metrics["elbo"], history.eval_epoch
    for k in range(len(values)):
        if all(v >= best - tolerance for v in values[k:]):
            return steps[k]
    return None


# ------------------------------------------------------------------ network likelihoods
def mean_nll(likelihood: str, output: torch.Tensor, y: torch.Tensor, log_noise=None) -> torch.Tensor:
    """Mean negative log-likelihood of a plain network's output, as in ``BayesianNet``."""
    if likelihood == "categorical":
        return F.cross_entropy(output, y)
    output = output.squeeze(-1)
    return (0.5 * ((y - output) / log_noise.exp()) ** 2 + log_noise + _HALF_LOG_TWO_PI).mean()


def _learned_noise(likelihood: str, init_noise_scale: float) -> Optional[torch.nn.Parameter]:
    if likelihood != "gaussian":
        return None
    return torch.nn.Parameter(torch.tensor(math.log(init_noise_scale)))


def map_step(net, likelihood, split: Split, prior_precision: float, lr: float,
             init_noise_scale: float = 1.0):
    """
    MAP training of the plain network with Adam: minimise
    :math:`-\\sum_i \\log p(y_i|x_i,w) + \\frac{\\lambda_0}{2}\\|w\\|^2` (the same
    model's negative log joint, up to constants), minibatch-scaled to N.
    Returns ``(step, log_noise)``; a Gaussian likelihood's noise is learned too.
    """
    log_noise = _learned_noise(likelihood, init_noise_scale)
    params = list(net.parameters()) + ([log_noise] if log_noise is not None else [])
    optimizer = torch.optim.Adam(params, lr=lr)
    n = split.num_train

    def step(index):
        x, y = split.x_train[index], split.y_train[index]
        optimizer.zero_grad()
        penalty = 0.5 * prior_precision * sum(p.square().sum() for p in net.parameters())
        loss = n * mean_nll(likelihood, net(x), y, log_noise) + penalty
        loss.backward()
        optimizer.step()
        return -loss.item()

    return step, log_noise


def ivon_step(net, likelihood, split: Split, prior_precision: float, lr: float, hess_init: float,
              init_noise_scale: float = 1.0, noise_lr: float = 1e-2, **ivon_args):
    """
    ivon-opt (IVON, Shen et al. 2024) on the plain network, in its usual loop: a mean
    loss, ``ess`` = N, ``weight_decay`` = prior precision / N (so the prior is the
    same N(0, 1/lambda_0)), one weight sample per step under ``sampled_params``.
    A Gaussian likelihood's noise is point-estimated by a separate Adam.
    Returns ``(step, optimizer, log_noise)``; ``step`` returns the likelihood part
    of the ELBO (``ivon_kl`` gives the rest).
    """
    n = split.num_train
    optimizer = ivon.IVON(net.parameters(), lr=lr, ess=n, hess_init=hess_init,
                          weight_decay=prior_precision / n, **ivon_args)
    log_noise = _learned_noise(likelihood, init_noise_scale)
    noise_optimizer = torch.optim.Adam([log_noise], lr=noise_lr) if log_noise is not None else None

    def step(index):
        x, y = split.x_train[index], split.y_train[index]
        with optimizer.sampled_params(train=True):
            optimizer.zero_grad()
            if noise_optimizer is not None:
                noise_optimizer.zero_grad()
            loss = mean_nll(likelihood, net(x), y, log_noise)
            loss.backward()
        optimizer.step()
        if noise_optimizer is not None:
            noise_optimizer.step()
        return -n * loss.item()

    return step, optimizer, log_noise


def ivon_kl(optimizer, prior_precision: float) -> float:
    """
    KL(q || p) of ivon-opt's Gaussian, :math:`q = \\mathcal{N}(m, (\\mathrm{ess}(h + \\delta))^{-1})`,
    against the prior :math:`\\mathcal{N}(0, \\lambda_0^{-1})`: with the step's expected
    log-likelihood this makes an ELBO comparable with Pyro's. Reads the optimizer's
    state: the mean is in the parameters outside ``sampled_params``, the Hessian
    estimate in each param group's ``"hess"`` (the layout of ivon-opt 0.1.x).
    """
    total = 0.0
    for group in optimizer.param_groups:
        mean = torch.cat([p.detach().flatten() for p in group["params"]])
        precision = group["ess"] * (group["hess"] + group["weight_decay"])
        total += gaussian_kl(mean, precision, prior_precision)
    return total


def gaussian_kl(mean: torch.Tensor, precision: torch.Tensor, prior_precision: float) -> float:
    """KL(N(m, 1/lam) || N(0, 1/lam0)), summed over elements."""
    ratio = prior_precision / precision
    return float(0.5 * (ratio + prior_precision * mean.square() - 1 - ratio.log()).sum())


# ------------------------------------------------------------------ predictions
def guide_outputs(model, guide, x: torch.Tensor, num_samples: int, sites=("output",)) -> Dict[str, torch.Tensor]:
    """Posterior predictive samples of ``sites`` with Pyro's own ``Predictive``."""
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=list(sites))
    with torch.no_grad():
        return predictive(x)


def ivon_outputs(net, optimizer, x: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Network outputs at ``num_samples`` weight draws from ivon-opt's posterior."""
    outputs = []
    with torch.no_grad():
        for _ in range(num_samples):
            with optimizer.sampled_params():
                outputs.append(net(x))
    return torch.stack(outputs)


def classification_metrics(probs: torch.Tensor, y: torch.Tensor) -> Dict[str, float]:
    return {
        "accuracy": float(metrics.accuracy(probs, y)),
        "nll": float(metrics.nll(probs, y)),
        "ece": float(metrics.expected_calibration_error(probs, y)),
        "brier": float(metrics.brier_score(probs, y)),
    }


def regression_metrics(loc_samples: torch.Tensor, noise_scale: float, y: torch.Tensor,
                       draws: int = 400) -> Dict[str, float]:
    """
    RMSE of the predictive mean, log-likelihood of the Gaussian-mixture predictive,
    and coverage of its central 50 % / 90 % intervals, estimated from ``draws``
    predictive samples per point (network samples, each plus fresh noise; the
    noise comes from a private generator so scoring never moves the training RNG).
    """
    loc = loc_samples.reshape(len(loc_samples), -1)
    repeats = math.ceil(draws / len(loc))
    generator = torch.Generator().manual_seed(0)
    noisy = loc.repeat(repeats, 1)
    noisy = noisy + noise_scale * torch.randn(noisy.shape, generator=generator)
    return {
        "rmse": float(metrics.rmse(loc.mean(0), y)),
        "loglik": float(metrics.gaussian_log_likelihood(loc, noise_scale, y)),
        "coverage50": float(metrics.interval_coverage(noisy, y, 0.5)),
        "coverage90": float(metrics.interval_coverage(noisy, y, 0.9)),
    }


# ------------------------------------------------------------------ BNN comparison harness
@dataclass
class BNNTask:
    """
    One Bayesian-network benchmark: the data, the network and prior every method
    shares, and how to score output samples. ``score(outputs, noise_scale)`` maps
    output samples on the test inputs, ``(S, N, ...)``, to metrics;
    ``inputs`` are the inputs whose final output samples each run keeps.
    """

    split: Split
    likelihood: str
    make_net: Callable[[], torch.nn.Module]
    prior_scale: float
    batch_size: int
    epochs: int
    score: Callable[[torch.Tensor, Optional[float]], Dict[str, float]]
    inputs: Dict[str, torch.Tensor]
    seed: int = 0
    eval_samples: int = 8
    final_samples: int = 32

    @property
    def prior_precision(self) -> float:
        return self.prior_scale**-2

    def network(self) -> torch.nn.Module:
        """The network with the same initial weights for every method."""
        seed_method(self.seed)
        return self.make_net()


@dataclass
class Fitted:
    """A trained method: its history, final output samples per input set, noise scale."""

    history: History
    outputs: Dict[str, torch.Tensor]
    noise_scale: Optional[float]


def _run(task: BNNTask, name: str, step, predict, noise, objective="ELBO", epoch_offset=None) -> Fitted:
    """Train with :func:`train`, scoring ``predict`` on the test set along the way."""

    def evaluate():
        return task.score(predict(task.split.x_test, task.eval_samples), noise())

    history = train(name, step, task.epochs, task.split.num_train, task.batch_size, evaluate,
                    evaluation_epochs(task.epochs), epoch_offset, objective)
    outputs = {key: predict(x, task.final_samples) for key, x in task.inputs.items()}
    return Fitted(history, outputs, noise())


def run_pyro(task: BNNTask, name: str, optim, loss, init_scale: float) -> Fitted:
    """
    Pyro SVI on a :class:`~pyro_ngvi.BayesianNet` of the task's network with an
    ``AutoNormal`` guide started at the network's initial weights: NGVI or Adam,
    with whatever ELBO ``loss`` is.
    """
    from pyro.infer.autoguide import AutoNormal

    from pyro_ngvi import BayesianNet

    bnn = BayesianNet(task.network(), task.likelihood, num_data=task.split.num_train,
                      prior=task.prior_scale)
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=init_scale)
    svi = SVI(bnn, guide, optim, loss)

    def predict(x, num_samples):
        return guide_outputs(bnn, guide, x, num_samples)["output"]

    def noise():
        return pyro.param("noise_scale").item() if task.likelihood == "gaussian" else None

    return _run(task, name, svi_step(svi, task.split.x_train, task.split.y_train), predict, noise)


def _noise_of(log_noise):
    return lambda: None if log_noise is None else log_noise.detach().exp().item()


def run_map(task: BNNTask, name: str, lr: float) -> Fitted:
    """The plain network, MAP by Adam (weight decay = the prior); one output sample."""
    net = task.network()
    step, log_noise = map_step(net, task.likelihood, task.split, task.prior_precision, lr)

    def predict(x, num_samples):
        with torch.no_grad():
            return net(x).unsqueeze(0)

    return _run(task, name, step, predict, _noise_of(log_noise), objective="log joint")


def run_ivon(task: BNNTask, name: str, lr: float, hess_init: float, **ivon_args) -> Fitted:
    """ivon-opt on the plain network; its ELBO adds the KL term once per epoch."""
    net = task.network()
    step, optimizer, log_noise = ivon_step(net, task.likelihood, task.split, task.prior_precision,
                                           lr, hess_init, **ivon_args)

    def predict(x, num_samples):
        return ivon_outputs(net, optimizer, x, num_samples)

    return _run(task, name, step, predict, _noise_of(log_noise),
                epoch_offset=lambda: -ivon_kl(optimizer, task.prior_precision))


# ------------------------------------------------------------------ tables
def markdown_table(rows: Sequence[Dict], columns: Sequence[Tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec); a missing or None value prints as ``-``."""
    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    lines = [header, rule]
    for row in rows:
        cells = []
        for key, _, spec in columns:
            value = row.get(key)
            cells.append("-" if value is None else format(value, spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ figures
def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_training(histories: Sequence[History], metric: str, metric_label: str, path: Path,
                  x_label: str = "epoch") -> Path:
    """
    2 x 2 panels: negative ELBO (log scale) and the test ``metric`` against
    epochs and against training wall time. Runs without an ELBO (MAP) only
    appear in the metric panels.
    """
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for k, history in enumerate(histories):
        style = dict(label=history.name, color=f"C{k}")  # one colour per method in every panel
        if history.objective == "ELBO":
            negative = [-v for v in history.elbo]
            axes[0, 0].plot(history.epoch, negative, **style)
            axes[0, 1].plot(history.time, negative, **style)
        if metric in history.metrics:
            axes[1, 0].plot(history.eval_epoch, history.metrics[metric], marker=".", **style)
            axes[1, 1].plot(history.eval_time, history.metrics[metric], marker=".", **style)
    for (row, col), (xl, yl) in {
        (0, 0): (x_label, "negative ELBO"),
        (0, 1): ("training time [s]", "negative ELBO"),
        (1, 0): (x_label, metric_label),
        (1, 1): ("training time [s]", metric_label),
    }.items():
        ax = axes[row, col]
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        if row == 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=8)
    return save_figure(fig, path)


def plot_elbo_curves(curves: Dict[str, Tuple[Sequence[float], Sequence[float]]], path: Path,
                     best: Optional[float] = None, x_label: str = "step") -> Path:
    """Negative ELBO against steps (log-log), one line per method; the optimum as a line."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    floor = best if best is not None else min(min(-v for v in values) for _, values in curves.values())
    for name, (steps, values) in curves.items():
        ax.plot(steps, [floor - v + 1.0 for v in values], label=name)
    ax.axhline(2.0, color="gray", lw=0.8, ls="--", label="1 nat from the best")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel("best ELBO - ELBO + 1  [nats]")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_reliability(probs_by_method: Dict[str, torch.Tensor], y: torch.Tensor, path: Path,
                     num_bins: int = 15) -> Path:
    """Reliability diagrams side by side, ECE (same bins as the tables) in each title."""
    names = list(probs_by_method)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        probs = probs_by_method[name]
        confidence, accuracy, count = (t.numpy() for t in metrics.reliability_diagram_data(probs, y, num_bins))
        centres = (torch.arange(num_bins).numpy() + 0.5) / num_bins
        filled = count > 0
        ax.bar(centres[filled], accuracy[filled], width=1.0 / num_bins, edgecolor="k", alpha=0.7,
               label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.plot(confidence[filled], accuracy[filled], "r.", label="(confidence, accuracy)")
        ece = float(metrics.expected_calibration_error(probs, y, num_bins))
        ax.set_title(f"{name}\nECE {ece:.3f}", fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0, 0].set_ylabel("accuracy")
    return save_figure(fig, path)


def plot_entropy(entropies: Dict[str, Tuple[torch.Tensor, torch.Tensor]], path: Path,
                 labels=("test digits", "out of distribution")) -> Path:
    """Histograms of predictive entropy, in-distribution against OOD, per method."""
    names = list(entropies)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False, sharey=True)
    top = max(float(torch.cat(pair).max()) for pair in entropies.values())
    bins = torch.linspace(0, max(top, 1e-3), 25).numpy()
    for ax, name in zip(axes[0], names):
        inside, outside = entropies[name]
        ax.hist(inside.numpy(), bins=bins, alpha=0.6, density=True, label=labels[0])
        ax.hist(outside.numpy(), bins=bins, alpha=0.6, density=True, label=labels[1])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("predictive entropy [nats]")
    axes[0, 0].set_ylabel("density")
    axes[0, 0].legend(fontsize=7)
    return save_figure(fig, path)
