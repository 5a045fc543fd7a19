"""
The experiment harness of the examples (the readable face) and the benchmarks
(the measured one). Not part of the package: scripts put ``examples/`` on
``sys.path`` and ``import harness``.

* ``task``    a task = data split (train / validation / test) + network factory +
              likelihood + prior; the metrics every prediction is scored by;
* ``tasks``   the tasks the scripts run on;
* ``methods`` a method = a training step + a predictive sampler: NGVI and
              Bayes-by-Backprop through Pyro's ``SVI``, MAP, ivon-opt, hand-written VOGN;
* ``train``   the timed loop, and the one evaluation (ELBO, test metrics) of every method;
* ``report``  markdown tables and figures; ``cli`` the examples' command line.
"""

from .cli import make_parser, parse_bnn_args, probe, run_suite, seed, session, suite_args
from .methods import (
    IVON, MAP, HandVOGN, KroneckerSVI, Method, Posterior, PyroSVI, annealed, bayes_by_backprop, decaying, ivon_installed,
    ngvi, ngvi_kronecker, ngvi_recipe,
    sample_outputs,
)
from .report import (
    markdown_table, mean_sd, plot_elbo_curves, publish, plot_entropy, plot_reliability, plot_training, plt, save_figure,
)
from .task import Split, Task, make_split, minibatches, nll, predictive_metrics, regression_metrics
from .tasks import (
    diabetes_mlp, digits_cnn, digits_cnn_net, digits_mlp, digits_split, mlp, random_shift, sklearn_task, suite_tasks,
    small_tasks, SMALL_TUNING,
)
from .train import (
    MAP_WEIGHT_DECAYS, History, after_epochs, compare, elbo, evaluator, fit, fit_every, gaussian_kl, log_spaced, precise_elbo,
    run_full_batch, steps_to_within, trace_elbo, train, tuned_map, validated_ngvi, validation_loss,
)

__all__ = [
    # task.py, tasks.py
    "Split", "Task", "make_split", "minibatches", "nll", "predictive_metrics", "regression_metrics",
    "mlp", "sklearn_task", "digits_mlp", "diabetes_mlp", "suite_tasks", "digits_split", "digits_cnn",
    "digits_cnn_net", "random_shift", "small_tasks", "SMALL_TUNING",
    # methods.py
    "Method", "Posterior", "PyroSVI", "KroneckerSVI", "ngvi", "ngvi_kronecker", "ngvi_recipe", "bayes_by_backprop", "MAP",
    "IVON", "HandVOGN", "sample_outputs",
    "ivon_installed", "annealed", "decaying",
    # train.py
    "History", "train", "fit", "fit_every", "after_epochs", "compare", "evaluator", "elbo", "gaussian_kl", "trace_elbo", "tuned_map",
    "validated_ngvi",
    "validation_loss", "MAP_WEIGHT_DECAYS",
    "run_full_batch", "precise_elbo", "log_spaced", "steps_to_within",
    # report.py, cli.py
    "markdown_table", "mean_sd", "publish", "save_figure", "plt", "plot_training", "plot_elbo_curves", "plot_reliability",
    "plot_entropy", "make_parser", "parse_bnn_args", "session", "probe", "seed", "suite_args", "run_suite",
]
