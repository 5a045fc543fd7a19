"""BatchNorm and convnets in a BayesianNet: every curvature source against brute-force
per-example references (torch.func), the traced path against the fast path, and a
CNN trained on 8x8 digits."""

import copy

import pytest
import torch
from torch import nn
from torch.distributions import Categorical, biject_to
from torch.func import functional_call, grad, jacrev, vmap

import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal, init_to_sample

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO
from pyro_ngvi.curvature.batch_norm import frozen_batch_statistics, uses_batch_statistics
from pyro_ngvi.family import pop_curvature

N, B, CLASSES = 40, 6, 3


def tiny_cnn(batch_norm=True, pool=nn.MaxPool2d, dtype=torch.float64):
    torch.manual_seed(0)
    layers = [nn.Conv2d(1, 3, 3, padding=1)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(3))
    layers += [nn.ReLU(), pool(2), nn.Flatten(), nn.Linear(3 * 4 * 4, CLASSES)]
    return nn.Sequential(*layers).to(dtype)


def tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, CLASSES)).double()


def data(net, seed=1):
    generator = torch.Generator().manual_seed(seed)
    shape = (B, 1, 8, 8) if isinstance(net[0], nn.Conv2d) else (B, 5)
    dtype = net[0].weight.dtype
    return (torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype),
            torch.randint(0, CLASSES, (B,), generator=generator))


def make_guide(bnn, x, y, seed=2):
    """An AutoNormal with random locs and scales, already set up."""
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn)
    guide(x, y)
    generator = torch.Generator().manual_seed(seed)
    store = pyro.get_param_store()
    with torch.no_grad():
        for site in bnn.latent_sites:
            loc = store._params[f"AutoNormal.locs.{site}"]
            loc.add_(0.2 * torch.randn(loc.shape, generator=generator, dtype=loc.dtype))
            raw = store._params[f"AutoNormal.scales.{site}"]
            constraint = store._constraints[f"AutoNormal.scales.{site}"]
            scale = 0.05 + 0.2 * torch.rand(raw.shape, generator=generator, dtype=raw.dtype)
            raw.copy_(biject_to(constraint).inv(scale))
    return guide


def frozen_copy(net, params, x):
    """A copy of ``net`` whose BatchNorm layers in train mode normalise with the batch
    statistics of ``x`` at ``params``, held as constants (eval mode, running statistics
    set to the batch's mean and biased variance): per-example separable."""
    frozen = copy.deepcopy(net)
    inputs = {}
    hooks = [m.register_forward_hook(lambda m, i, o: inputs.__setitem__(m, i[0].detach()))
             for m in frozen.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    with torch.no_grad():
        functional_call(frozen, params, (x,))
    for hook in hooks:
        hook.remove()
    for module, z in inputs.items():
        dims = [d for d in range(z.dim()) if d != 1]
        module.running_mean.copy_(z.mean(dims))
        module.running_var.copy_(z.var(dims, unbiased=False))
    return frozen.eval()


def references(net, x, y, weights):
    """At ``weights`` (the latent sites): the exact gradient of N/B * NLL of the net as it
    runs (train-mode BatchNorm through the batch statistics), and the empirical Fisher and
    GGN of the frozen-statistics net, by torch.func (per-example vmap, full Jacobian)."""
    scale = N / B

    def nll(module, params, x, y):
        return -Categorical(logits=functional_call(module, params, (x,))).log_prob(y).sum()

    as_run = copy.deepcopy(net)  # its running statistics may move: not the test's net
    leaves = {k: w.detach().requires_grad_() for k, w in weights.items()}
    grads = torch.autograd.grad(nll(as_run, leaves, x, y), list(leaves.values()))
    gradient = {k: scale * g for k, g in zip(leaves, grads)}
    frozen = frozen_copy(net, weights, x)
    per_example = vmap(grad(lambda p, xi, yi: nll(frozen, p, xi, yi)), in_dims=(None, 0, 0))(
        weights, x.unsqueeze(1), y.unsqueeze(1))
    ef = {k: scale * v.square().sum(0) for k, v in per_example.items()}

    names, shapes = list(weights), [w.shape for w in weights.values()]
    sizes = [w.numel() for w in weights.values()]

    def output(theta):
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(theta, sizes), shapes)}
        return functional_call(frozen, params, (x,))

    theta = torch.cat([w.reshape(-1) for w in weights.values()])
    jac = jacrev(output)(theta)
    p = output(theta).softmax(-1)
    hessian = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    diag = scale * torch.einsum("bkp,bkl,blp->p", jac, hessian, jac)
    ggn = {n: t.reshape(s) for n, t, s in zip(names, torch.split(diag, sizes), shapes)}
    return gradient, ef, ggn


def guide_loc_scale(bnn):
    store = pyro.get_param_store()
    return {s: (store[f"AutoNormal.locs.{s}"].detach(), store[f"AutoNormal.scales.{s}"].detach())
            for s in bnn.latent_sites}


def pop_all(bnn):
    store = pyro.get_param_store()
    return {s: pop_curvature(store._params[f"AutoNormal.locs.{s}"]) for s in bnn.latent_sites}


NETS = {
    "mlp_batch_norm": tiny_mlp,
    "cnn_batch_norm": tiny_cnn,
    # float32: BackPACK's AvgPool2d Jacobian builds its kernel in float32 (fails in float64)
    "cnn_avg_pool": lambda: tiny_cnn(pool=nn.AvgPool2d, dtype=torch.float32),
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("source", ["ef", "ggn", "reparam"])
@pytest.mark.parametrize("net", list(NETS))
def test_fast_path_matches_per_example_references(net, source, mode):
    net = NETS[net]()
    net.train(mode == "train")
    bnn = BayesianNet(net, "categorical", num_data=N, prior=1.0)
    x, y = data(net)
    guide = make_guide(bnn, x, y)
    running = [b.clone() for b in net.buffers()]
    torch.manual_seed(7)
    bnn.curvature_step(guide, x, y, source)
    stats = pop_all(bnn)
    torch.manual_seed(7)
    loc_scale = guide_loc_scale(bnn)
    noises = {s: torch.randn_like(loc) for s, (loc, _) in loc_scale.items()}
    weights = {s: loc + scale * noises[s] for s, (loc, scale) in loc_scale.items()}
    for b, old in zip(net.buffers(), running):  # the references start from the same statistics
        b.copy_(old)
    gradient, ef, ggn = references(net, x, y, weights)
    expected = {site: {"ef": ef[site], "ggn": ggn[site],
                       "reparam": gradient[site] * noises[site] / loc_scale[site][1]}[source]
                for site in bnn.latent_sites}
    for actual, reference in (({s: stats[s].grad for s in stats}, gradient),
                              ({s: stats[s].curvature for s in stats}, expected)):
        # float32 (AvgPool): to single precision of the largest element of any site
        largest = max(t.abs().max().item() for t in reference.values())
        double = x.dtype == torch.float64
        for site in bnn.latent_sites:
            torch.testing.assert_close(actual[site], reference[site], rtol=1e-10 if double else 1e-4,
                                       atol=1e-12 if double else 1e-5 * largest)


@pytest.mark.parametrize("net", ["mlp_batch_norm", "cnn_batch_norm"])
def test_ggn_mc_is_unbiased_for_the_frozen_ggn(net):
    net = NETS[net]()
    bnn = BayesianNet(net, "categorical", num_data=N, prior=1.0)
    x, y = data(net)
    guide = make_guide(bnn, x, y)
    running = [b.clone() for b in net.buffers()]
    torch.manual_seed(5)
    bnn.curvature_step(guide, x, y, "ggn_mc", deterministic=True, mc_samples=3000)
    stats = pop_all(bnn)
    for b, old in zip(net.buffers(), running):
        b.copy_(old)
    means = {s: loc for s, (loc, _) in guide_loc_scale(bnn).items()}
    _, _, ggn = references(net, x, y, means)
    for site in bnn.latent_sites:
        # relative MC error ~ 1/sqrt(3000) per entry; a factor-2 error would fail
        atol = 1e-3 * ggn[site].abs().max().item()
        torch.testing.assert_close(stats[site].curvature, ggn[site], rtol=0.2, atol=atol)


@pytest.mark.parametrize("source", ["ef", "ggn"])
@pytest.mark.parametrize("net", ["mlp_batch_norm", "cnn_batch_norm"])
def test_traced_path_agrees_with_the_fast_path(net, source):
    make_net = NETS[net]
    results = {}
    for path in ("fast", "traced"):
        pyro.clear_param_store()
        bnn = BayesianNet(make_net(), "categorical", num_data=N, prior=1.0)
        x, y = data(bnn.net)
        guide = make_guide(bnn, x, y)
        model = bnn if path == "fast" else (lambda x, y: bnn(x, y))  # no fast path offered
        torch.manual_seed(3)
        CurvatureELBO(source).loss_and_grads(model, guide, x, y)
        results[path] = pop_all(bnn), [b.clone() for b in bnn.net.buffers()]
    (fast, fast_buffers), (traced, traced_buffers) = results["fast"], results["traced"]
    for site in fast:
        torch.testing.assert_close(traced[site].grad, fast[site].grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(traced[site].curvature, fast[site].curvature, rtol=1e-10, atol=1e-12)
    # the running statistics moved once per step on both paths (the traced rerun leaves
    # them alone): once for the guide's set-up, once for the step
    for a, b in zip(fast_buffers, traced_buffers):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    assert int(fast_buffers[-1]) == 2


def load_digits_split():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=generator)
    return x[order[:1200]], y[order[:1200]], x[order[1200:]], y[order[1200:]]


@pytest.mark.parametrize("source", ["ef", "ggn", "ggn_mc", "reparam"])
def test_a_batch_norm_cnn_learns_digits_with_every_source(source, one_thread):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    x_train, y_train, x_test, y_test = load_digits_split()
    bnn = BayesianNet(net, "categorical", num_data=len(x_train), prior=1.0)
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=0.02)
    svi = SVI(bnn, guide, NGVI(lr=0.1, beta=0.05, point_optim_args={"lr": 0.01}), CurvatureELBO(source))
    generator = torch.Generator().manual_seed(1)
    for epoch in range(10):
        for batch in torch.randperm(len(x_train), generator=generator).split(100):
            svi.step(x_train[batch], y_train[batch])
    net.eval()
    with torch.no_grad():
        store = pyro.get_param_store()
        for site in bnn.latent_sites:  # predict at the mean
            net.get_parameter(site).copy_(store[f"AutoNormal.locs.{site}"])
        for name in ("1.weight", "1.bias"):
            net.get_parameter(name).copy_(store[name])
        accuracy = (net(x_test).argmax(-1) == y_test).float().mean().item()
    # 0.88 - 0.95 (at chance: 0.1); the sampled reparam curvature at this lr moves with rounding:
    # 0.69 - 0.95 over seeds 0-4 (with float32 or float64 softplus scales alike)
    assert accuracy > (0.6 if source == "reparam" else 0.85)


# --------------------------------------------------------------------------- the traced path


def test_traced_pyro_module_with_batch_norm_gets_the_frozen_curvature():
    from pyro.nn import PyroModule, PyroSample

    torch.set_default_dtype(torch.float64)  # the priors' tensors (conftest restores it)

    class Net(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc1 = PyroModule[nn.Linear](5, 4)
            self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([4, 5]).to_event(2))
            self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([4]).to_event(1))
            self.bn = nn.BatchNorm1d(4)  # a plain module: its parameters stay fixed
            self.fc2 = PyroModule[nn.Linear](4, CLASSES)
            self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES, 4]).to_event(2))
            self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES]).to_event(1))

        def forward(self, x, y=None):
            logits = self.fc2(torch.tanh(self.bn(self.fc1(x))))
            with pyro.plate("data", N, subsample=torch.arange(len(x))):
                pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    model = Net().double()
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-0.5, 0.5)
    x, y = data(tiny_mlp())
    pyro.set_rng_seed(4)
    guide = AutoNormal(model, init_loc_fn=init_to_sample, init_scale=0.1)  # not all-zero weights
    guide(x, y)
    plain = tiny_mlp()  # the same architecture with the guide's means and the model's BatchNorm
    plain[1].load_state_dict(model.bn.state_dict())
    store = pyro.get_param_store()
    names = {"0.weight": "fc1.weight", "0.bias": "fc1.bias", "3.weight": "fc2.weight", "3.bias": "fc2.bias"}
    means = {k: store[f"AutoNormal.locs.{v}"].detach() for k, v in names.items()}
    gradient, ef, ggn = references(plain, x, y, means)
    for source, reference in (("ef", ef), ("ggn", ggn)):
        CurvatureELBO(source, deterministic=True).loss_and_grads(model, guide, x, y)
        for key, site in names.items():
            stats = pop_curvature(store._params[f"AutoNormal.locs.{site}"])
            torch.testing.assert_close(stats.grad, gradient[key], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(stats.curvature, reference[key], rtol=1e-10, atol=1e-12)


def test_frozen_batch_statistics_keeps_values_and_buffers_and_drops_the_statistics_paths():
    for momentum in (0.1, None):  # None: a cumulative average that reads num_batches_tracked
        torch.manual_seed(0)
        bn = nn.BatchNorm1d(3, momentum=momentum).double()
        x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
        buffers = [b.clone() for b in bn.buffers()]
        with frozen_batch_statistics():
            frozen = bn(x)
        for a, b in zip(bn.buffers(), buffers):
            assert torch.equal(a, b)  # running statistics and the batch count untouched
        coupled = bn(x)
        assert int(bn.num_batches_tracked) == 1
        torch.testing.assert_close(frozen, coupled, rtol=1e-12, atol=1e-14)
        # the frozen layer is element-wise: d out_i / d x_j = 0 for i != j
        jac = torch.autograd.functional.jacobian(lambda z: _frozen_forward(bn, z), x.detach())
        same = torch.eye(6, dtype=torch.bool)[:, None, :, None] & torch.eye(3, dtype=torch.bool)[None, :, None, :]
        assert jac[~same].abs().max() == 0
        z = x.detach()
        slope = bn.weight.detach() / (z.var(0, unbiased=False) + bn.eps).sqrt()
        torch.testing.assert_close(jac[same].reshape(6, 3), slope.expand(6, 3), rtol=1e-12, atol=0)
        assert uses_batch_statistics([coupled]) and not uses_batch_statistics([frozen])
    bn.eval()
    assert not uses_batch_statistics([bn(x)])


def _frozen_forward(bn, z):
    with frozen_batch_statistics():
        return bn(z)


def test_batch_statistics_that_cannot_be_frozen_are_refused():
    torch.set_default_dtype(torch.float64)
    x, y = data(tiny_mlp())

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([CLASSES, 5]).to_event(2))
        z = torch.batch_norm(x @ w.T, None, None, None, None, True, 0.1, 1e-5, False)
        with pyro.plate("data", N, subsample=torch.arange(len(x))):
            pyro.sample("obs", dist.Categorical(logits=z), obs=y)

    guide = AutoNormal(model, init_loc_fn=init_to_sample)
    guide(x, y)
    with pytest.raises(NotImplementedError, match="torch.batch_norm called directly"):
        CurvatureELBO("ggn").loss_and_grads(model, guide, x, y)
    CurvatureELBO("hessian").loss_and_grads(model, guide, x, y)  # exact, through the statistics
