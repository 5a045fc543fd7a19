"""
Diagonal Laplace on a small MLP: :func:`pyro_ngvi.laplace.laplace` against
laplace-torch (``Laplace(..., hessian_structure="diag")``), the same network at
the same mode.

Setting: scikit-learn digits (pixels / 16), the first ``--n`` examples of a fixed
permutation, an MLP 64-32-10 (tanh), Categorical likelihood, prior
``N(0, 1/alpha)`` on every weight, float64 unless ``--float32``.

1. The mode: ``laplace(BayesianNet(...), x, y, curvature="ggn")`` runs
   deterministic NGVI (diagonal GGN Newton with momentum, line search) from
   PyTorch's initialisation. Reported: steps, the size of the remaining Newton
   step in posterior standard deviations, time.
2. At that mode, for the curvatures ``ggn`` (BackPACK ``DiagGGNExact`` in both)
   and ``ef`` (empirical Fisher), ours with ``num_steps=0`` (curvature and
   evidence at the guide's mean) and laplace-torch's ``fit`` +
   ``log_marginal_likelihood`` on a copy of the network holding the same weights
   (full-batch loader). Compared: the posterior precision vectors (relative
   error ``|ours - theirs| / theirs``: max, median) and the log evidence
   (absolute difference); time per call, median over ``--repeats``.

Both libraries compute the same number by the same formula,
``log p(D | w*) + log p(w*) + 1/2 sum log(2 pi / lambda_i)`` (laplace-torch
writes it as ``log lik - 1/2 (log det ratio + scatter)``), so the precision
agreement should be at round-off and the evidence agreement at round-off times
the number of weights.

If laplace-torch cannot be imported (``pip install laplace-torch``; it must not
replace the installed torch) the script says so and prints our numbers alone.

Usage::

    python benchmarks/laplace_vs_laplace_torch.py [--n 1000] [--alpha 10] [--steps 300] [--repeats 5] [--float32]
"""

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch import nn

import pyro

from pyro_ngvi import BayesianNet, LaplaceWarning, laplace


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="diagonal Laplace: pyro_ngvi vs laplace-torch")
    parser.add_argument("--n", type=int, default=1000, help="training examples (default: 1000)")
    parser.add_argument("--alpha", type=float, default=10.0, help="prior precision (default: 10)")
    parser.add_argument("--steps", type=int, default=300, help="most NGVI steps to the mode (default: 300)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (default: 5)")
    parser.add_argument("--float32", action="store_true", help="float32 instead of float64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def digits(n, dtype, seed):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]
    return torch.tensor(x, dtype=dtype)[perm] / 16.0, torch.tensor(y)[perm]


def import_laplace_torch():
    try:
        with warnings.catch_warnings():  # its dependencies' deprecation notes
            warnings.simplefilter("ignore")
            from laplace import Laplace
        from laplace.curvature import BackPackEF, BackPackGGN
    except Exception as error:  # ImportError, or a broken install
        return None, f"laplace-torch is not available ({type(error).__name__}: {error})"
    return (Laplace, {"ggn": BackPackGGN, "ef": BackPackEF}), None


def timed(fn, repeats):
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return value, statistics.median(times)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.float32 else torch.float64
    x, y = digits(args.n, dtype, args.seed)
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).to(dtype)
    bnn = BayesianNet(net, "categorical", num_data=len(x), prior=args.alpha**-0.5)
    num_weights = sum(p.numel() for p in net.parameters())

    # 1. the mode, by deterministic NGVI
    pyro.clear_param_store()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LaplaceWarning)
        fit = laplace(bnn, x, y, curvature="ggn", num_steps=args.steps, lr=0.1, momentum=0.9, tol=1e-4)
    fit_seconds = time.perf_counter() - start
    print(
        f"digits N={len(x)}, MLP 64-32-10 ({num_weights} weights), alpha={args.alpha:g}, {dtype}: mode by NGVI in "
        f"{fit.num_steps} steps, {fit_seconds:.1f} s, remaining Newton step {fit.newton_step:.2g} posterior std"
    )
    with torch.no_grad():  # the mode into the network, for laplace-torch
        for name, param in net.named_parameters():
            param.copy_(fit.map[name])
    names = [name for name, _ in net.named_parameters()]

    baseline, problem = import_laplace_torch()
    if problem:
        print(f"\n{problem}: printing pyro_ngvi's numbers only\n")
    rows = []
    for curvature in ("ggn", "ef"):
        ours, our_seconds = timed(
            lambda: laplace(bnn, x, y, curvature=curvature, guide=fit.guide, num_steps=0), args.repeats
        )
        our_precision = torch.cat([ours.precision[name].flatten() for name in names])
        row = {"curvature": curvature, "ours_evidence": ours.log_evidence, "ours_seconds": our_seconds}
        if baseline is not None:
            Laplace, backends = baseline
            twin = copy.deepcopy(net)
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))

            def theirs_fit():
                la = Laplace(
                    twin, "classification", subset_of_weights="all", hessian_structure="diag",
                    prior_precision=args.alpha, backend=backends[curvature],
                )
                with warnings.catch_warnings():  # BackPACK's hook note on the first layer
                    warnings.simplefilter("ignore", UserWarning)
                    la.fit(loader)
                return la, float(la.log_marginal_likelihood())

            (la, their_evidence), their_seconds = timed(theirs_fit, args.repeats)
            their_precision = la.posterior_precision.detach().to(dtype)
            relative = (our_precision - their_precision).abs() / their_precision.abs()
            row.update(
                theirs_evidence=their_evidence,
                theirs_seconds=their_seconds,
                max_rel=float(relative.max()),
                median_rel=float(relative.median()),
            )
        rows.append(row)

    print()
    if baseline is None:
        print("| curvature | log evidence (ours) | time ours (ms) |")
        print("|---|---:|---:|")
        for r in rows:
            print(f"| {r['curvature']} | {r['ours_evidence']:.4f} | {1e3 * r['ours_seconds']:.1f} |")
        return
    print(
        "| curvature | precision rel. err. max | median | log evidence ours | laplace-torch | abs. diff. "
        "| time ours (ms) | laplace-torch (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['curvature']} | {r['max_rel']:.1e} | {r['median_rel']:.1e} | {r['ours_evidence']:.4f} | "
            f"{r['theirs_evidence']:.4f} | {abs(r['ours_evidence'] - r['theirs_evidence']):.1e} | "
            f"{1e3 * r['ours_seconds']:.1f} | {1e3 * r['theirs_seconds']:.1f} |"
        )
    print(
        "\nTimes: the Laplace step at a given mode only (curvature, precision, evidence), median of "
        f"{args.repeats}; ours runs through Pyro (one traced model for the log joint, the BackPACK pass "
        "for the curvature)."
    )


if __name__ == "__main__":
    main()
