#!/bin/bash
# Pyro's own guide-training tests with every Adam-family optimizer swapped for pyro_ngvi.NGVI().
# Pyro's code is not in this repository: export Pyro's tests (the snapshot nearest the installed
# pyro-ppl) into a scratch directory first, e.g.
#     git -C <pyro clone> archive HEAD tests setup.cfg | tar -x -C /tmp/pyrosrc
# and add `ignore:\`torch.jit.trace\` is deprecated:FutureWarning` to its setup.cfg filterwarnings
# (torch 2.14 deprecates jit.trace; Pyro's suite turns the warning into an error, with Adam too).
# Pyro's AutoGaussianFunsor tests need funsor (in the bench extra: pip install -e ".[bench]").
# usage: run.sh PYRO_SCRATCH OUTFILE [pytest args]
#   NGVI_SWAP=0           Pyro's own optimizers (the baseline)
#   NGVI_ACCEPT_WARNING=1 NGVI's NotGaussianWarning is not an error
#   NGVI_SRC=<dir>        the pyro_ngvi to test (default: this checkout)
here=$(cd "$(dirname "$0")" && pwd)
src=${NGVI_SRC:-$(cd "$here/../.." && pwd)}
scratch=$1; out=$2; shift 2
cd "$scratch" && COLUMNS=1500 OMP_NUM_THREADS=1 PYTHONPATH="$src:$here" python -m pytest -p ngvi_swap \
  -p no:cacheprovider -q -rf --tb=line \
  tests/infer/test_autoguide.py::test_iplate_smoke tests/infer/test_autoguide.py::test_median \
  tests/infer/test_autoguide.py::test_quantiles tests/infer/test_autoguide.py::test_median_module \
  tests/infer/test_autoguide.py::test_nested_autoguide tests/infer/test_autoguide.py::test_linear_regression_smoke \
  tests/infer/test_autoguide.py::test_subsample_model tests/infer/test_autoguide.py::test_subsample_model_amortized \
  tests/infer/test_autoguide.py::test_subsample_guide tests/infer/test_autoguide.py::test_subsample_guide_2 \
  tests/infer/test_autoguide.py::test_exact tests/infer/test_autoguide.py::test_exact_batch \
  tests/infer/test_autoguide.py::test_exact_tree \
  tests/contrib/forecast/test_forecaster.py::test_svi_custom_smoke \
  tests/contrib/forecast/test_forecaster.py::test_subsample_smoke "$@" > "$out" 2>&1
