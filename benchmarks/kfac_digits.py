"""
Noisy K-FAC (a matrix normal per layer, :class:`~pyro_ngvi.kronecker.KroneckerNormal`)
against mean-field NGVI (``AutoNormal``) on the digits MLP 64-100-10.

Both train a :class:`~pyro_ngvi.BayesianNet` (prior N(0, 1), categorical
likelihood) with Pyro's ``SVI``, :class:`~pyro_ngvi.NGVI` and
``CurvatureELBO("ggn")`` on its BackPACK fast path (mean-field: ``DiagGGNExact``;
K-FAC: ``KFLR``), with the same hyperparameters: the repository's digits recipe for
mean-field NGVI ggn (lr 0.1, beta 0.1, momentum 0.8, damping 30, 16 particles,
init_scale 0.1, chosen on seed 0 in ``benchmarks/bnn_digits.py``), not tuned for
K-FAC, reported on seeds 1, 2, 3. sklearn's ``load_digits``, a stratified 80/20
split (random_state 0), features standardised with the training statistics;
minibatches of 128, a fresh permutation per epoch.

Reported at the last epoch (mean ± sd over seeds): test NLL, ECE (15 bins),
accuracy from the predictive mean of 100 weight samples; and CPU ms per
``svi.step`` (``time.process_time``, median, 1 thread) measured apart, the two methods interleaved in blocks of 10
steps after a warm-up, so that load from other processes hits both alike.

Usage::

    python benchmarks/kfac_digits.py [--epochs 50] [--seeds 1 2 3] [--out FILE.md]
"""

import argparse
import statistics
import time

import torch
from torch import nn

import pyro
from pyro.infer import SVI, Predictive
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO
from pyro_ngvi.kronecker import KroneckerNormal
from pyro_ngvi.metrics import accuracy, expected_calibration_error, nll

RECIPE = dict(lr=0.1, beta=0.1, momentum=0.8, damping=30.0)
PARTICLES = 16
INIT_SCALE = 0.1
BATCH = 128


def load():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    scaler = StandardScaler().fit(x_train)
    as_float = lambda a: torch.as_tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    return as_float(x_train), torch.as_tensor(y_train), as_float(x_test), torch.as_tensor(y_test)


def make_svi(kind: str, seed: int, num_data: int):
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)
    net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))
    bnn = BayesianNet(net, "categorical", num_data=num_data, prior=1.0)
    if kind == "kfac":
        guide = KroneckerNormal(bnn, init_scale=INIT_SCALE)
    else:
        guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=INIT_SCALE)
    return SVI(bnn, guide, NGVI(**RECIPE), CurvatureELBO("ggn", num_particles=PARTICLES))


def run(kind: str, seed: int, epochs: int, data):
    x_train, y_train, x_test, y_test = data
    pyro.clear_param_store()
    svi = make_svi(kind, seed, len(x_train))
    for _ in range(epochs):
        order = torch.randperm(len(x_train))
        for start in range(0, len(order), BATCH):
            index = order[start: start + BATCH]
            svi.step(x_train[index], y_train[index])
    with torch.no_grad():
        predictive = Predictive(svi.model, guide=svi.guide, num_samples=100, return_sites=["output"])
        probs = predictive(x_test)["output"].softmax(-1).mean(0)
    return {"nll": float(nll(probs, y_test)), "ece": float(expected_calibration_error(probs, y_test)),
            "accuracy": float(accuracy(probs, y_test))}


def ms_per_step(kinds, data, warmup=5, rounds=10, block=10):
    """Median ms per step of each method, interleaved in blocks (one param store scope each)."""
    x_train, y_train = data[:2]
    store = pyro.get_param_store()
    svis, states, times = {}, {}, {kind: [] for kind in kinds}
    batches = [torch.randperm(len(x_train))[:BATCH] for _ in range(block)]
    for kind in kinds:
        with store.scope() as state:
            svis[kind] = make_svi(kind, 0, len(x_train))
            for index in batches[:warmup]:
                svis[kind].step(x_train[index], y_train[index])
        states[kind] = state
    for _ in range(rounds):
        for kind in kinds:
            with store.scope(states[kind]):
                for index in batches:
                    began = time.process_time()  # CPU time: less sensitive to other processes
                    svis[kind].step(x_train[index], y_train[index])
                    times[kind].append(time.process_time() - began)
    return {kind: 1e3 * statistics.median(t) for kind, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--timing-only", action="store_true", help="only the ms/step measurement")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    data = load()
    labels = {"meanfield": "NGVI mean-field (AutoNormal, DiagGGNExact)",
              "kfac": "NGVI noisy K-FAC (KroneckerNormal, KFLR)"}
    timing = ms_per_step(list(labels), data)
    print("ms/step", timing, flush=True)
    results = {kind: [] for kind in labels}
    for seed in [] if args.timing_only else args.seeds:
        for kind in labels:
            results[kind].append(run(kind, seed, args.epochs, data))
            print(kind, seed, results[kind][-1], flush=True)
    if args.timing_only:
        print(f"K-FAC / mean-field time per step: {timing['kfac'] / timing['meanfield']:.2f}x")
        return

    def cell(kind, metric, fmt):
        values = [r[metric] for r in results[kind]]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{fmt.format(statistics.mean(values))} ± {fmt.format(sd)}"

    lines = [
        f"### Digits MLP 64-100-10: {args.epochs} epochs, seeds {args.seeds} (mean ± sd)", "",
        "| method | test NLL | ECE | accuracy | CPU ms/step |", "|---|---|---|---|---|",
    ]
    for kind, label in labels.items():
        lines.append(f"| {label} | {cell(kind, 'nll', '{:.4f}')} | {cell(kind, 'ece', '{:.4f}')} "
                     f"| {cell(kind, 'accuracy', '{:.4f}')} | {timing[kind]:.1f} |")
    lines += ["", f"K-FAC / mean-field time per step: {timing['kfac'] / timing['meanfield']:.2f}x"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
