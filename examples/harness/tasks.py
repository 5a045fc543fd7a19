"""The tasks the examples and benchmarks run on: scikit-learn data sets and the networks fitted to them."""

from typing import Callable

from torch import nn

from .task import Task, make_split


def mlp(*widths: int) -> nn.Sequential:
    """A ReLU MLP with layer widths ``widths``: ``mlp(64, 100, 10)`` is Linear(64, 100), ReLU, Linear(100, 10)."""
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def sklearn_task(name: str, load: Callable, likelihood: str, widths, seed: int = 0, test_size: float = 0.2,
                 validation_size: float = 0.0, prior_scale: float = 1.0, batch_size: int = 128) -> Task:
    """A scikit-learn data set, ``load(return_X_y=True)``, split by :func:`make_split`, and ``mlp(*widths)``."""
    split = make_split(*load(return_X_y=True), likelihood, test_size, validation_size, seed)
    return Task(name, split, lambda: mlp(*widths), likelihood, prior_scale, batch_size, seed)


def digits_mlp(seed: int = 0, test_size: float = 0.3, hidden: int = 100, **options) -> Task:
    """scikit-learn's 8x8 digits (1,797 images, 10 classes), stratified split; MLP 64-hidden-10."""
    from sklearn.datasets import load_digits

    return sklearn_task("digits", load_digits, "categorical", (64, hidden, 10), seed, test_size, **options)


def diabetes_mlp(seed: int = 0, test_size: float = 0.2, hidden: int = 50, batch_size: int = 32, **options) -> Task:
    """scikit-learn's diabetes regression (442 patients, 10 features), target standardised; MLP 10-hidden-1."""
    from sklearn.datasets import load_diabetes

    return sklearn_task("diabetes", load_diabetes, "gaussian", (10, hidden, 1), seed, test_size,
                        batch_size=batch_size, **options)
