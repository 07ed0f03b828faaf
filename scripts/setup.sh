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
# --no-compile: no byte-compiling every installed module up front (torch alone is thousands
# of files); Python compiles what it imports, once, on first use.
.venv/bin/python -m pip install -q --no-compile "torch==${KAREUS_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q --no-compile -e ".[dev,hf]"
echo "kareus set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
