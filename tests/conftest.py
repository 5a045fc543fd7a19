import os

import pytest
import torch

import pyro

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n K: one torch thread per worker, no oversubscription
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clean_param_store():
    """Every test starts from an empty param store, a fixed seed and Pyro's validation on
    (a test that runs a benchmark's ``main`` turns it off)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pyro.enable_validation(True)
    default = torch.get_default_dtype()
    yield
    torch.set_default_dtype(default)
    pyro.enable_validation(True)
    pyro.clear_param_store()


@pytest.fixture
def one_thread():
    """One torch thread for the test (many small kernels, which threads only slow; im2col with two
    threads on a shared two-core machine can take ~1 s a call). Autouse in a module by
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
