"""
An outsider's probes of NGVI beyond the usual setup (half dtypes, copies of the optimizer,
long runs, wrong arguments), each against an independent reference.
"""

import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO

N = 20


def normal_mean(dtype):
    """A Normal mean under a N(0, 1) prior, N observations of unit noise: the posterior is
    N(sum(x) / (N + 1), 1 / (N + 1)) in closed form."""
    data = (torch.randn(N) + 2.0).to(dtype)

    def model(data):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=dtype), torch.tensor(1.0, dtype=dtype)))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Normal(mu, torch.tensor(1.0, dtype=dtype)), obs=data)

    return model, data


def test_a_float16_guide_under_trace_elbo_is_refused_before_it_is_written():
    # NGVI recovered the curvature of a float16 site from its gradients and kept running moments of
    # it (one draw's h reaches 1e3-1e4, its square overflows 65504): the site's scale became NaN at
    # step 35 (seed 0; 41, 69 for seeds 1, 2), written into the guide with no warning. Refused now,
    # at the first step, naming the dtypes that work.
    model, data = normal_mean(torch.float16)
    guide = AutoNormal(model)
    guide(data)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    svi = SVI(model, guide, NGVI(), loss=Trace_ELBO())
    with pytest.raises(ValueError, match="float16.*'mu'|'mu'.*float16") as error:
        svi.step(data)
    assert "bfloat16" in str(error.value)
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v, before[k])
    # the refusal is of the recovered statistics only: exact curvature in float16 takes Newton steps
    svi = SVI(model, guide, NGVI(lr=1.0, beta=1.0), loss=CurvatureELBO("hessian", deterministic=True))
    for _ in range(5):
        svi.step(data)
    store = pyro.get_param_store()
    exact_mean = float(data.double().sum()) / (N + 1)
    assert abs(float(store["AutoNormal.locs.mu"].detach()) - exact_mean) < 4e-3
    assert abs(float(store["AutoNormal.scales.mu"].detach()) - (N + 1) ** -0.5) < 2e-3


def test_a_float16_bayesian_net_that_cannot_train_says_that_float16_is_why():
    # a float16 BayesianNet under CurvatureELBO("ef") skipped all of its first 50 steps (the
    # empirical Fisher overflows float16) and raised "check the data for NaN or inf", which are
    # finite: the message now names the dtype and what to train in instead.
    x = torch.randn(64, 3)
    y = x @ torch.tensor([1.0, -1.0, 0.5]) + 0.1 * torch.randn(64)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(torch.float16)
    bnn = BayesianNet(net, "gaussian", num_data=64, prior=1.0, noise_scale=0.1)
    svi = SVI(bnn, bnn.guide(), NGVI(), loss=CurvatureELBO("ef"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="float16") as error:
            for _ in range(60):
                svi.step(x.half(), y.half())
    assert "bfloat16" in str(error.value)
    assert bool(torch.isfinite(x).all() and torch.isfinite(y).all())  # (the data were finite all along)


def regression(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(x @ w, s), obs=y)


def _half_step_schedule(t):
    return 0.5 / (1.0 + t / 10.0)


@pytest.mark.parametrize("settings", [{}, {"lr": _half_step_schedule, "beta": 0.2, "point_optim_args": {"lr": 0.02}}])
def test_a_pickled_or_copied_optimizer_continues_the_uninterrupted_run(settings):
    # pickle.dumps(NGVI()) raised "AttributeError: Can't pickle local object
    # 'WeakIdKeyDictionary.__init__.<locals>.remove'" (before or after steps), where Pyro's own
    # optimizers pickle (a sweep's workers get the optimizer pickled). It pickles as its settings and
    # get_state(), as deepcopy copies it: the copy, stepped from the same random state, takes the
    # uninterrupted run's steps (to the ulps of the scales re-read from the guide written back).
    import copy
    import pickle

    x = torch.randn(50, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 * torch.randn(50)
    for how in (lambda o: pickle.loads(pickle.dumps(o)), copy.deepcopy):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        fresh = how(NGVI(**settings))
        assert fresh.num_steps == 0 and fresh.pt_optim_args == NGVI(**settings).pt_optim_args
        guide = AutoNormal(regression)
        optim = NGVI(**settings)
        svi = SVI(regression, guide, optim, loss=Trace_ELBO())
        for _ in range(20):
            svi.step(x, y)
        params = {k: v.detach().clone() for k, v in pyro.get_param_store()._params.items()}
        copied = how(optim)
        rng = pyro.util.get_rng_state()
        uninterrupted = [svi.step(x, y) for _ in range(15)]
        with torch.no_grad():  # the guide as it was at the copy
            for k, v in pyro.get_param_store()._params.items():
                v.copy_(params[k])
        pyro.util.set_rng_state(rng)
        svi = SVI(regression, guide, copied, loss=Trace_ELBO())
        assert [svi.step(x, y) for _ in range(15)] == pytest.approx(uninterrupted, rel=1e-5)
        assert copied.num_steps == 35 and copied.beta == optim.beta
        assert getattr(copied.lr, "__name__", None) == getattr(optim.lr, "__name__", None)


def test_pyros_lr_scheduler_with_an_lr_in_optim_args_gets_the_clear_error():
    # the natural attempt, pyro.optim.ExponentialLR({"optimizer": NGVI, "optim_args": {"lr": 0.5}, ...}),
    # raised "TypeError: NGVI.__init__() got multiple values for argument 'lr'" at the first step
    # (the scheduler builds NGVI(params, lr=0.5)); only optim_args={} got the documented message
    model, data = normal_mean(torch.float32)
    scheduler = pyro.optim.ExponentialLR({"optimizer": NGVI, "optim_args": {"lr": 0.5}, "gamma": 0.9})
    with pytest.raises(ValueError, match="not a torch optimizer.*cannot wrap it.*lambda t"):
        SVI(model, AutoNormal(model), scheduler, Trace_ELBO()).step(data)
    # what the message says to do: a callable lr runs exactly as written. With exact curvature
    # and beta = 1 the precision is exact and each step closes lr(t) of the distance to the
    # posterior mean: mu' - m = (1 - lr(t)) (mu - m)
    pyro.clear_param_store()
    guide = AutoNormal(model, init_loc_fn=lambda site: torch.tensor(-1.0))
    svi = SVI(model, guide, NGVI(lr=lambda t: 0.5 * 0.9**t, beta=1.0), CurvatureELBO("hessian", deterministic=True))
    exact, mu = float(data.double().sum()) / (N + 1), -1.0
    for t in range(8):
        svi.step(data)
        mu = exact + (1 - 0.5 * 0.9**t) * (mu - exact)
        assert abs(float(pyro.param("AutoNormal.locs.mu").detach()) - mu) < 1e-5


def test_pyros_optimizer_wrapper_as_point_optim_says_which_torch_class_to_pass():
    # NGVI(point_optim=pyro.optim.Adam) said "got <function <lambda>.<locals>.<lambda> at 0x...>"
    for given in (pyro.optim.Adam, pyro.optim.Adam({"lr": 0.1}), "Adam"):
        with pytest.raises(ValueError, match=r"point_optim.*torch\.optim\.Adam \(its arguments as point_optim_args\)"):
            NGVI(point_optim=given)


def test_save_refuses_a_file_descriptor_as_it_would_write_into_it_and_close_it(tmp_path):
    # NGVI.load refused an int filename, but save (Pyro's PyroOptim.save: open(filename, "wb")) took
    # True or 1 for file descriptor 1: it wrote the state into stdout and closed it
    import os

    optim = NGVI()
    target = tmp_path / "other.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)
    try:
        for filename in (fd, True, None, 3.5):
            with pytest.raises(ValueError, match="filename must be a path") as error:
                optim.save(filename)
            assert isinstance(error.value, TypeError)
        os.fstat(fd)  # (still open)
    finally:
        os.close(fd)
    assert target.stat().st_size == 0
    optim.save(tmp_path / "ngvi.pt")  # a path is fine, and loads back
    NGVI().load(tmp_path / "ngvi.pt")


@pytest.mark.parametrize("flag", ["warm_start", "averaging", "control_variate", "safeguard", "compile"])
def test_the_switches_are_checked_when_set_between_steps_as_the_hyperparameters_are(flag):
    # NGVI(safeguard="False") was refused, but optim.safeguard = "False" between steps was taken and
    # read as on (a non-empty string); lr, beta, ... were already checked when set
    optim = NGVI()
    before = getattr(optim, flag)
    for value in ("False", 0, None, 1.0):
        with pytest.raises(ValueError, match=f"{flag} must be True or False"):
            setattr(optim, flag, value)
        assert getattr(optim, flag) is before
    setattr(optim, flag, not before)
    assert getattr(optim, flag) is (not before)
