#!/usr/bin/env bash
# Create .venv with kareus and its test tools. torch==2.13.0 is installed first so that pip
# takes the local CPU wheel instead of downloading a CUDA build (see the README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# pip byte-compiles what it installs: keep it so. Where PYTHONDONTWRITEBYTECODE is set (as on
# these machines) nothing else writes .pyc files, and without them every process, every
# test's ranks included, would compile torch's modules from source (tried: CI went past 15 min).
.venv/bin/python -m pip install -q "torch==${KAREUS_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev,hf]"
# torchtitan itself, for the tests that run kareus on it (tests/test_torchtitan.py): its
# declared dependencies (torchdata, datasets, tokenizers, ...) serve its trainer, not the
# model and parallelism code the tests import, so it is installed without them
.venv/bin/python -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
echo "kareus set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
