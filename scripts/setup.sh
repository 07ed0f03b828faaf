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
# What is installed must be byte-compiled: where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) nothing else writes .pyc files, and without them every process, every test's
# ranks included, would compile torch's modules from source (tried: CI went past 15 min).
# pip compiles on one core; compileall, run once after the installs, on all of them (torch:
# 32 s by pip, 9 s + 16 s so, 2026-12-07).
.venv/bin/python -m pip install -q --no-compile "torch==${KAREUS_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q --no-compile -e ".[dev,hf]"
# torchtitan itself, for the tests that run kareus on it (tests/test_torchtitan.py): its
# declared dependencies (torchdata, datasets, tokenizers, ...) serve its trainer, not the
# model and parallelism code the tests import, so it is installed without them
.venv/bin/python -m pip install -q --no-compile --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
# (a few files some packages ship as data are not Python 3: compileall says so and goes on)
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null 2>&1 || true
echo "kareus set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
