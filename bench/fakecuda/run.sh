#!/bin/sh
# Run PYTHON (a CUDA build of torch) with a fake CUDA runtime and driver that answer for one NVIDIA H200, on a machine
# without a GPU: torch.compile lowers its CUDA program on fake tensors (nothing runs on a device). Validation only.
#   bench/fakecuda/run.sh /path/to/cuda-torch-venv/bin/python bench/validate_hf_gpu.py --only compile
set -e
PYTHON=${1:?usage: run.sh PYTHON script.py [args...]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
[ -f "$HERE/build/libfakecudart.so" ] || "$HERE/build.sh" "$PYTHON" >&2
PEAKLEDGER_FAKE_CUDA=1 PYTHONPATH="$HERE/site${PYTHONPATH:+:$PYTHONPATH}" \
LD_PRELOAD="$HERE/build/libfakecudart.so" LD_LIBRARY_PATH="$HERE/build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
exec "$PYTHON" "$@"
