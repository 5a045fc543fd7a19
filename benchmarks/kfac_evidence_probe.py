"""
Issue 26, sixth attempt (development probe): the prior precision PER LAYER chosen online by the
whole-network K-FAC Laplace-GGN log marginal likelihood (Immer et al. 2021, "Scalable marginal
likelihood estimation for model selection in deep learning"), and the linearised (GLM) predictive
of that same K-FAC Laplace Gaussian (Immer et al. 2021, "Improving predictions of Bayesian neural
nets via local linearization").

The maths. Per ``Linear`` layer :math:`l` with parameters :math:`\\bar W_l = [W_l, b_l]` (``P_l``
entries, mean :math:`\\mu_l`) the GGN block is approximated by :math:`G_l \\otimes A_l`,
:math:`A_l = \\frac1N \\sum_n \\bar a_n \\bar a_n^\\top` (inputs with a 1 appended),
:math:`G_l = \\sum_n J_n^\\top H_n J_n` (the output Hessian's square root back-propagated to the
layer's pre-activations), both at the current mean on the whole training set
(``smalldata_probe.KFACLaplace``). With eigenvalues :math:`g_i` of :math:`G_l` and :math:`a_j` of
:math:`A_l` and a prior :math:`\\mathcal N(0, \\alpha_l^{-1} I)`, the posterior precision is
:math:`G_l \\otimes A_l + \\alpha_l I` and the K-FAC Laplace log evidence is

.. math::

    \\log Z(\\alpha) = \\log p(\\mathcal D \\mid \\mu) + \\sum_l \\Big[ -\\frac{\\alpha_l}{2}
    \\lVert\\mu_l\\rVert^2 + \\frac12 \\sum_{ij} \\log\\frac{\\alpha_l}{g_i a_j + \\alpha_l} \\Big],
    \\qquad
    \\frac{\\partial \\log Z}{\\partial \\log\\alpha_l} = -\\frac{\\alpha_l}{2}\\lVert\\mu_l\\rVert^2
    + \\frac12 \\sum_{ij} \\frac{g_i a_j}{g_i a_j + \\alpha_l}.

Online (Immer et al.'s algorithm): after a burn-in of ``--burn`` epochs, every ``--freq`` epochs the
factors are recomputed at the current mean and ``--hyper-steps`` Adam steps (lr ``--hyper-lr``) are
taken on :math:`\\log\\alpha_l` (warm-started), maximising :math:`\\log Z`; the new
:math:`\\alpha_l` is written into the training objective: the recipe's prior
(``bnn.set_prior``, scale :math:`\\alpha_l^{-1/2}`), or MAP's weight decay
(:math:`\\frac{1}{2N}\\sum_l \\alpha_l \\lVert\\bar W_l\\rVert^2` per datum), or noisy K-FAC's prior
(``--mean kronecker``, ``harness.ngvi_kronecker``). ``--pooled``: one :math:`\\alpha` for the net
(its gradient the sum of the layers'); ``--no-feedback``: the :math:`\\alpha_l` are updated for the
GLM predictive only, the training objective keeps the task's prior; ``--freeze``: never updated.

Each checkpoint scores two predictives of the current state (32 draws each, the same generator):
``sample`` the method's own (the recipe's guide draws; MAP: the point estimate), and ``glm`` the
GLM predictive of the K-FAC Laplace Gaussian at the current mean with the current
:math:`\\alpha_l`: :math:`f(x, \\mu) + J_x (w - \\mu)`, :math:`w - \\mu` drawn per layer as
:math:`Q_G (Z / \\sqrt{g a^\\top + \\alpha_l}) Q_A^\\top`. One JSON line per (checkpoint, predictive).

Usage::

    OMP_NUM_THREADS=1 TQDM_DISABLE=1 PYTHONPATH=$PWD python benchmarks/kfac_evidence_probe.py \\
        --mean recipe|map|kronecker --tasks synth4-200 ... --seeds 0 1 2 [--burn 50 --freq 5 --hyper-steps 10]
        [--pooled] [--no-feedback] [--freeze] [--epochs 100 200 300] --out F.jsonl

The results and the verdict: ``benchmarks/results/smalldata_sixth_attempt.md``.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import harness  # noqa: E402
import smalldata as sd  # noqa: E402
from smalldata_probe import KFACLaplace, method_means  # noqa: E402


class LayerwiseMAP(harness.MAP):
    """MAP (Adam on the negative log joint per datum) with a prior precision per ``Linear`` layer
    (weight and bias of a layer share it): penalty :math:`\\frac{1}{2N}\\sum_l \\alpha_l \\lVert\\bar W_l\\rVert^2`."""

    def __init__(self, task, lr=1e-3):
        super().__init__(task, lr=lr, name="MAP, evidence prior")
        self.alphas = {}

    def step(self, x, y):
        self.optim.zero_grad(set_to_none=True)
        penalty = 0.0
        for name, p in self.net.named_parameters():
            layer = name.rsplit(".", 1)[0]
            penalty = penalty + self.alphas.get(layer, self.task.prior_precision) * p.square().sum()
        (self.mean_nll(x, y) + 0.5 * penalty / self.task.num_data).backward()
        self.optim.step()


def evidence_gradient(log_alpha: torch.Tensor, squared_norm: float, eigenvalues: torch.Tensor) -> torch.Tensor:
    """:math:`\\partial \\log Z / \\partial \\log\\alpha` of one layer (module docstring)."""
    alpha = log_alpha.exp()
    return -0.5 * alpha * squared_norm + 0.5 * (eigenvalues / (eigenvalues + alpha)).sum()


class OnlineEvidence:
    """The per-layer :math:`\\log\\alpha_l`, warm-started, with Adam's moments kept across updates."""

    def __init__(self, names, alpha0, lr, steps):
        self.log_alpha = {n: torch.tensor(math.log(alpha0), dtype=torch.float64) for n in names}
        self.moments = {n: (0.0, 0.0) for n in names}
        self.lr, self.steps, self.t = lr, steps, 0

    def update(self, laplace: KFACLaplace, pooled: bool = False):
        """``steps`` Adam ascents on each :math:`\\log\\alpha_l` at the factors of ``laplace``
        (``pooled``: one :math:`\\alpha` for the net, its gradient the sum of the layers')."""
        layers = [(name, (g[:, None] * a[None, :]).reshape(-1), float(laplace.layer(name).double().square().sum()))
                  for name, (a, _, g, _) in zip(laplace.names, laplace.eig)]
        if pooled:
            layers = [(laplace.names[0], torch.cat([e for _, e, _ in layers]), sum(n for _, _, n in layers))]
        for name, eigenvalues, squared_norm in layers:
            m, v = self.moments[name]
            t = self.t
            for _ in range(self.steps):
                t += 1
                grad = float(evidence_gradient(self.log_alpha[name], squared_norm, eigenvalues))
                m, v = 0.9 * m + 0.1 * grad, 0.999 * v + 0.001 * grad * grad
                step = self.lr * (m / (1 - 0.9 ** t)) / (math.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
                self.log_alpha[name] = self.log_alpha[name] + step
            self.moments[name] = (m, v)
        self.t += self.steps
        if pooled:
            for name in laplace.names[1:]:
                self.log_alpha[name] = self.log_alpha[laplace.names[0]].clone()

    def alphas(self, names):
        return [float(self.log_alpha[n].exp()) for n in names]


class GLMView:
    """The K-FAC Laplace GLM predictive, presented as a method to ``smalldata.score``."""

    def __init__(self, method, laplace):
        self.method, self.laplace, self.task = method, laplace, method.task

    def active(self):
        return self.method.active()

    @property
    def noise_scale(self):
        return self.method.noise_scale

    def predict(self, x, num_samples, generator=None):
        return self.laplace.outputs(x, num_samples, generator)


def make_method(task, mean):
    if mean == "recipe":
        return harness.ngvi_recipe(task, "ggn")
    if mean == "map":
        return LayerwiseMAP(task)
    if mean == "kronecker":  # noisy K-FAC (NGVI's dense defaults), its own whole-layer draws as ``sample``
        return harness.ngvi_kronecker(task)
    raise ValueError(f"mean must be 'recipe', 'map' or 'kronecker', got {mean!r}")


def _with_alphas(method, task, alphas):
    split = task.split
    laplace = KFACLaplace(method.net, method_means(method), split.x_train, split.y_train, task.likelihood,
                          method.noise_scale, task.num_data, alpha=1.0)
    laplace.alphas = [alphas[n] for n in laplace.names]
    return laplace


def run(task_name, seed, args, out):
    start = time.time()
    with harness.probe(task_name, seed) as task:
        method = make_method(task, args.mean)
        names = [n for n, m in method.net.named_modules() if isinstance(m, torch.nn.Linear)]
        online = OnlineEvidence(names, task.prior_precision, args.hyper_lr, args.hyper_steps)
        alphas = {n: task.prior_precision for n in names}

        def write_prior():
            if args.mean in ("recipe", "kronecker"):
                method.bnn.set_prior({f"{n}.{p}": alphas[n] ** -0.5 for n in names for p in ("weight", "bias")})
            else:
                method.alphas = dict(alphas)

        def update(steps_taken):
            epoch = steps_taken // math.ceil(task.num_data / task.batch_size)
            if args.freeze or (epoch - args.burn) % args.freq:
                return
            laplace = _with_alphas(method, task, alphas)
            online.update(laplace, args.pooled)
            alphas.update(zip(names, online.alphas(names)))
            if not args.no_feedback:
                write_prior()

        harness.after_epochs(method, task, args.burn, update)

        def evaluate(m, epoch):
            laplace = _with_alphas(m, task, alphas)
            for predictive, view in (("sample", m), ("glm", GLMView(m, laplace))):
                scores = sd.score(task, view)
                row = {"task": task_name, "seed": seed, "mean": args.mean, "burn": args.burn, "freq": args.freq,
                       "steps": args.hyper_steps, "freeze": args.freeze, "feedback": not args.no_feedback, "pooled": args.pooled, "epoch": epoch, "predictive": predictive,
                       "nll": sd.nll_of(task, scores), "ece": scores.get("ece"), "acc": scores.get("accuracy"),
                       "ood": scores.get("ood_auroc"), "alphas": [round(alphas[n], 4) for n in names],
                       "s": round(time.time() - start, 1)}
                print(json.dumps(row), file=out, flush=True)
                print(f"{task_name} s{seed} {args.mean} @{epoch} {predictive}: nll {row['nll']:.4f} "
                      f"ece {row['ece'] if row['ece'] is None else round(row['ece'], 4)} "
                      f"alpha {' '.join(f'{a:.3g}' for a in row['alphas'])} [{row['s']} s]", flush=True)

        total = harness.small_tasks()[task_name][1]
        marks = set(args.epochs or (total // 3, 2 * total // 3, total))
        last = max(marks)

        def report(m, epoch):
            if epoch in marks:
                evaluate(m, epoch)

        harness.fit_every(method, last, math.gcd(*marks), report)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mean", default="recipe", choices=["recipe", "map", "kronecker"])
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--epochs", nargs="+", type=int, default=None, help="default: a third, two thirds and all of the task's epochs")
    parser.add_argument("--burn", type=int, default=50)
    parser.add_argument("--freq", type=int, default=5)
    parser.add_argument("--hyper-steps", type=int, default=10)
    parser.add_argument("--hyper-lr", type=float, default=0.1)
    parser.add_argument("--freeze", action="store_true", help="never update the prior (the plain mean)")
    parser.add_argument("--pooled", action="store_true", help="one alpha for the whole net")
    parser.add_argument("--no-feedback", action="store_true",
                        help="update the alphas (for the GLM predictive) but never write them into the training objective")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.out, "a") as out:
        for task_name in args.tasks:
            for seed in args.seeds:
                run(task_name, seed, args, out)


if __name__ == "__main__":
    main()
