"""The experiment harness of examples/ and benchmarks/: every method's ELBO is
computed one way, and agrees with Pyro's own Trace_ELBO (issue 14)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import harness  # noqa: E402


def small_task(likelihood="categorical", validation_size=0.0):
    """150 generated examples with 4 features: 3 classes, 2 classes, or a regression target."""
    from sklearn.datasets import make_classification, make_regression

    if likelihood == "gaussian":
        x, y = make_regression(n_samples=150, n_features=4, noise=10.0, random_state=0)
    else:
        x, y = make_classification(n_samples=150, n_features=4, n_informative=3, n_redundant=0,
                                   n_classes=3 if likelihood == "categorical" else 2, random_state=0)
    split = harness.make_split(x, y, likelihood, test_size=0.2, validation_size=validation_size)
    outputs = 3 if likelihood == "categorical" else 1
    return harness.Task("toy", split, lambda: harness.mlp(4, 8, outputs), likelihood, prior_scale=0.5, batch_size=32)


def test_split_holds_out_a_stratified_validation_set_standardised_with_the_training_part():
    split = small_task(validation_size=0.25).split
    assert (len(split.x_train), len(split.x_valid), len(split.x_test)) == (90, 30, 30)
    assert torch.allclose(split.x_train.mean(0), torch.zeros(4), atol=1e-5)
    assert torch.allclose(split.x_train.std(0, unbiased=False), torch.ones(4), atol=1e-5)
    assert torch.bincount(split.y_valid).tolist() == [10, 10, 10]


def test_ivon_posterior_is_the_gaussian_ivon_samples_from_with_the_tasks_prior():
    task = small_task()
    method = harness.IVON(task, lr=0.1, hess_init=0.05, beta2=0.99)
    for x, y in harness.minibatches(task.split.x_train, task.split.y_train, 32, torch.Generator().manual_seed(0)):
        method.step(x, y)
    (group,) = method.optim.param_groups
    assert group["ess"] * group["weight_decay"] == pytest.approx(task.prior_precision)  # the same prior
    posterior = method.posterior()
    draws = []
    for _ in range(4000):
        with method.optim.sampled_params():
            draws.append(torch.cat([p.detach().flatten() for p in method.net.parameters()]))
    draws = torch.stack(draws)
    mean = torch.cat([m.flatten() for m, _ in posterior.values()])
    std = torch.cat([s.flatten() for _, s in posterior.values()])
    assert torch.allclose(draws.mean(0), mean, atol=4 * float(std.max()) / 4000**0.5)
    assert torch.allclose(draws.std(0) / std, torch.ones_like(std), atol=0.05)


@pytest.mark.parametrize("likelihood, make", [
    ("categorical", lambda task: harness.IVON(task, lr=0.1, hess_init=0.05, beta2=0.99)),
    ("bernoulli", lambda task: harness.IVON(task, lr=0.1, hess_init=0.05, beta2=0.99)),
    ("gaussian", lambda task: harness.IVON(task, lr=0.1, hess_init=0.05, beta2=0.99)),
    ("categorical", lambda task: harness.ngvi(task, "ef", lr=0.05, beta=0.1)),
], ids=["ivon-opt", "ivon-opt-bernoulli", "ivon-opt-gaussian", "NGVI"])
def test_elbo_of_every_method_agrees_with_pyros_trace_elbo(likelihood, make):
    task = small_task(likelihood)
    method = make(task)
    history = harness.fit(method, 5, harness.evaluator(task, elbo_samples=1000), eval_epochs=[5])
    ours = history.scores["elbo"][-1]
    pyro_elbo = harness.trace_elbo(task, method.posterior(), method.noise_scale, num_particles=200)
    assert ours == pytest.approx(pyro_elbo, rel=0.03)  # the KL is 10-20 % of it
