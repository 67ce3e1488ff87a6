#!/usr/bin/env bash
# The wheels the GPU machine lacks, for bench/gpu_issue38/run_cases.py: torchao 0.18.0, torchtune 0.6.1 (only its
# training/_activation_offloading.py and the two files it imports are used), bitsandbytes 0.50.2 (its cuda130 library
# serves torch 2.11+cu130). Run here (where pip reaches the registry) in the root of the checkout that calls the
# device tool, once: it fills .whl-issue38/ (about 47 MB; ignored through .git/info/exclude, carried by the call).
# The image's torch, transformers, numpy and packaging serve the rest (--no-deps: torch is never replaced).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl-issue38/' "$exclude" 2>/dev/null || echo '/.whl-issue38/' >> "$exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl-issue38 torchao==0.18.0 torchtune==0.6.1 bitsandbytes==0.50.2
ls -l .whl-issue38
# what travels with a call: tracked + untracked-not-ignored files, and the carried folder (limit 64 MiB)
{ git ls-files -z -co --exclude-standard; find .whl-issue38 -type f -print0; } | xargs -0 du -cb 2>/dev/null | tail -1
