#!/bin/sh
# Build the fake CUDA runtime (libfakecudart.so, LD_PRELOAD) and driver (libcuda.so.1) into bench/fakecuda/build/,
# against the CUDA headers of PYTHON's CUDA build of torch (the nvidia-cuda-runtime wheel's include/, and triton's
# crt/host_defines.h, which that wheel lacks). What they answer and why: bench/COMPILE_GPU_FINDINGS.md.
#   bench/fakecuda/build.sh /path/to/cuda-torch-venv/bin/python
set -e
PYTHON=${1:?usage: build.sh PYTHON (a python with a CUDA build of torch and triton)}
HERE=$(cd "$(dirname "$0")" && pwd)
SP=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CUDA_INC=$(ls -d "$SP"/nvidia/cu*/include 2>/dev/null | head -n 1)
[ -n "$CUDA_INC" ] || { echo "build.sh: no nvidia/cu*/include under $SP (not a CUDA build of torch)" >&2; exit 2; }
mkdir -p "$HERE/build/inc/crt"
cp "$SP/triton/backends/nvidia/include/crt/host_defines.h" "$HERE/build/inc/crt/"
gcc -shared -fPIC -O2 -I"$CUDA_INC" -I"$HERE/build/inc" -Wl,--version-script="$HERE/fakecudart.map" \
    "$HERE/fakecudart.c" -o "$HERE/build/libfakecudart.so"
gcc -shared -fPIC -O2 "$HERE/fakecuda.c" -Wl,-soname,libcuda.so.1 -o "$HERE/build/libcuda.so.1"
echo "built $HERE/build/libfakecudart.so and libcuda.so.1"
