"""
Issue 26 diagnosis probe (development; one task, one seed): the BayesianNet recipe on a
``harness.small_tasks`` task, scored every ``EVERY`` epochs by the test NLL / ECE (regression:
-log-lik / 90 % coverage) of (a) the recipe's predictive (32 weight draws) and (b) the
linearised predictive of the Laplace-GGN posterior at the guide's mean with the prior precision
per layer by the evidence (``pyro_ngvi.evidence``, ``pyro_ngvi.linearized``), the share of
weights at the noise limit's cap and the evidence's precision per layer. MODE ``set``: the
evidence's prior is also written into the model once per epoch from epoch BURN on
(``EvidencePrior``, online type-II ML); ``watch``: the prior stays N(0, 1).

Usage::

    TQDM_DISABLE=1 python benchmarks/smalldata_probe.py TASK MODE EPOCHS BURN SEED EVERY
    e.g. python benchmarks/smalldata_probe.py synth4-200 set 300 10 0 50
"""
import os
import math
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), 'examples'))
import torch  # noqa: E402
import pyro  # noqa: E402
import harness  # noqa: E402
import smalldata as sd  # noqa: E402
from pyro_ngvi.evidence import EvidencePrior, diagonal_ggn, layer_precisions
from pyro_ngvi.linearized import linearized_outputs
torch.set_num_threads(1)
warnings.filterwarnings("ignore", "Full backward hook is firing")
task_name, mode, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
burn = int(sys.argv[4]); seed = int(sys.argv[5]); every = int(sys.argv[6])
overrides = eval(sys.argv[7]) if len(sys.argv) > 7 else {}
make, _ = harness.small_tasks()[task_name]
pyro.set_rng_seed(seed); pyro.clear_param_store()
def metr(task, outputs, noise):
    s = harness.predictive_metrics(task.likelihood, outputs, task.split.y_test, noise)
    return (-s['loglik'] if task.likelihood == 'gaussian' else s['nll']), s.get('ece', s.get('coverage90'))
with pyro.validation_enabled(False):
    task = make(seed)
    method = harness.ngvi_recipe(task, "ggn", **overrides)
    ev = EvidencePrior(method.bnn, method.guide)
    spe = math.ceil(task.num_data / task.batch_size); count = [0]; step = method.step
    def stepper(x, y):
        step(x, y); count[0] += 1
        if mode == 'set' and count[0] % spe == 0 and count[0] // spe >= burn:
            ev.update(task.split.x_train, task.split.y_train)
    method.step = stepper
    def evaluate(m):
        post = m.posterior(); bnn = m.bnn; x = task.split.x_test; g = lambda: torch.Generator().manual_seed(0)
        names = bnn.latent_sites; means = [post[s][0] for s in names]
        ll, hs = diagonal_ggn(bnn, means, task.split.x_train, task.split.y_train)
        alphas = layer_precisions(bnn, means, [0.0] * len(names), hs)
        lap = {s: (mu, (a + h).rsqrt()) for s, mu, a, h in zip(names, means, alphas, hs)}
        res = {'sample': metr(task, m.predict(x, 32, g()), m.noise_scale),
               'glm-lapEv': metr(task, linearized_outputs(m.net, lap, x, 32, g()), m.noise_scale)}
        b = sd.bounds(m)
        print(f"{count[0]//spe:4d} " + " ".join(f"{k} {v[0]:.4f}/{v[1]:.3f}" for k, v in res.items()), f"cap {b['at_cap']:.2f}", "alpha", " ".join(f"{float(a):.3g}" for a in alphas[::2]), flush=True)
        return {}
    harness.fit(method, epochs, evaluate, list(range(every, epochs + 1, every)))
