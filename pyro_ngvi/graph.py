"""
A walk over an autograd graph: the backward nodes that tensors were computed through,
each once (what :mod:`~pyro_ngvi.guide_trace` follows to a site's params and
:mod:`~pyro_ngvi.curvature.batch_norm` to a ``batch_norm`` in training mode).
"""

from typing import Collection, Iterable, Iterator

import torch


def graph_nodes(tensors: Iterable, stop: Collection = ()) -> Iterator:
    """The autograd nodes the tensors among ``tensors`` were computed through, depth first,
    each once, not looking behind the nodes in ``stop`` (nor yielding them)."""
    stack = [t.grad_fn for t in tensors if torch.is_tensor(t) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)
