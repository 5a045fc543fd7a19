"""
A Bayesian MLP (64-100-10) on scikit-learn's handwritten digits: NGVI's documented
recipe against honest baselines, the same network, prior N(0, s0^2), initial weights
and minibatches for every method.

* NGVI (ggn)   - the README's recipe, nothing tuned: ``bnn.guide()``, ``NGVI()``,
                 ``CurvatureELBO("ggn")`` (exact Gauss-Newton diagonal, BackPACK)
* MAP (tuned)  - Adam on the plain network, its weight decay and epoch chosen on a
                 validation split (``harness.tuned_map``)
* ivon-opt     - ``IVON(lr=0.1, ess=N)`` as its README shows it, weight decay 1/N
                 (the same prior), its other arguments at their defaults
* BBB (Adam)   - Pyro SVI + Adam on ``Trace_ELBO`` (Bayes-by-Backprop; lr 0.01,
                 init_scale 0.1, as chosen for ``benchmarks/bnn_digits.py``)

``benchmarks/bayes_vs_map.py`` runs these very methods (:func:`run`) on this task and
three more, over three seeds: the numbers printed here are its seed-0 row for digits.

Every method is scored alike: the predictive averages the softmax over ``--samples``
weights drawn from the method's Gaussian (the same draws for every method; MAP
predicts once); out-of-distribution detection is the AUROC of the predictive entropy
between the test digits and the same digits with their pixels permuted. Prints a
markdown table of test accuracy, NLL, ECE, Brier score, OOD AUROC and the final ELBO,
and saves into ``--out``:

* ``training_curves.png`` - negative ELBO and test NLL against epochs and wall time
* ``reliability.png``     - reliability diagrams
* ``entropy.png``         - predictive entropy on test digits and on pixel-permuted digits

Usage::

    python examples/bnn_classification.py [--epochs 100] [--quick] [--out out/bnn_classification]
"""

import sys
import time
from pathlib import Path

import torch

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # run as a script or imported by path: find the harness
    sys.path.insert(0, HERE)
import harness  # noqa: E402

from pyro_ngvi import metrics  # noqa: E402

NAME = "bnn_classification"
MAP_LABEL = "MAP (tuned)"
#: what each curve of training_curves.png is: every Bayesian method's ELBO is that of its own
#: Gaussian family, and the families differ, so the ELBO panels do not rank the methods
CURVE_LABELS = {
    "NGVI (ggn)": "NGVI (ggn) [family: mean-field, sigma <= noise limit's cap]",
    "BBB (Adam)": "BBB (Adam) [family: mean-field, unrestricted]",
    "ivon-opt": "ivon-opt [family: mean-field, its own precision]",
}
CURVES_TITLE = ("Top: each method's ELBO of its own Gaussian; the families differ (NGVI's sigma is capped by the "
                "noise limit, so its\nELBO is lower by construction): the ELBOs do not rank the methods. "
                "Bottom: test NLL, the number to compare.")


def digits_task(seed: int = 0, prior_scale: float = 1.0, batch_size: int = 128) -> harness.Task:
    """Digits, 1,257 training / 180 validation / 360 test images, MLP 64-100-10 (ReLU)."""
    return harness.Task("digits-mlp", harness.digits_split(), lambda: harness.mlp(64, 100, 10), "categorical",
                        prior_scale, batch_size, seed)


def methods(task: harness.Task) -> dict:
    """Name -> factory of each method trained for a fixed number of epochs (MAP is :func:`harness.tuned_map`)."""
    factories = {
        "NGVI (ggn)": lambda: harness.ngvi_recipe(task, "ggn", name="NGVI (ggn)"),
        "BBB (Adam)": lambda: harness.bayes_by_backprop(task, lr=1e-2, init_scale=0.1, name="BBB (Adam)"),
    }
    if harness.ivon_installed():
        factories["ivon-opt"] = lambda: harness.IVON(task, lr=0.1, hess_init=1.0)
    return factories


def ood_inputs(task: harness.Task) -> torch.Tensor:
    """The test inputs with their pixels permuted (one permutation per seed): out of distribution."""
    x = task.split.x_test
    permutation = torch.randperm(x[0].numel(), generator=torch.Generator().manual_seed(task.seed))
    return x.reshape(len(x), -1)[:, permutation].reshape(x.shape)


def score(task: harness.Task, method: harness.Method, samples: int, ood: bool = True) -> dict:
    """Test metrics of ``method``'s predictive (``samples`` draws, seeded by the task), and the OOD
    AUROC by predictive entropy (classification); also returns the probabilities, for figures."""
    split = task.split
    generator = torch.Generator().manual_seed(task.seed)
    with method.active():
        outputs = method.predict(split.x_test, samples, generator)
        result = harness.predictive_metrics(task.likelihood, outputs, split.y_test, method.noise_scale)
        if task.likelihood == "gaussian" or not ood:
            return result
        outputs_ood = method.predict(ood_inputs(task), samples, torch.Generator().manual_seed(task.seed))
    if task.likelihood == "bernoulli":
        outputs, outputs_ood = outputs.squeeze(-1), outputs_ood.squeeze(-1)
    probs, probs_ood = (metrics.predictive_probs_from_logits(o) for o in (outputs, outputs_ood))
    result["ood_auroc"] = float(metrics.ood_auroc(probs, probs_ood))
    result["probs"], result["probs_ood"] = probs, probs_ood
    return result


def run(task: harness.Task, epochs: int, samples: int = 32, ood: bool = True, curves: bool = False):
    """
    Every method on ``task`` for ``epochs`` epochs: ``{name: (method, scores)}``, the
    scores of :func:`score` plus ``seconds`` (training time) and ``elbo`` (Bayesian methods);
    with ``curves`` also the :class:`harness.History` of the methods trained for a fixed
    number of epochs (scored every few epochs), under ``"history"``.
    """
    evaluate = harness.evaluator(task, samples, samples, seed=task.seed)
    every = max(1, epochs // 20)
    eval_epochs = [0, *range(every, epochs + 1, every), epochs] if curves else [epochs]
    results = {}
    for name, make in methods(task).items():
        method = make()
        start = time.perf_counter()
        history = harness.fit(method, epochs, evaluate, eval_epochs)
        scores = score(task, method, samples, ood)
        scores.update(seconds=sum(history.step_times), elbo=history.at(epochs).get("elbo"),
                      ms_per_step=1e3 * history.seconds_per_step, history=history,
                      wall=time.perf_counter() - start)
        results[name] = method, scores
    method = harness.tuned_map(task, epochs)
    scores = score(task, method, samples, ood)
    scores.update(seconds=method.seconds, weight_decay=method.weight_decay, epoch=method.epoch)
    results[MAP_LABEL] = method, scores
    return results


def main(argv=None):
    args = harness.parse_bnn_args(NAME, __doc__.strip().splitlines()[0], argv, epochs=100, batch_size=128,
                                  samples=32)
    with harness.session(args):
        task = digits_task(args.seed, args.prior_scale, args.batch_size)
        results = run(task, args.epochs, args.samples, curves=True)
        rows = [{"method": name, **{k: v for k, v in scores.items() if not k.startswith("probs")}}
                for name, (_, scores) in results.items()]
        chosen = results[MAP_LABEL][1]
        print()
        print(f"Digits, MLP 64-100-10, prior N(0, {args.prior_scale:g}^2), {args.epochs} epochs, batch "
              f"{args.batch_size}, {args.samples} posterior samples per prediction (N = {task.num_data} train / "
              f"{len(task.split.x_valid)} validation / {len(task.split.x_test)} test); MAP's weight decay per "
              f"datum {chosen['weight_decay']:.0e} and epoch {chosen['epoch']} chosen on the validation split")
        print()
        print(harness.markdown_table(rows, [
            ("method", "method", "s"),
            ("accuracy", "test acc", ".3f"),
            ("nll", "test NLL", ".3f"),
            ("ece", "ECE", ".3f"),
            ("brier", "Brier", ".3f"),
            ("ood_auroc", "OOD AUROC", ".3f"),
            ("elbo", "final ELBO", ".0f"),
            ("seconds", "train s", ".1f"),
        ]))
        method = results["NGVI (ggn)"][0]
        with method.active():
            share = method.bnn.share_at_noise_limit(method.guide)
        print(f"\nNGVI: {share:.0%} of the weights' standard deviations sit at the noise limit's cap "
              "(BayesianNet.share_at_noise_limit): where that is most of them, the guide is a point "
              "estimate with fixed jitter, not a spread the data shaped (docs: the BNN recipe, small data)")
        probs = {name: scores["probs"] for name, (_, scores) in results.items()}
        figures = [
            harness.plot_training({CURVE_LABELS.get(name, name): [scores["history"]]
                                   for name, (_, scores) in results.items() if "history" in scores},
                                  "nll", "test NLL", args.out / "training_curves.png", title=CURVES_TITLE),
            harness.plot_reliability(probs, task.split.y_test, args.out / "reliability.png"),
            harness.plot_entropy(
                {name: (metrics.predictive_entropy(scores["probs"]), metrics.predictive_entropy(scores["probs_ood"]))
                 for name, (_, scores) in results.items()},
                args.out / "entropy.png", labels=("test digits", "pixel-permuted digits"),
            ),
        ]
        print()
        print("figures: " + ", ".join(str(f) for f in figures))
        return rows


if __name__ == "__main__":
    main()
