"""What a step plans once and reuses while the structure stands (issue 24: the fixed Python cost of
a small network's step), and what makes it plan anew: the closed-form MLP plan of the fast path
(mlp.planned), the optimizer plan's stored tensors (Plan.stored), the hints of every site at once
(BayesianNet._sites_hints), and the identity check behind them (hot_path.same). Each is compared
with what is made afresh: plan(net), the param store's own entries, statistics_hints per site."""

import pytest
import torch
from torch import nn

import pyro
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO
from pyro_ngvi.curvature import mlp
from pyro_ngvi.curvature.backpack import network_curvature
from pyro_ngvi.groups import Group, flat
from pyro_ngvi.hot_path import same


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(11, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (11,), generator=g)


def _curvature(net, plans):
    x, y = _batch()
    return network_curvature(net, nn.CrossEntropyLoss(reduction="sum"), x, y, "ggn", plans=plans)


def _assert_same_curvature(net, kept):
    """The kept plan's ggn is the one of a plan made afresh (plans=None), to the bit."""
    ours, fresh = _curvature(net, kept), _curvature(net, None)
    assert torch.equal(ours.loss, fresh.loss)
    for a, b in zip(ours.grads + ours.curvatures, fresh.grads + fresh.curvatures):
        assert torch.equal(a, b)


def _assert_plan_is_fresh(net, kept):
    found, fresh = mlp.planned(net, kept), mlp.plan(net)
    if fresh is None:
        assert found is None
    else:
        assert found.layers == fresh.layers and same(found.params, fresh.params)


def test_the_mlp_plan_is_made_once_and_made_anew_when_the_net_changes():
    net, kept = _net(), {}
    first = mlp.planned(net, kept)
    assert first is not None and mlp.planned(net, kept) is first  # reused: nothing changed
    _assert_same_curvature(net, kept)
    changes = [
        lambda: setattr(net[0], "weight", nn.Parameter(torch.randn(7, 5, dtype=torch.float64))),  # a weight replaced
        lambda: net.__setitem__(2, nn.Linear(7, 3).double()),  # a layer replaced
        lambda: net[0].register_forward_hook(lambda m, i, o: None),  # a foreign hook: no plan
        lambda: net[0]._forward_hooks.clear(),  # ... removed: a plan again
        lambda: net[2].bias.requires_grad_(False),  # a frozen parameter: no plan
        lambda: net[2].bias.requires_grad_(True),
        lambda: net.append(nn.ReLU()),  # a layer added
    ]
    for change in changes:
        before = mlp.planned(net, kept)
        change()
        _assert_plan_is_fresh(net, kept)
        after = mlp.planned(net, kept)
        assert after is None or after is not before
        if after is not None:
            _assert_same_curvature(net, kept)
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)  # a global hook
    try:
        assert mlp.planned(net, kept) is None and mlp.plan(net) is None
    finally:
        handle.remove()
    assert mlp.planned(net, kept) is not None


def _recipe(source="ggn", seed=0):
    pyro.clear_param_store()
    torch.manual_seed(seed)
    bnn = BayesianNet(_net(seed), "categorical", num_data=50, noise_limit=1.0)
    guide = AutoNormal(bnn)
    return bnn, guide, SVI(bnn, guide, NGVI(), CurvatureELBO(source))


@pytest.mark.parametrize("source", ["ggn", "reparam"])
def test_the_fast_path_keeps_its_plan_between_steps(source):
    bnn, guide, svi = _recipe(source)
    x, y = _batch()
    svi.step(x, y)
    net = bnn.net if source == "reparam" else bnn._fast_path.twin  # (reparam: a plain backward on the net)
    plan = bnn._fast_path._plans[id(net)][1]
    svi.step(x, y)
    assert bnn._fast_path._plans[id(net)][1] is plan


def test_the_optimizer_plan_holds_while_the_store_holds_its_tensors():
    bnn, guide, svi = _recipe()
    x, y = _batch()
    svi.step(x, y)
    (plan,) = svi.optim._plans.values()
    store = pyro.get_param_store()
    assert plan.sites and all(store._params[site.scale_name] is site.raw_scale for site in plan.sites)
    assert plan.stored(store._params)
    name = plan.sites[0].scale_name
    replaced = store._params[name]
    store._params[name] = replaced.detach().clone().requires_grad_()  # a param replaced under its name
    assert not plan.stored(store._params)
    store._params[name] = replaced
    assert plan.stored(store._params)
    pyro.clear_param_store()
    assert not plan.stored(pyro.get_param_store()._params)


@pytest.mark.parametrize("deterministic", [False, True])
def test_every_sites_hints_at_once_are_each_sites_hints(deterministic):
    bnn, _, _ = _recipe()
    hints = bnn._sites_hints(deterministic)
    assert len(hints) == len(bnn.latent_sites)
    for site, hint in zip(bnn.latent_sites, hints):
        expected = bnn.statistics_hints(site, deterministic)
        assert hint.keys() == expected.keys() and hint["num_data"] == expected["num_data"] == 50
        if expected["min_precision"] is None:
            assert deterministic and hint["min_precision"] is None
        else:
            assert torch.equal(hint["min_precision"], expected["min_precision"])


def test_same_is_identity_not_equality():
    a, b = torch.ones(3), torch.ones(3)
    assert same([a, b, None], [a, b, None]) and not same([a, b], [a, b.clone()])  # (no elementwise ==)
    assert not same([a], [a, b]) and same([], [])


def test_a_groups_kept_flats_and_pieces_are_made_anew_when_their_tensors_change():
    """Group.flat_of keeps one tensor's flat view too (making it is an operation a step), and
    Group.pieces the sites' pieces of the group's own buffers: kept while the tensor is the same and
    unwritten, or the buffer the group's own; each compared with flat() / split_with_sizes afresh."""
    bnn, guide, svi = _recipe()
    x, y = _batch()
    svi.step(x, y)
    (plan,) = svi.optim._plans.values()
    (group,) = [g for gs in plan.groups.values() for g in gs]
    assert len(group.sites) == 4
    one = Group.of(group.sites[:1])
    prior = torch.full((1,), 2.0, dtype=torch.float64).expand(7, 5)  # a number broadcast: a strided view
    kept = one.flat_of("prior", [prior])
    assert one.flat_of("prior", [prior]) is kept and torch.equal(kept, flat([prior]))
    other = torch.full((1,), 3.0, dtype=torch.float64).expand(7, 5)  # another tensor under the name
    assert torch.equal(one.flat_of("prior", [other]), flat([other])) and float(kept[0]) == 2.0
    strided = torch.arange(35.0, dtype=torch.float64).reshape(5, 7).t()  # its flat form is a copy
    before = one.flat_of("strided", [strided])
    strided.add_(1.0)  # written in place: made anew
    after = one.flat_of("strided", [strided])
    assert torch.equal(after, flat([strided])) and torch.equal(after, before + 1.0)

    buffer = group.owned("mean")
    pieces = group.pieces("mean", buffer)
    assert group.pieces("mean", buffer) is pieces
    assert all(torch.equal(a, b) for a, b in zip(pieces, buffer.split_with_sizes(group.sizes)))
    fresh = torch.randn(group.numel, dtype=buffer.dtype)  # not the group's buffer: split anew
    split = group.pieces("mean", fresh)
    assert split is not pieces and all(a.data_ptr() == b.data_ptr() and torch.equal(a, b)
                                       for a, b in zip(split, fresh.split_with_sizes(group.sizes)))
