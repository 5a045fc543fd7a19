#!/usr/bin/env bash
# The CUDA checks of issue 24 in one command, for a machine with a GPU and the repository
# (run from its root). Python packages the machine lacks (pyro-ppl, pyro-api,
# backpack-for-pytorch, unfoldNd, ivon-opt: all pure Python) can come as wheels in .whl/,
# downloaded on a machine with the registries:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#       pyro-ppl==1.9.2 pyro-api==0.1.2 backpack-for-pytorch==1.7.1 unfoldNd==0.2.3 ivon-opt==0.1.3
# Results go to $OUT (default ./cuda_out): the CUDA tests' log and the two timing tables.
set -uo pipefail
OUT="${OUT:-cuda_out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, pyro, backpack; print('torch', torch.__version__, 'pyro', pyro.__version__, torch.cuda.get_device_name())" || exit 1
# the CUDA tests: the engine on CUDA takes the CPU steps (skipped without a device) and the compiled passes (inductor's C++ and Triton)
timeout 170 python3 -m pytest tests/test_cuda.py tests/test_cuda_paths.py tests/test_fused.py -q -n 8 -p no:cacheprovider -p no:benchmark -rs 2>&1 \
    | tee "$OUT/tests.log" | tail -25
# the recipe and the traced site on the GPU, eager, then compiled at one width
timeout 120 python3 benchmarks/cuda_step.py --steps 192 --out "$OUT/cuda_eager.md" 2>&1 | grep -v '^E1\|^ ' | tail -40
timeout 130 python3 benchmarks/cuda_step.py --compiled --widths 1600 --steps 96 --out "$OUT/cuda_compiled.md" 2>&1 \
    | grep -v '^E1\|^ ' | tail -40
