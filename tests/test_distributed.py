"""
NGVI on torch.distributed (gloo, loopback): ranks take identical updates, K ranks
with one sample each are one process with K samples, a failing rank does not hang
the others.

The tests share one launch of two ranks, subprocesses of this file
(``python tests/test_distributed.py RANK WORLD PORT OUT``; process start-up is most
of the cost), with bounded timeouts: the process group's, and the wait on the
processes.
"""

import os
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from functools import partial

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, NGVIWarning
from pyro_ngvi.distributed import (
    DistributedError,
    all_reduce_stats,
    get_world_size,
    is_distributed,
    seed_rank,
    shard,
)
from pyro_ngvi.family import SiteCurvature

#: one worker runs every test that launches a process group (pyproject.toml: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("distributed")

D = torch.float64
WORLD = 2
SEED = 7
STEPS = 3
WAIT = 120  # seconds the tests wait for their ranks at most (a loaded machine is slow)
GROUP_TIMEOUT = 20  # seconds, the process group's timeout (collectives included)


# ------------------------------------------------------------------ problems
def regression_problem(learn_noise=True):
    """A BayesianNet regression, float64; ``learn_noise``: the noise scale is a point estimate
    (its optimizer, like any torch optimizer, costs an import of torch._dynamo)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(
        16, generator=g, dtype=torch.float64
    )
    torch.manual_seed(0)  # the same initial network on every rank
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    bnn = BayesianNet(net, "gaussian", num_data=len(x), noise_scale=None if learn_noise else 0.3)
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=0.1)
    guide(x, y)  # set up now: its first run draws from the RNG that seed_rank seeds
    return x, y, bnn, guide


def local_model(data, index):
    """A global mean and one local latent per row, rows subsampled by ``index``."""
    mean = pyro.sample("mean", dist.Normal(0.0, 1.0))
    with pyro.plate("rows", len(data), subsample=index):
        z = pyro.sample("z", dist.Normal(mean, 1.0))
        pyro.sample("obs", dist.Normal(z, 0.5), obs=data[index])


def local_plates(data, index):
    return pyro.plate("rows", len(data), subsample=index)


def guide_state():
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


def ngvi():
    return NGVI(lr=0.5, beta=0.2, point_optim_args={"lr": 0.01})


# ------------------------------------------------------------------ scenarios (run on each rank)
def scenario_train(rank):
    """Everything the two-rank tests check, in one launch."""
    out = {}
    # (a) different shards and samples: identical guides after a few steps
    x, y, bnn, guide = regression_problem()
    seed_rank(SEED)
    svi = SVI(bnn, guide, ngvi(), CurvatureELBO("ef"))
    index = shard(len(x))
    out["shard_losses"] = [svi.step(x[index], y[index]) for _ in range(STEPS)]
    out["shard_params"] = guide_state()

    # (a) subsampled local latents, Trace_ELBO (reparam curvature, masks)
    pyro.clear_param_store()
    data = torch.linspace(-1.0, 2.0, 6, dtype=torch.float64)
    guide = AutoNormal(local_model, init_scale=0.3, create_plates=local_plates)
    seed_rank(SEED)
    svi = SVI(local_model, guide, ngvi(), Trace_ELBO())
    rows = [torch.tensor([0, 1, 2]), torch.tensor([2, 3, 4])][rank]  # row 5 never touched
    for _ in range(STEPS):
        svi.step(data, rows)
    out["local_params"] = guide_state()

    # (b) the full data on every rank, one sample each
    pyro.clear_param_store()
    x, y, bnn, guide = regression_problem()
    seed_rank(SEED)
    svi = SVI(bnn, guide, ngvi(), CurvatureELBO("ef"))
    for _ in range(STEPS):
        svi.step(x, y)
    out["sample_params"] = guide_state()

    # a NaN on one rank only: every rank skips
    pyro.clear_param_store()
    x, y, bnn, guide = regression_problem()
    optim = ngvi()
    svi = SVI(bnn, guide, optim, CurvatureELBO("ef"))
    svi.step(x, y)
    before = guide_state()
    if rank == 1:
        y = y.clone()
        y[0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi.step(x, y)
    out["skipped"] = optim.num_skipped_steps
    out["skip_warnings"] = sum(issubclass(w.category, NGVIWarning) for w in caught)
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in guide_state().items())

    # the mask rule, on the hook itself
    pyro.clear_param_store()
    touched = [torch.tensor([True, True, False, False]), torch.tensor([False, True, True, False])][rank]
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1)
    grad[0 if rank == 1 else 3] = float("nan")  # in an untouched row: never sent
    stats = {
        "z": SiteCurvature(grad, grad + 10, torch.zeros(4), torch.full((4,), 2.0), mask=touched),
        "w": SiteCurvature(torch.full((2,), float(rank)), torch.full((2,), 1.0 + rank)),
    }
    shared = pyro.param("shared", torch.zeros(3)).unconstrained()
    lonely = pyro.param("lonely", torch.zeros(2)).unconstrained()
    unused = pyro.param("unused", torch.zeros(1)).unconstrained()
    shared.grad = torch.full((3,), 1.0 + rank)
    lonely.grad = torch.full((2,), 4.0) if rank == 0 else None
    reduced = all_reduce_stats(stats, [unused, lonely, shared][:: 1 if rank == 0 else -1])
    out["mask_rule"] = {
        name: (s.grad, s.curvature, s.mask, s.prior_loc, s.prior_precision) for name, s in reduced.items()
    }
    out["point_grads"] = (shared.grad, lonely.grad, unused.grad)
    return out


def named_sites_model(names, data):
    """One scalar-mean latent site per name (shape (3,)), all observed through their sum."""
    total = 0.0
    for name in names:
        total = total + pyro.sample(name, dist.Normal(torch.zeros(3), 1.0).to_event(1)).sum()
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(total, 1.0), obs=data)


def scenario_mismatch(rank):
    """Ranks whose guides differ: every rank raises DistributedError naming the difference,
    before any update, and the process group stays usable."""
    out = {}
    data = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    cases = {
        "same_size_other_names": [["a"], ["b"]],  # summed into each other before
        "more_sites": [["a"], ["a", "b"]],  # gloo aborted on the header's size before
    }
    for case, names in cases.items():
        pyro.clear_param_store()
        model = partial(named_sites_model, names[rank])
        guide = AutoNormal(model)
        guide(data)
        before = guide_state()
        svi = SVI(model, guide, ngvi(), Trace_ELBO())
        try:
            svi.step(data)
            out[case] = None
        except DistributedError as error:
            out[case] = str(error)
        out[case + "_unchanged"] = all(torch.equal(before[k], v) for k, v in guide_state().items())
    return out


def scenario_fail(rank, out_dir):
    """Rank 1 raises after one step; rank 0 steps on and must fail, not hang."""
    pyro.clear_param_store()
    x, y, bnn, guide = regression_problem(learn_noise=False)
    svi = SVI(bnn, guide, ngvi(), CurvatureELBO("ef"))
    svi.step(x, y)
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    start = time.monotonic()
    try:
        for _ in range(5):
            svi.step(x, y)
    finally:
        torch.save({"seconds": time.monotonic() - start}, os.path.join(out_dir, "failure.pt"))


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    torch.set_default_dtype(D)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT),
    )
    try:
        assert is_distributed() and get_world_size() == world
        out = scenario_train(rank)
        out.update(scenario_mismatch(rank))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        scenario_fail(rank, out_dir)  # last: it ends the group's life
    finally:
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------ launching
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path):
    """Run the scenarios on WORLD ranks; return ``[(returncode, stderr)]`` per rank."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="error")
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(WORLD), str(port), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(WORLD)
    ]
    results = []
    try:
        for proc in procs:
            remaining = max(WAIT - (time.monotonic() - start), 1.0)
            _, stderr = proc.communicate(timeout=remaining)
            results.append((proc.returncode, stderr))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)
        pytest.fail(f"the ranks did not finish within {WAIT} s: a rank hangs")
    return results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch of two ranks (process start-up dominates): results, exit codes, stderr."""
    tmp_path = tmp_path_factory.mktemp("ranks")
    processes = launch(tmp_path)
    for rank, (_, stderr) in enumerate(processes):
        assert (tmp_path / f"rank{rank}.pt").exists(), f"rank {rank} failed:\n{stderr}"
    return tmp_path, processes


@pytest.fixture(scope="module")
def trained(launched):
    tmp_path, _ = launched
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


# ------------------------------------------------------------------ tests
def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_ranks_with_different_shards_and_samples_hold_identical_guides(trained):
    rank0, rank1 = trained
    # the ranks saw different data and samples ...
    assert all(l0 != l1 for l0, l1 in zip(rank0["shard_losses"], rank1["shard_losses"]))
    # ... and took the same updates, bit for bit (guide sites and the noise scale)
    assert_bit_identical(rank0["shard_params"], rank1["shard_params"])
    assert "noise_scale" in rank0["shard_params"]
    initial_scale = torch.full_like(rank0["shard_params"]["AutoNormal.scales.0.weight"], 0.1)
    assert not torch.allclose(rank0["shard_params"]["AutoNormal.scales.0.weight"], initial_scale)


def test_ranks_subsampling_different_rows_hold_identical_guides(trained):
    rank0, rank1 = trained
    assert_bit_identical(rank0["local_params"], rank1["local_params"])
    locs = rank0["local_params"]["AutoNormal.locs.z"]
    assert locs[5] == 0.0  # untouched by every rank: never updated
    assert (locs[:5] != 0.0).all()


def test_two_ranks_one_sample_each_equal_one_process_with_two_samples(trained):
    # the single-process reference: num_particles=2, particle k drawing what rank k drew
    # (rank k seeds seed_rank(SEED) = SEED + k and keeps its own stream across steps)
    torch.set_default_dtype(D)
    x, y, bnn, guide = regression_problem()
    streams = []
    for rank in range(WORLD):
        torch.manual_seed(SEED + rank)
        streams.append(torch.get_rng_state())
    draw = bnn._fast_path._sample_into_net
    particle = [0]

    def sample_as_rank(*args):
        k = particle[0] % WORLD
        torch.set_rng_state(streams[k])
        noises = draw(*args)
        streams[k] = torch.get_rng_state()
        particle[0] += 1
        return noises

    bnn._fast_path._sample_into_net = sample_as_rank
    svi = SVI(bnn, guide, ngvi(), CurvatureELBO("ef", num_particles=WORLD))
    for _ in range(STEPS):
        svi.step(x, y)
    reference = guide_state()
    assert particle[0] == WORLD * STEPS
    for rank in trained:
        assert rank["sample_params"].keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(rank["sample_params"][name], value, rtol=0, atol=1e-6, msg=name)


def test_a_non_finite_value_on_one_rank_skips_the_step_on_every_rank(trained):
    for rank in trained:
        assert rank["skipped"] == 1
        assert rank["skip_warnings"] == 1
        assert rank["unchanged"]


def test_touched_rows_average_over_the_ranks_that_touched_them(trained):
    rank0, rank1 = trained
    for name in ("z", "w"):
        for a, b in zip(rank0["mask_rule"][name], rank1["mask_rule"][name]):
            assert (a is None and b is None) or torch.equal(a, b)
    grad, curvature, mask, prior_loc, prior_precision = rank0["mask_rule"]["z"]
    # rank 0 touched rows 0, 1 with grads 1, 2; rank 1 rows 1, 2 with grads 4, 6
    assert torch.equal(mask, torch.tensor([True, True, True, False]))
    assert torch.equal(grad[:3], torch.tensor([1.0, 3.0, 6.0], dtype=D))
    assert torch.equal(curvature[:3], torch.tensor([11.0, 13.0, 16.0], dtype=D))
    assert torch.isfinite(grad).all()  # the NaNs in untouched rows stayed home
    assert torch.equal(prior_precision[:3], torch.full((3,), 2.0, dtype=D))
    assert torch.equal(prior_loc[:3], torch.zeros(3, dtype=D))
    grad, curvature, mask, _, _ = rank0["mask_rule"]["w"]
    assert mask is None
    assert torch.equal(grad, torch.full((2,), 0.5, dtype=D))
    assert torch.equal(curvature, torch.full((2,), 1.5, dtype=D))
    # point gradients: the mean over ranks, None counting as zero, None only if None everywhere
    for rank in trained:
        shared, lonely, unused = rank["point_grads"]
        assert torch.equal(shared, torch.full((3,), 1.5, dtype=D))
        assert torch.equal(lonely, torch.full((2,), 2.0, dtype=D))
        assert unused is None


def test_a_failing_rank_makes_the_others_fail_without_hanging(launched):
    tmp_path, [(code0, stderr0), (code1, stderr1)] = launched
    assert code1 != 0 and "rank 1 failed on purpose" in stderr1
    assert code0 != 0
    assert "DistributedError" in stderr0 and "another rank has failed" in stderr0, stderr0
    assert torch.load(tmp_path / "failure.pt")["seconds"] < GROUP_TIMEOUT + 5


def test_ranks_with_different_sites_raise_on_every_rank_naming_them(trained):
    for rank, result in enumerate(trained):
        # the same number of elements under other names: no longer averaged into each other
        message = result["same_size_other_names"]
        assert message is not None, f"rank {rank} averaged site 'a' with site 'b'"
        assert "rank 0 has site 'AutoNormal.locs.a' (3,) torch.float64" in message, message
        assert "rank 1 has site 'AutoNormal.locs.b' (3,) torch.float64" in message, message
        # a different number of sites: a named error, not gloo's size mismatch
        message = result["more_sites"]
        assert message is not None and "rank 0 lacks site 'AutoNormal.locs.b'" in message, message
        assert "another rank has failed" not in message
        assert result["same_size_other_names_unchanged"] and result["more_sites_unchanged"]


def test_single_process_is_untouched():
    assert not is_distributed()
    stats = {"a": SiteCurvature(torch.ones(2), torch.ones(2))}
    assert all_reduce_stats(stats, []) is stats
    assert torch.equal(shard(5), torch.arange(5))


@pytest.mark.parametrize("bad", [2.5, -1, 0, True, None, "5"])
def test_shard_refuses_what_is_not_a_whole_number_of_examples(bad):
    """shard(2.5) returned float indices, tensor([0., 1.]); shard(-1) raised torch's RuntimeError,
    shard(None) a TypeError; shard(0) gave every rank an empty shard."""
    with pytest.raises(ValueError, match="num_examples must be a whole number"):
        shard(bad)
    assert torch.equal(shard(7), torch.arange(7))  # one process: every example


@pytest.mark.parametrize("bad", [0.5, -1, 2**32, True, None, "3"])
def test_seed_rank_refuses_what_is_not_a_whole_seed(bad):
    """seed_rank(0.5) seeded 0 silently (int(0.5)); seed_rank("3") seeded 3; -1 raised Pyro's message."""
    with pytest.raises(ValueError, match="seed must be a whole number"):
        seed_rank(bad)
    assert seed_rank(3) == 3
    mine = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(mine, torch.rand(3))


if __name__ == "__main__":
    rank, world, port, out_dir = sys.argv[1:]
    _worker(int(rank), int(world), int(port), out_dir)
