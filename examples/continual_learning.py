"""
Continual learning on scikit-learn's digits: yesterday's posterior is today's prior.

Two benchmarks, five tasks each, trained one after the other (a task's data is
seen only during its turn):

* **permuted digits**: every task is the whole ten-class problem with the 64
  pixels in a fixed random order (task 1 keeps the original order); one network,
  one output head, MLP 64-100-10;
* **split digits**: task ``t`` tells digit ``2t`` from ``2t + 1``; a shared body
  (64-100, ReLU) with one two-way head per task (multi-head). Only the body's
  posterior becomes the next prior (``posterior_as_prior(guide, sites=...)``);
  each head starts from the initial prior.

Methods, all on the same networks, initialisation and data:

* ``NGVI (ours)``: :class:`~pyro_ngvi.BayesianNet` + ``CurvatureELBO("ef")`` +
  :class:`~pyro_ngvi.NGVI` (VOGN), the posterior carried as the prior
  (:func:`~pyro_ngvi.posterior_as_prior`, :func:`~pyro_ngvi.with_priors`) and the
  new guide started at it (:func:`~pyro_ngvi.start_task`, ``carry=True``);
* ``VCL (BBB, Adam)``: the same Bayesian models and chain, fitted by
  Bayes-by-Backprop: ``Trace_ELBO`` + ``pyro.optim.Adam`` (variational
  continual learning);
* ``Fine-tuning (MAP)``: the network trained by Adam on each task in turn, no prior;
* ``MAP + L2 pull``: the same with :math:`\\frac{c}{2}\\|w - w_{t-1}\\|^2` pulling
  the shared weights toward their values after the previous task.

Both Bayesian methods use the same model: first prior :math:`N(0, 0.1^2)` on
every weight, and a tempered likelihood (each example counted
``1 / kl_weight = 200`` times, i.e. the KL term weighted by 0.005; untempered, the
mean-field posterior of a 7,510-weight network on 1,347 images is too wide to
predict well). The settings, and what else was tried, are in
``benchmarks/continual.py``.

After each task every method is evaluated on the test split of every task seen
so far (Bayesian methods: predictive probabilities averaged over posterior
samples). Reported: the accuracy matrices (PNG), average accuracy and
forgetting after the last task, and training wall time. Forgetting is the mean
over all tasks but the last of the drop from their best accuracy to the final one.

Usage::

    python examples/continual_learning.py [--out out/continual] [--quick]
        [--experiments permuted split] [--seed 0] [--set FIELD=VALUE ...]
"""

import argparse
import math
import os
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import pyro
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import BayesianNet, CurvatureELBO, NGVI, metrics, posterior_as_prior, start_task, with_priors

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as a script or imported by path: find the harness
    sys.path.insert(0, HERE)
import harness  # noqa: E402

EXPERIMENTS = ("permuted", "split")
METHODS = ("NGVI (ours)", "VCL (BBB, Adam)", "Fine-tuning (MAP)", "MAP + L2 pull")

# site -> (mean, standard deviation or None for a point estimate)
Weights = Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]


@dataclass
class Config:
    """Everything a run depends on; the defaults are the reported settings."""

    tasks: int = 5
    hidden: int = 100
    batch_size: int = 64  # MAP baselines
    seed: int = 0
    test_fraction: float = 0.25
    eval_samples: int = 20  # posterior samples per prediction (Bayesian methods)
    prior_scale: float = 0.1  # first task's prior N(0, s0^2) (Bayesian methods)
    # likelihood tempering of both Bayesian methods: the model counts each example
    # 1 / kl_weight times (num_data = N / kl_weight), i.e. KL weighted by kl_weight
    kl_weight: float = 0.005
    # NGVI
    ngvi_epochs: int = 10
    ngvi_batch_size: int = 128
    ngvi_lr: float = 0.01
    ngvi_beta: float = 0.01
    ngvi_damping: float = 30.0
    ngvi_momentum: float = 0.9
    ngvi_init_scale: float = 0.01
    ngvi_curvature: str = "ef"
    ngvi_carry: bool = True
    # VCL with Bayes-by-Backprop
    vcl_epochs: int = 20
    vcl_batch_size: int = 64
    vcl_lr: float = 3e-3
    vcl_init_scale: float = 0.01
    # MAP baselines
    map_epochs: int = 20
    map_lr: float = 1e-3
    l2_strength: float = 0.1


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #


@dataclass
class Task:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_tasks(experiment: str, cfg: Config) -> List[Task]:
    """The tasks of ``experiment`` ("permuted" or "split"), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images / 16.0, labels, test_size=cfg.test_fraction, random_state=cfg.seed, stratify=labels
    )
    x_train, x_test = (torch.tensor(a, dtype=torch.float32) for a in (x_train, x_test))
    y_train, y_test = (torch.tensor(a, dtype=torch.long) for a in (y_train, y_test))
    generator = torch.Generator().manual_seed(1000 + cfg.seed)
    tasks = []
    for t in range(cfg.tasks):
        if experiment == "permuted":
            order = torch.arange(64) if t == 0 else torch.randperm(64, generator=generator)
            tasks.append(
                Task(f"P{t + 1}", x_train[:, order], y_train, x_test[:, order], y_test)
            )
        elif experiment == "split":
            pair = (2 * t, 2 * t + 1)
            train = (y_train == pair[0]) | (y_train == pair[1])
            test = (y_test == pair[0]) | (y_test == pair[1])
            tasks.append(
                Task(
                    f"{pair[0]}/{pair[1]}",
                    x_train[train],
                    (y_train[train] == pair[1]).long(),
                    x_test[test],
                    (y_test[test] == pair[1]).long(),
                )
            )
        else:
            raise ValueError(f"unknown experiment {experiment!r}; choose from {EXPERIMENTS}")
    return tasks


# --------------------------------------------------------------------------- #
# Networks
# --------------------------------------------------------------------------- #


def make_networks(experiment: str, cfg: Config) -> Tuple[List[nn.Module], List[str]]:
    """
    The network each task is trained and evaluated with, and the names of the
    shared parameters. Permuted: one MLP for every task. Split: task ``t``'s
    network is ``Sequential(body, head<t>)`` with the body shared, so parameter
    (and site) names are ``body.0.weight``, ``head3.bias``, ...
    """
    torch.manual_seed(cfg.seed)
    if experiment == "permuted":
        net = nn.Sequential(nn.Linear(64, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 10))
        return [net] * cfg.tasks, [name for name, _ in net.named_parameters()]
    body = nn.Sequential(nn.Linear(64, cfg.hidden), nn.ReLU())
    nets = [
        nn.Sequential(OrderedDict([("body", body), (f"head{t}", nn.Linear(cfg.hidden, 2))]))
        for t in range(cfg.tasks)
    ]
    return nets, [f"body.{name}" for name, _ in body.named_parameters()]


# --------------------------------------------------------------------------- #
# Methods
# --------------------------------------------------------------------------- #


class Method:
    """A continual learner: trains on one task at a time, keeps ``weights``."""

    name = ""

    def __init__(self, cfg: Config, shared: Sequence[str]):
        self.cfg = cfg
        self.shared = list(shared)
        self.weights: Weights = {}
        self.epochs = 1
        self.batch_size = cfg.batch_size

    def train_task(self, t: int, net: nn.Module, task: Task, on_epoch: Callable) -> None:
        raise NotImplementedError


class BayesianChain(Method):
    """
    Variational continual learning with a mean-field Gaussian posterior per task:
    task ``t``'s prior on the shared weights is task ``t-1``'s posterior.
    Subclasses choose the optimizer, the loss and the guide's start.
    """

    init_scale = 0.1
    carry = True

    def __init__(self, cfg, shared):
        super().__init__(cfg, shared)
        self.priors = None  # posterior_as_prior of the previous task's guide

    def optimizer(self):
        raise NotImplementedError

    def loss(self):
        raise NotImplementedError

    def train_task(self, t, net, task, on_epoch):
        cfg = self.cfg
        num_data = round(len(task.x_train) / cfg.kl_weight)
        model = BayesianNet(net, "categorical", num_data=num_data, prior=cfg.prior_scale)
        if self.priors is not None:
            model = with_priors(model, self.priors)
        # where the guide starts: a site with a previous posterior at it
        # (carry=True), else at its previous mean with scale init_scale; a new
        # site at PyTorch's initialisation of the network, scale init_scale
        initial = {name: p.detach().clone() for name, p in net.named_parameters()}
        initial.update({name: mean for name, (mean, _) in self.weights.items()})

        def init_loc_fn(site):
            return initial[site["name"]]

        guide = AutoNormal(model, init_loc_fn=init_loc_fn, init_scale=self.init_scale)
        first = slice(0, self.batch_size)
        guide = start_task(
            guide, self.priors, task.x_train[first], task.y_train[first], carry=self.carry
        )
        svi = SVI(model, guide, self.optimizer(), self.loss())
        generator = torch.Generator().manual_seed(cfg.seed * 100 + t)
        for _ in range(self.epochs):
            for x, y in harness.minibatches(task.x_train, task.y_train, self.batch_size, generator):
                svi.step(x, y)
            on_epoch()
        for site in model.latent_sites:
            loc, scale = guide._get_loc_and_scale(site)
            self.weights[site] = (loc.detach().clone(), scale.detach().clone())
        self.priors = posterior_as_prior(guide, sites=self.shared)


class NGVIChain(BayesianChain):
    name = "NGVI (ours)"

    def __init__(self, cfg, shared):
        super().__init__(cfg, shared)
        self.epochs, self.batch_size = cfg.ngvi_epochs, cfg.ngvi_batch_size
        self.init_scale, self.carry = cfg.ngvi_init_scale, cfg.ngvi_carry

    def optimizer(self):
        cfg = self.cfg
        return NGVI(
            lr=cfg.ngvi_lr,
            beta=cfg.ngvi_beta,
            damping=cfg.ngvi_damping,
            momentum=cfg.ngvi_momentum,
        )

    def loss(self):
        return CurvatureELBO(self.cfg.ngvi_curvature)


class VCLBayesByBackprop(BayesianChain):
    name = "VCL (BBB, Adam)"

    def __init__(self, cfg, shared):
        super().__init__(cfg, shared)
        self.epochs, self.batch_size = cfg.vcl_epochs, cfg.vcl_batch_size
        self.init_scale = cfg.vcl_init_scale

    def optimizer(self):
        return pyro.optim.Adam({"lr": self.cfg.vcl_lr})

    def loss(self):
        return Trace_ELBO()


class MapFineTuning(Method):
    """Adam on the mean cross-entropy, plus ``(c/2)||w - w_prev||^2`` on the
    shared weights from the second task on when ``strength`` is ``c > 0``."""

    name = "Fine-tuning (MAP)"

    def __init__(self, cfg, shared, strength: float = 0.0):
        super().__init__(cfg, shared)
        self.epochs = cfg.map_epochs
        self.strength = strength

    def train_task(self, t, net, task, on_epoch):
        cfg = self.cfg
        params = dict(net.named_parameters())
        anchors = {}
        if self.strength > 0 and t > 0:
            anchors = {name: params[name].detach().clone() for name in self.shared}
        optimizer = torch.optim.Adam(params.values(), lr=cfg.map_lr)
        generator = torch.Generator().manual_seed(cfg.seed * 100 + t)
        for _ in range(self.epochs):
            for x, y in harness.minibatches(task.x_train, task.y_train, self.batch_size, generator):
                loss = F.cross_entropy(net(x), y)
                for name, anchor in anchors.items():
                    loss = loss + 0.5 * self.strength * (params[name] - anchor).square().sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            on_epoch()
        for name, p in params.items():
            self.weights[name] = (p.detach().clone(), None)


class MapL2Pull(MapFineTuning):
    name = "MAP + L2 pull"

    def __init__(self, cfg, shared):
        super().__init__(cfg, shared, strength=cfg.l2_strength)


METHOD_CLASSES = {cls.name: cls for cls in (NGVIChain, VCLBayesByBackprop, MapFineTuning, MapL2Pull)}


# --------------------------------------------------------------------------- #
# Running and scoring
# --------------------------------------------------------------------------- #


@dataclass
class Result:
    experiment: str
    method: str
    accuracy: torch.Tensor  # [after task t, on task k], NaN for k > t
    train_seconds: float
    config: Dict = field(default_factory=dict)

    @property
    def average_accuracy(self) -> float:
        """Mean accuracy over all tasks after the last one."""
        return float(self.accuracy[-1].mean())

    def average_accuracy_curve(self) -> List[float]:
        return [float(self.accuracy[t, : t + 1].mean()) for t in range(len(self.accuracy))]

    @property
    def forgetting(self) -> float:
        """Mean over tasks k < T of max_{t<T} acc[t, k] - acc[T, k] (0 for one task)."""
        final = len(self.accuracy) - 1
        if final == 0:
            return 0.0
        drops = [
            float(self.accuracy[k:final, k].max() - self.accuracy[final, k]) for k in range(final)
        ]
        return sum(drops) / len(drops)


def run_method(
    experiment: str, method_name: str, cfg: Config, tasks: List[Task], quiet: bool = False
) -> Result:
    """Train one method on ``tasks`` in turn; evaluate after each task."""
    pyro.clear_param_store()
    nets, shared = make_networks(experiment, cfg)
    method = METHOD_CLASSES[method_name](cfg, shared)
    pyro.set_rng_seed(cfg.seed)  # the weight noise of the Bayesian methods
    accuracy = torch.full((len(tasks), len(tasks)), math.nan)
    generator = torch.Generator().manual_seed(cfg.seed + 7)
    seconds = 0.0
    progress = tqdm(
        total=len(tasks) * method.epochs,
        desc=f"{experiment:8s} {method_name}",
        disable=quiet,
        leave=False,
        file=sys.stderr,
    )
    for t, task in enumerate(tasks):
        start = time.perf_counter()
        method.train_task(t, nets[t], task, lambda: progress.update())
        seconds += time.perf_counter() - start
        for k in range(t + 1):
            logits = harness.sample_outputs(nets[k], method.weights, tasks[k].x_test, cfg.eval_samples, generator)
            probs = metrics.predictive_probs_from_logits(logits)
            accuracy[t, k] = (probs.argmax(-1) == tasks[k].y_test).float().mean()
        progress.set_postfix(avg_acc=f"{float(accuracy[t, : t + 1].mean()):.3f}")
    progress.close()
    return Result(experiment, method_name, accuracy, seconds, asdict(cfg))


def run_experiment(
    experiment: str, cfg: Config, methods: Sequence[str] = METHODS, quiet: bool = False
) -> List[Result]:
    tasks = load_tasks(experiment, cfg)
    return [run_method(experiment, name, cfg, tasks, quiet) for name in methods]


def results_table(results: Sequence[Result], reference: str = "VCL (BBB, Adam)") -> str:
    """A markdown table: one row per (experiment, method)."""
    lines = [
        "| experiment | method | avg. accuracy | forgetting | train time (s) | time / VCL |",
        "|---|---|---:|---:|---:|---:|",
    ]
    times = {(r.experiment, r.method): r.train_seconds for r in results}
    for r in results:
        ref = times.get((r.experiment, reference))
        ratio = f"{r.train_seconds / ref:.2f}" if ref else "-"
        lines.append(
            f"| {r.experiment} | {r.method} | {100 * r.average_accuracy:.1f} % | "
            f"{100 * r.forgetting:.1f} pts | {r.train_seconds:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def plot_accuracy_matrices(results: Sequence[Result], path: str) -> None:
    """One heat map per method: accuracy on task k (columns) after task t (rows)."""
    fig, axes = harness.plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.4), squeeze=False)
    for ax, r in zip(axes[0], results):
        matrix = r.accuracy.numpy()
        ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis")
        size = len(matrix)
        for t in range(size):
            for k in range(t + 1):
                ax.text(k, t, f"{100 * matrix[t, k]:.0f}", ha="center", va="center",
                        color="white" if matrix[t, k] < 0.6 else "black", fontsize=8)
        ax.set_xticks(range(size), [str(k + 1) for k in range(size)])
        ax.set_yticks(range(size), [str(t + 1) for t in range(size)])
        ax.set_xlabel("evaluated on task")
        ax.set_ylabel("after training task")
        ax.set_title(f"{r.method}\navg {100 * r.average_accuracy:.1f} %", fontsize=9)
    fig.suptitle(f"{results[0].experiment} digits: test accuracy (%)")
    harness.save_figure(fig, path)


def plot_average_accuracy(results: Sequence[Result], path: str) -> None:
    experiments = list(dict.fromkeys(r.experiment for r in results))
    fig, axes = harness.plt.subplots(1, len(experiments), figsize=(5 * len(experiments), 3.6), squeeze=False)
    for ax, experiment in zip(axes[0], experiments):
        for r in results:
            if r.experiment == experiment:
                curve = r.average_accuracy_curve()
                ax.plot(range(1, len(curve) + 1), [100 * a for a in curve], marker="o", label=r.method)
        ax.set_xticks(range(1, len(results[0].accuracy) + 1))
        ax.set_xlabel("tasks seen")
        ax.set_ylabel("average accuracy (%)")
        ax.set_title(f"{experiment} digits")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    harness.save_figure(fig, path)


def write_outputs(results: Sequence[Result], out: str, header: str = "") -> str:
    """PNGs per experiment, the average-accuracy plot and ``results.md``; returns the table."""
    os.makedirs(out, exist_ok=True)
    for experiment in dict.fromkeys(r.experiment for r in results):
        subset = [r for r in results if r.experiment == experiment]
        plot_accuracy_matrices(subset, os.path.join(out, f"{experiment}_accuracy.png"))
    plot_average_accuracy(results, os.path.join(out, "average_accuracy.png"))
    table = results_table(results)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(header + table + "\n")
    return table


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def parse_args(argv=None) -> argparse.Namespace:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("out", "continual"), help="output folder")
    parser.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--tasks", type=int, default=defaults.tasks)
    parser.add_argument("--epochs-ngvi", type=int, default=defaults.ngvi_epochs)
    parser.add_argument("--epochs-vcl", type=int, default=defaults.vcl_epochs)
    parser.add_argument("--epochs-map", type=int, default=defaults.map_epochs)
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="FIELD=VALUE",
        help="override Config fields, e.g. --set ngvi_lr=0.1 ngvi_carry=False",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--quick", action="store_true", help="2 tasks, 1 epoch: a smoke test")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def parse_overrides(items: Sequence[str]) -> Dict:
    """``["ngvi_lr=0.1", "ngvi_carry=False"]`` as typed :class:`Config` fields."""
    types = {f.name: f.type for f in fields(Config)}
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--set: unknown field {key!r}; fields: {', '.join(types)}")
        kind = types[key]
        if kind in (bool, "bool"):
            overrides[key] = value.lower() in ("1", "true", "yes")
        else:
            overrides[key] = {"int": int, "float": float, "str": str}.get(kind, kind)(value)
    return overrides


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(
        seed=args.seed,
        tasks=args.tasks,
        ngvi_epochs=args.epochs_ngvi,
        vcl_epochs=args.epochs_vcl,
        map_epochs=args.epochs_map,
    )
    cfg = replace(cfg, **parse_overrides(args.set))
    if args.quick:
        cfg = replace(cfg, tasks=2, ngvi_epochs=1, vcl_epochs=1, map_epochs=1, eval_samples=2)
    return cfg


def main(argv=None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    results = []
    for experiment in args.experiments:
        results += run_experiment(experiment, cfg, args.methods, quiet=args.quiet)
    header = (
        f"Continual learning on digits, {cfg.tasks} tasks, seed {cfg.seed} "
        f"(epochs: NGVI {cfg.ngvi_epochs}, VCL {cfg.vcl_epochs}, MAP {cfg.map_epochs}).\n\n"
    )
    table = write_outputs(results, args.out, header)
    print(header + table)
    return table


if __name__ == "__main__":
    main()
