#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has torch, triton, safetensors, tokenizers, transformers,
# but not pydantic). Run here, then carry `.whl` and start each device command with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:$PWD/kernels:$PWD/cluster:$PWD/loadtest:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "pydantic==2.13.4" "pydantic_core==2.46.4" annotated_types typing_inspection
ls .whl
