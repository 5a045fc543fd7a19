"""
Data-parallel and Monte-Carlo-sample-parallel NGVI (VOGN) on scikit-learn's digits.

A Bayesian MLP 64-100-10 (prior N(0, 1), ``BayesianNet`` + ``AutoNormal``) trained
with ``NGVI`` and ``CurvatureELBO("ef")`` on K processes: every epoch one
permutation of the training set, common to all ranks, is split into global
batches of ``--batch-size`` examples; rank r takes every K-th example of each
(a shard of B/K), draws its own weight sample (``pyro_ngvi.distributed.seed_rank``)
and NGVI averages the ranks' gradients and curvatures before every update, so
all ranks hold the same guide. Each step thus sees the global batch and K weight
samples, each sample on B/K of the examples, at the cost of a step on B/K
examples per process. (Giving every rank the whole batch instead makes K
processes take the steps one process takes with ``num_particles=K``.)

Only rank 0 prints and writes into ``--out``: ``summary.json`` (per-epoch ELBO and
wall time, final ELBO and test metrics) and ``guide.pt`` (Pyro's param store).

Usage::

    torchrun --nproc_per_node=2 examples/distributed_bnn.py [--epochs 20] [--quick]
    python examples/distributed_bnn.py [--quick]           # one process, no torchrun

``--device cuda`` runs rank r on GPU ``LOCAL_RANK`` with the nccl backend;
otherwise gloo on CPU.
"""

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import pyro
from pyro.infer import SVI, Predictive, Trace_ELBO

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO  # noqa: E402
from pyro_ngvi.distributed import get_rank, get_world_size, seed_rank, shard  # noqa: E402

NAME = "distributed_bnn"


def start_process_group(device: str, timeout: float) -> bool:
    """
    Join the group ``torchrun`` describes in the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``): nccl for ``cuda``, gloo for ``cpu``.
    :returns: whether this call initialised it (and so should destroy it).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout))
    return True


def rank_batches(num_data: int, global_batch: int, epoch: int, seed: int):
    """This rank's part of each global batch of one epoch (a permutation common to all ranks)."""
    world = get_world_size()
    if global_batch % world:
        raise ValueError(f"--batch-size {global_batch} is not divisible by the {world} processes")
    generator = torch.Generator().manual_seed(seed * 10_000 + epoch)
    permutation = torch.randperm(num_data, generator=generator)
    return permutation[shard(num_data)].split(global_batch // world)


def average_over_ranks(value: float, device: torch.device) -> float:
    if get_world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=device)  # nccl: on the GPU
    dist.all_reduce(total)
    return float(total) / get_world_size()


def main(argv=None):
    parser = harness.make_parser(NAME, __doc__.strip().splitlines()[0], epochs=20)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split across ranks")
    parser.add_argument("--particles", type=int, default=1, help="weight samples per rank and step")
    parser.add_argument("--samples", type=int, default=32,
                        help="posterior samples for the final ELBO and the test metrics")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=60.0, help="process group timeout [s]")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.samples = min(args.epochs, 2), min(args.samples, 4)

    owns_group = start_process_group(args.device, args.timeout)
    rank, world = get_rank(), get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings(), pyro.validation_enabled(False):
            if rank != 0:  # rank 0 speaks for all: the ranks take the same steps
                warnings.simplefilter("ignore")
            summary = _train(args, rank, world, device)
        if owns_group:  # (all ranks leave together: gloo aborted a rank that tore down while rank 0 still wrote)
            dist.barrier()
        return summary
    finally:
        torch.set_num_threads(threads)
        if owns_group:
            dist.destroy_process_group()


def _train(args, rank, world, device):
    task = harness.digits_mlp(args.seed, test_size=0.2)
    split = task.split
    x_train, y_train = split.x_train.to(device), split.y_train.to(device)
    x_test, y_test = split.x_test.to(device), split.y_test.to(device)

    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)  # the same network, hence the same guide, on every rank
    bnn = BayesianNet(task.make_net().to(device), "categorical", num_data=task.num_data, prior=1.0)
    guide = bnn.guide()  # the README's recipe: bnn.guide(), NGVI()
    guide(x_train[:2], y_train[:2])
    seed_rank(args.seed)  # ... and each rank's own weight samples
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ef", num_particles=args.particles))

    if rank == 0:
        print(f"digits, MLP 64-100-10, {world} process(es) x {args.particles} sample(s), global batch "
              f"{args.batch_size} ({args.batch_size // world} per rank), N = {task.num_data}", flush=True)
    history = {"epoch": [], "elbo": [], "seconds": []}
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        batches = rank_batches(task.num_data, args.batch_size, epoch, args.seed)
        total = sum(svi.step(x_train[index], y_train[index]) for index in batches)
        elbo = -average_over_ranks(total / len(batches), device)
        seconds = time.perf_counter() - start
        history["epoch"].append(epoch)
        history["elbo"].append(elbo)
        history["seconds"].append(seconds)
        if rank == 0:
            print(f"epoch {epoch:3d}  ELBO {elbo:12.1f}  {seconds:6.2f} s", flush=True)
    if rank != 0:
        return None

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        final_elbo = -Trace_ELBO(num_particles=args.samples).loss(bnn, guide, x_train, y_train)
        logits = Predictive(bnn, guide=guide, num_samples=args.samples, return_sites=["output"])(x_test)["output"]
    summary = {
        "processes": world,
        "particles_per_rank": args.particles,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "history": history,
        "seconds_per_epoch": sum(history["seconds"]) / args.epochs,
        "final_elbo": final_elbo,
        **harness.predictive_metrics("categorical", logits.cpu(), y_test.cpu()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    pyro.get_param_store().save(args.out / "guide.pt")
    print(f"final ELBO {final_elbo:.1f} ({args.samples} samples), test accuracy {summary['accuracy']:.3f}, "
          f"NLL {summary['nll']:.3f}, ECE {summary['ece']:.3f}; "
          f"{summary['seconds_per_epoch']:.2f} s per epoch; wrote {args.out}", flush=True)
    return summary


if __name__ == "__main__":
    main()
