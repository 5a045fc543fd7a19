"""Smoke tests of the examples: each runs end to end in --quick mode, writes its
figures, prints its table, and its numbers make sense."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from pyro.infer.util import is_validation_enabled

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# the examples' dependencies are in the test extra: a missing one must fail, not skip
import matplotlib  # noqa: E402,F401
import sklearn  # noqa: E402,F401
import tqdm  # noqa: E402,F401


def load_example(name):
    """Import ``examples/<name>.py`` by path (examples/ is not a package)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


def run_quick(name, tmp_path, capsys):
    result = load_example(name).main(["--quick", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    return result, printed


def assert_table(printed, header_cells, rows):
    lines = [line for line in printed.splitlines() if line.startswith("|")]
    assert lines, "no markdown table printed"
    assert all(cell in lines[0] for cell in header_cells), lines[0]
    for row in rows:
        assert any(line.startswith(f"| {row} |") for line in lines), row


def assert_figures(tmp_path, names):
    for name in names:
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 1000, name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_bnn_classification_quick_run_beats_chance(tmp_path, capsys):
    rows, printed = run_quick("bnn_classification", tmp_path, capsys)
    assert_figures(tmp_path, ["training_curves.png", "reliability.png", "entropy.png"])
    methods = ["NGVI (ggn)", "BBB (Adam)", "ivon-opt", "MAP (tuned)"]
    assert_table(printed, ["test acc", "test NLL", "ECE", "Brier", "OOD AUROC"], methods)
    by_method = {row["method"]: row for row in rows}
    for method in methods:
        row = by_method[method]
        assert row["accuracy"] > 0.2, row  # ten classes: chance is 0.1
        assert math.isfinite(row["nll"]) and 0 <= row["ece"] <= 1 and 0 <= row["brier"] <= 2, row
        assert 0 <= row["ood_auroc"] <= 1, row
    for method in ("NGVI (ggn)", "BBB (Adam)", "ivon-opt"):
        assert math.isfinite(by_method[method]["elbo"]), method
    assert by_method["MAP (tuned)"]["epoch"] in (1, 2)


def test_bnn_recipe_quick_run_shows_the_tuning_path_and_the_samples(tmp_path, capsys):
    (rows, table), printed = run_quick("bnn_recipe", tmp_path, capsys)
    assert_figures(tmp_path, ["num_samples.png"])
    assert [row["run"].split(",")[0] for row in rows] == [
        "OGN (deterministic)", "then VOGN", "VOGN from the start"]
    for row in rows:
        assert row["accuracy"] > 0.2 and math.isfinite(row["nll"]), row
    assert [row["samples"] for row in table] == [1, 2, 5]
    assert all(math.isfinite(row["nll"]) and 0 <= row["accuracy"] <= 1 for row in table)


def test_bnn_regression_quick_run_has_sane_uncertainty(tmp_path, capsys):
    rows, printed = run_quick("bnn_regression", tmp_path, capsys)
    assert_figures(tmp_path, ["training_curves.png", "predictions.png"])
    assert_table(printed, ["test RMSE", "test log-lik", "50 % cover", "90 % cover"],
                 ["NGVI (ggn)", "NGVI (ef)", "BBB (Adam)", "MAP (Adam)"])
    for row in rows:
        # standardised targets: predicting 0 everywhere has RMSE about 1
        assert row["rmse"] < 1.2 and math.isfinite(row["loglik"]), row
        assert row["coverage50"] <= row["coverage90"], row
        assert row["noise"] > 0, row


def test_logistic_regression_quick_run_improves_the_elbo(tmp_path, capsys):
    threads = torch.get_num_threads()
    rows, printed = run_quick("logistic_regression", tmp_path, capsys)
    # main() leaves the process as it found it
    assert torch.get_num_threads() == threads and is_validation_enabled()
    assert_figures(tmp_path, ["elbo.png"])
    assert_table(printed, ["final ELBO", "steps to best - 1 nat"],
                 ["NGVI + Trace_ELBO", "NGVI + hessian", "Adam + Trace_ELBO"])
    for row in rows:
        assert math.isfinite(row["final"]) and row["final"] <= row["best"] < 0, row
    # 569 Bernoulli observations: a guide that knows nothing scores about
    # -569 log 2 = -394; every method must have beaten that within 20 steps
    assert all(row["best"] > -394 for row in rows), rows


def test_hierarchical_quick_run_matches_nuts_roughly(tmp_path, capsys):
    result, printed = run_quick("hierarchical", tmp_path, capsys)
    assert_figures(tmp_path, ["elbo.png", "posteriors.png"])
    assert_table(printed, ["NUTS", "NGVI + Trace_ELBO", "Adam + Trace_ELBO"], ["mu", "tau", "theta[1]"])
    for method, summary in result["posterior"].items():
        assert set(summary) == {"mu", "tau"} | {f"theta[{j}]" for j in range(1, 9)}, method
        assert summary["tau"][0] > 0 and all(sd > 0 for _, sd in summary.values()), method
        assert all(math.isfinite(mean) for mean, _ in summary.values()), method
    for row in result["elbo"]:
        assert math.isfinite(row["final"]), row


def test_laplace_evidence_quick_run_picks_the_best_evidence(tmp_path, capsys):
    results, printed = run_quick("laplace_evidence", tmp_path, capsys)
    assert_figures(tmp_path, ["laplace_evidence.png"])
    assert len(results) == 2
    for title, (best, rows) in results.items():
        assert len(rows) >= 2, title
        evidences = {row["alpha"]: row["log_evidence"] for row in rows}
        assert all(math.isfinite(e) for e in evidences.values()), title
        # the chosen prior precision is the candidate with the highest evidence
        assert evidences[best] == max(evidences.values()), title
        assert all(row["laplace_nll"] > 0 and row["map_nll"] > 0 for row in rows), title
    assert "log evidence" in printed


@pytest.mark.xdist_group("distributed")  # (with tests/test_distributed.py's launches, never at once)
def test_distributed_example_under_torchrun(tmp_path):
    """``torchrun --nproc_per_node=2 examples/distributed_bnn.py``: only rank 0 writes."""
    import json
    import os
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(EXAMPLES / "distributed_bnn.py"), "--quick", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]
    assert done.stdout.count("final ELBO") == 1  # rank 0 prints, rank 1 does not
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["processes"] == 2
    elbo = summary["history"]["elbo"]
    assert all(math.isfinite(e) for e in elbo) and elbo[-1] > elbo[0]
    assert summary["accuracy"] > 0.2  # ten classes: chance is 0.1
    assert (tmp_path / "guide.pt").is_file()


def test_the_examples_extra_installs_every_baseline_the_main_demo_compares_with():
    """``pip install -e ".[examples]"`` then the main demo (the README's first command): its table has
    an ivon-opt row only where ``ivon`` imports (``harness.ivon_installed``: else the row is skipped),
    so the ``examples`` extra must install ivon-opt, as the docs' description of the demo says."""
    import tomllib

    extras = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    demo = (EXAMPLES / "bnn_classification.py").read_text(encoding="utf-8")
    assert "harness.ivon_installed()" in demo  # the demo's ivon-opt row is optional, as read here
    assert "ivon-opt" in extras["examples"], extras["examples"]
