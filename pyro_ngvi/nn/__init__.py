"""
Bayesian neural networks: :class:`BayesianNet` (:mod:`.model`, the Pyro model),
with its pieces

- :mod:`.weights`: which of the network's tensors are latent, point-estimated, fan-ins;
- :mod:`.priors`: the prior specification and the learned prior scales;
- :mod:`.noise_limit`: the noise limit (``max_scale``, the precision floor) and the
  statistics hints;
- :mod:`.guide`: the recipe's guide (``guide()``, ``init_loc_fn``) and the layers of a
  Kronecker guide;
- :mod:`.checks`: validation of its inputs;
- :mod:`.selection`: for users who hold a validation split, the prior scale and the
  training length chosen by the validation NLL (:func:`select_by_validation`);

and its BackPACK fast path: :mod:`.fast_path` (sampling into the net, one step),
:mod:`.twin` (the BackPACK-extended network), :mod:`.kronecker_step` (Kronecker
factors) and :mod:`.value` (the ELBO value).
"""

from .model import BayesianNet
from .selection import ValidationSelection, select_by_validation

__all__ = ["BayesianNet", "ValidationSelection", "select_by_validation"]
