"""
The linearised (GLM) predictive of a Gaussian over a network's weights [1].

For a network :math:`f(x; w)` and a Gaussian :math:`q(w) = \\mathcal{N}(\\mu, \\Sigma)` the
linearised model replaces the network by its first-order expansion at the mean,

.. math:: f_{\\mathrm{lin}}(x; w) = f(x; \\mu) + J_\\mu(x)\\,(w - \\mu),
          \\qquad J_\\mu(x) = \\partial f(x; w) / \\partial w \\,|_{w = \\mu},

so that the output is Gaussian, :math:`f_{\\mathrm{lin}}(x; w) \\sim
\\mathcal{N}(f(x; \\mu), J_\\mu \\Sigma J_\\mu^\\top)`, and the predictive is the likelihood
averaged over it, :math:`p(y \\mid x) = \\mathbb{E}_{q}[p(y \\mid f_{\\mathrm{lin}}(x; w))]`.
The Gauss-Newton curvature a Laplace or NGVI posterior is fitted with is exactly the
curvature of this linear model: the Gaussian is a posterior of the linearised network,
and sampling the nonlinear network with it underfits where the network is far from
linear over the Gaussian's spread [1].

A sample needs no Jacobian: with :math:`w - \\mu = \\Sigma^{1/2}\\epsilon` the term
:math:`J_\\mu \\Sigma^{1/2}\\epsilon` is one forward-mode derivative (``torch.func.jvp``) of
the network at :math:`\\mu` in the direction :math:`\\Sigma^{1/2}\\epsilon`, one extra
forward pass per sample. For a network linear in its weights the samples are those of
the network itself, draw for draw (``tests/test_linearized.py``).

**References**

[1] `Improving predictions of Bayesian neural nets via local linearization`, Alexander
    Immer, Maciej Korzepa, Matthias Bauer (AISTATS 2021)
"""

import warnings
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call, jvp

__all__ = ["linearized_outputs"]


@torch.no_grad()
def linearized_outputs(net: nn.Module, posterior: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]],
                       x: torch.Tensor, num_samples: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """
    Outputs ``(S, B, ...)`` of the linearised network at ``num_samples`` draws
    :math:`\\epsilon \\sim \\mathcal{N}(0, I)`: :math:`f(x; \\mu) + J_\\mu(x)\\,(\\sigma \\odot \\epsilon)`
    for a mean-field ``posterior`` ``{parameter name: (mean, standard deviation)}`` (a
    standard deviation ``None`` is a point estimate; parameters it does not name keep the
    network's values). The network runs in eval mode (BatchNorm on its running statistics).

    :raises ValueError: for ``num_samples < 1``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    named = dict(net.named_parameters())
    means = {name: (posterior[name][0] if name in posterior else p.detach()) for name, p in named.items()}
    random = [name for name in named if name in posterior and posterior[name][1] is not None]
    fixed = {name: value for name, value in means.items() if name not in random}

    def output(*weights):
        return functional_call(net, {**fixed, **dict(zip(random, weights))}, (x,))

    primals = tuple(means[name] for name in random)
    training = net.training
    net.eval()
    try:
        if not random:  # a point estimate: the network at the mean, the same for every sample
            return output().unsqueeze(0).expand(num_samples, *output().shape).clone()
        outputs = []
        for _ in range(num_samples):
            tangents = tuple(posterior[name][1] * torch.randn(means[name].shape, generator=generator,
                                                              dtype=means[name].dtype)
                             for name in random)
            with warnings.catch_warnings():  # torch's first forward-mode call loads its JIT decompositions
                warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", FutureWarning)
                mean_output, change = jvp(output, primals, tangents)
            outputs.append(mean_output + change)
    finally:
        net.train(training)
    return torch.stack(outputs)
