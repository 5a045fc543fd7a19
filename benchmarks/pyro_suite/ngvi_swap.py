"""pytest plugin: run Pyro's guide-training tests with every Pyro Adam-family optimizer
replaced by pyro_ngvi.NGVI() at its defaults. Load with `-p ngvi_swap`; NGVI_SWAP=0 runs
Pyro's own optimizers (the baseline)."""
import os

import pytest

import pyro.optim
import pyro.contrib.forecast.forecaster as forecaster

from pyro_ngvi import NGVI


def _ngvi(*args, **kwargs):  # whatever the test asked for: NGVI's defaults
    return NGVI()


@pytest.fixture(autouse=True)
def _swap_optimizer(request, monkeypatch):
    if os.environ.get("NGVI_SWAP", "1") == "0":
        return
    for name in ("Adam", "ClippedAdam", "DCTAdam"):
        monkeypatch.setattr(pyro.optim, name, _ngvi)
        if hasattr(request.module, name):
            monkeypatch.setattr(request.module, name, _ngvi)
    monkeypatch.setattr(forecaster, "DCTAdam", _ngvi)


@pytest.fixture(autouse=True)
def _accept_not_gaussian_warning():
    """NGVI_ACCEPT_WARNING=1: NGVI's documented warning about guide parts that get the point
    optimizer is not an error (Pyro's suite turns every warning into one)."""
    if os.environ.get("NGVI_ACCEPT_WARNING", "0") == "1":
        import warnings

        from pyro_ngvi.family import NotGaussianWarning

        warnings.filterwarnings("ignore", category=NotGaussianWarning)
