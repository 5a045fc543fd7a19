"""
NGVI on torch.distributed (gloo, loopback) on this machine: what a second process
costs and what its extra Monte-Carlo sample buys.

1. **Training** (``examples/distributed_bnn.py``: digits, MLP 64-100-10, prior
   N(0, 1), ``CurvatureELBO("ef")``, global batch 128, one CPU thread per process):
   wall time per epoch (median over epochs after the first), final ELBO
   (``Trace_ELBO`` with 32 samples on the training set) and test accuracy for
   one process with one sample per step, one process with ``num_particles=2``
   (each sample on all 128 examples: twice the work), and two processes with one
   sample each on 64 of the 128 examples (data-parallel: each process does half
   a step's work, and the step gets two samples).
2. **Variance of the update** at a fixed guide (the one-process run's final one)
   and a fixed batch of 128 examples: ``repeats`` single NGVI steps from the same
   state, each from another seed; the variance over repeats of the change of the
   mean :math:`\\Delta\\mu` and of the precision :math:`\\Delta\\lambda`, summed over
   all weights, with one sample (one process), two samples (one process,
   ``num_particles=2``), two processes with one sample each on all 128 examples
   (sample-parallel: the same estimator as ``num_particles=2``) and two processes
   with one sample each on 64 of them (data-parallel, as in training).

Prints markdown tables (and writes them to ``--out`` when given). Process start-up
is not timed; the machine's load average is printed with the tables, as timings
on a shared machine depend on it.

Usage::

    python benchmarks/distributed.py [--epochs 30] [--repeats 100] [--quick] [--out FILE.md]
"""

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed_bnn.py"
sys.path.insert(0, str(EXAMPLE.parent))
import harness  # noqa: E402  (examples/harness)
TIMEOUT = 900  # seconds for one launch, at most


# ------------------------------------------------------------------ launching
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command, processes: int):
    """Run ``command`` as ``processes`` ranks, with the environment torchrun would set."""
    port = str(_free_port())
    procs = []
    for rank in range(processes):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore::DeprecationWarning")
        procs.append(subprocess.Popen([sys.executable, *map(str, command)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        if proc.returncode != 0:
            raise RuntimeError(f"rank {rank} of {' '.join(map(str, command))} failed:\n{output}")
    return outputs


# ------------------------------------------------------------------ part 1: training
def train_runs(args, work: Path):
    setups = [("1 process", 1, 1), ("1 process, num_particles=2", 1, 2), ("2 processes", 2, 1)]
    rows = []
    for name, processes, particles in setups:
        out = work / f"train_{processes}_{particles}"
        launch([EXAMPLE, "--epochs", args.epochs, "--particles", particles, "--samples", args.samples,
                "--threads", 1, "--seed", args.seed, "--out", out], processes)
        summary = json.loads((out / "summary.json").read_text())
        seconds = summary["history"]["seconds"]
        rows.append({
            "setup": name,
            "samples": processes * particles,
            "seconds": statistics.median(seconds[1:] or seconds),
            "elbo": summary["final_elbo"],
            "accuracy": summary["accuracy"],
            "nll": summary["nll"],
        })
    return rows, work / "train_1_1" / "guide.pt"


# ------------------------------------------------------------------ part 2: update variance
def variance_runs(args, work: Path, guide_path: Path):
    setups = [("1 process", 1, 1, False), ("1 process, num_particles=2", 1, 2, False),
              ("2 processes, 128 examples each", 2, 1, False), ("2 processes, 64 examples each", 2, 1, True)]
    rows = []
    for name, processes, particles, split in setups:
        out = work / f"variance_{processes}_{particles}_{split}.json"
        launch([__file__, "--variance-worker", "--guide", guide_path, "--repeats", args.repeats,
                "--particles", particles, "--seed", args.seed, "--result", out]
               + (["--split-batch"] if split else []), processes)
        result = json.loads(out.read_text())
        rows.append({"setup": name, "samples": processes * particles, **result})
    base = rows[0]
    for row in rows:
        row["mean_ratio"] = row["var_mean"] / base["var_mean"]
        row["precision_ratio"] = row["var_precision"] / base["var_precision"]
    return rows


def variance_worker(args):
    """One rank: ``repeats`` single steps from the saved guide, recording the changes."""
    import torch

    import pyro
    from pyro.infer import SVI

    import distributed_bnn as example

    from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO
    from pyro_ngvi.distributed import get_rank, shard

    torch.set_num_threads(1)
    owns_group = example.start_process_group("cpu", timeout=120)
    try:
        rank = get_rank()
        task = harness.digits_mlp(args.seed, test_size=0.2)
        x, y = task.split.x_train[:128], task.split.y_train[:128]  # the same batch on every rank ...
        if args.split_batch:  # ... or a half of it each
            index = shard(len(x))
            x, y = x[index], y[index]
        pyro.clear_param_store()
        pyro.set_rng_seed(args.seed)
        bnn = BayesianNet(task.make_net(), "categorical", num_data=task.num_data, prior=1.0)
        guide = bnn.guide()  # as the example builds it
        guide(x[:2], y[:2])
        store = pyro.get_param_store()
        store.load(args.guide)
        state = copy.deepcopy(store.get_state())
        sites = bnn.latent_sites
        mean_changes, precision_changes = [], []
        with pyro.validation_enabled(False):
            for repeat in range(args.repeats):
                store.set_state(copy.deepcopy(state))
                before = _mean_precision(sites)
                pyro.set_rng_seed(args.seed + 1 + 1000 * repeat + rank)
                svi = SVI(bnn, guide, NGVI(warm_start=False),
                          CurvatureELBO("ef", num_particles=args.particles))
                svi.step(x, y)
                after = _mean_precision(sites)
                mean_changes.append(after[0] - before[0])
                precision_changes.append(after[1] - before[1])
        if rank == 0:
            mean_changes, precision_changes = torch.stack(mean_changes), torch.stack(precision_changes)
            result = {
                "var_mean": float(mean_changes.var(0).sum()),
                "var_precision": float(precision_changes.var(0).sum()),
            }
            Path(args.result).write_text(json.dumps(result))
        if owns_group:  # (all ranks leave together: see examples/distributed_bnn.py)
            torch.distributed.barrier()
    finally:
        if owns_group:
            torch.distributed.destroy_process_group()


def _mean_precision(sites):
    import torch

    import pyro

    means = [pyro.param(f"AutoNormal.locs.{s}").detach().reshape(-1) for s in sites]
    precisions = [pyro.param(f"AutoNormal.scales.{s}").detach().reshape(-1).pow(-2) for s in sites]
    return torch.cat(means), torch.cat(precisions)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=100, help="steps per variance estimate")
    parser.add_argument("--samples", type=int, default=32, help="samples of the final ELBO")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 epochs, 8 repeats")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    # internal: one rank of the variance measurement
    parser.add_argument("--variance-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--guide", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--particles", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--split-batch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variance_worker:
        return variance_worker(args)
    if args.quick:
        args.epochs, args.repeats, args.samples = 2, 8, 4

    with tempfile.TemporaryDirectory() as work:
        training, guide_path = train_runs(args, Path(work))
        variance = variance_runs(args, Path(work), guide_path)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    report = "\n".join([
        f"Digits MLP 64-100-10, CurvatureELBO('ef'), global batch 128, {args.epochs} epochs, "
        f"gloo on loopback, 1 thread per process; {os.cpu_count()} CPUs, load average {load}.",
        "",
        harness.markdown_table(training, [("setup", "setup", "s"), ("samples", "samples/step", "d"),
                         ("seconds", "s/epoch", ".3f"), ("elbo", "final ELBO", ".1f"),
                         ("accuracy", "test acc", ".3f"), ("nll", "test NLL", ".3f")]),
        "",
        f"Update variance at the trained guide, one fixed batch of 128, {args.repeats} repeats "
        "(sums over all weights; ratio to one sample):",
        "",
        harness.markdown_table(variance, [("setup", "setup", "s"), ("samples", "samples/step", "d"),
                         ("var_mean", "Var(Δμ)", ".3e"), ("mean_ratio", "ratio", ".2f"),
                         ("var_precision", "Var(Δλ)", ".3e"), ("precision_ratio", "ratio", ".2f")]),
    ])
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")
    return training, variance


if __name__ == "__main__":
    main()
