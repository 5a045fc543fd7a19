import pytest
import torch

import pyro


@pytest.fixture(autouse=True)
def _clean_param_store():
    """Every test starts from an empty param store and a fixed seed."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    default = torch.get_default_dtype()
    yield
    torch.set_default_dtype(default)
    pyro.clear_param_store()
