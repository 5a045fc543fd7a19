"""
Diagonal curvature of an ``nn.Embedding`` table from its sparse per-example gradients.

An embedding maps example :math:`n`'s indices :math:`x_{nl}` to the rows
:math:`W_{x_{nl}}` of its table, so example :math:`n`'s gradient (or Jacobian column
:math:`v`) in row :math:`s` is the sum of its output gradients at the positions that
look row :math:`s` up:

.. math:: \\nabla_{W_s} \\ell_n = \\sum_l [x_{nl} = s]\\, \\delta_{nl},
   \\qquad \\mathrm{diag}_s = \\sum_v \\sum_n \\Big(\\sum_l [x_{nl} = s]\\, M_{vnl}\\Big)^2,

with :math:`\\delta_{nl} = \\partial \\ell_n / \\partial e_{nl}` for ``ef`` and
:math:`M` BackPACK's square root of the output GGN for ``ggn`` / ``ggn_mc``. The
rows an example touches are summed before squaring (an index repeated within one
example counts once, with the summed gradient), then the squares are added into
the table: :math:`O(V B L h)` memory for :math:`V` columns, where BackPACK's own
rule forms the dense per-example gradients of the whole table (:math:`O(V B S h)`
for :math:`S` rows) and builds its indicator in the default dtype, which fails on
a float64 network.
"""

import torch
from torch import Tensor, nn

from backpack.core.derivatives.embedding import EmbeddingDerivatives
from backpack.extensions import SumGradSquared
from backpack.extensions.module_extension import ModuleExtension
from backpack.extensions.secondorder.diag_ggn import DiagGGN
from backpack.extensions.secondorder.diag_ggn.diag_ggn_base import DiagGGNBaseModule


def squared_row_sums(indices: Tensor, columns: Tensor, num_rows: int) -> Tensor:
    """
    :math:`D_s = \\sum_v \\sum_n (\\sum_l [x_{nl} = s] M_{vnl})^2`, shape ``(num_rows, h)``.

    :param torch.Tensor indices: :math:`x`, integer, shape ``(B, ...)``.
    :param torch.Tensor columns: :math:`M`, shape ``(V, B, ..., h)``.
    :param int num_rows: :math:`S`, the table's rows.
    """
    example = torch.arange(indices.shape[0], device=indices.device).view(-1, *[1] * (indices.dim() - 1))
    pairs, pair_of = torch.unique((example * num_rows + indices.long()).reshape(-1), return_inverse=True)
    v, h = columns.shape[0], columns.shape[-1]
    per_pair = columns.new_zeros(v, len(pairs), h).index_add_(1, pair_of, columns.reshape(v, -1, h))
    return columns.new_zeros(num_rows, h).index_add_(0, pairs % num_rows, per_pair.square().sum(0))


def _check_embedding(module: nn.Embedding) -> None:
    """:raises NotImplementedError: for the options whose gradient is not the plain row look-up's."""
    options = {"padding_idx": module.padding_idx, "max_norm": module.max_norm,
               "scale_grad_by_freq": module.scale_grad_by_freq or None, "sparse": module.sparse or None}
    used = [name for name, value in options.items() if value is not None]
    if used:
        raise NotImplementedError(
            f"{module!r}: the curvature of an nn.Embedding is computed for the plain row look-up only "
            f"(padding_idx=None, max_norm=None, scale_grad_by_freq=False, sparse=False); got {', '.join(used)}")


class EmbeddingSumGradSquared(ModuleExtension):
    """``SumGradSquared``'s rule for ``nn.Embedding``: :func:`squared_row_sums` of the output gradients."""

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, backproped):
        _check_embedding(module)
        return squared_row_sums(module.input0, g_out[0].unsqueeze(0), module.num_embeddings)


class EmbeddingDiagGGN(DiagGGNBaseModule):
    """The diagonal-GGN extensions' rule for ``nn.Embedding``: :func:`squared_row_sums` of
    the backpropagated square root."""

    def __init__(self):
        super().__init__(EmbeddingDerivatives(), params=["weight"], sum_batch=True)

    def weight(self, ext, module, g_inp, g_out, backproped):
        _check_embedding(module)
        return squared_row_sums(module.input0, backproped, module.num_embeddings)


def sparse_embedding_rule(extension):
    """Give ``SumGradSquared`` or a diagonal-GGN extension (``DiagGGNExact``, ``DiagGGNMC``,
    the empirical Fisher by backprop) the sparse rule for ``nn.Embedding``; returns it."""
    if isinstance(extension, SumGradSquared):
        extension.set_module_extension(nn.Embedding, EmbeddingSumGradSquared(), overwrite=True)
    elif isinstance(extension, DiagGGN):
        extension.set_module_extension(nn.Embedding, EmbeddingDiagGGN(), overwrite=True)
    return extension
