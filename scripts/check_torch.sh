#!/usr/bin/env bash
# The soundness tests on another supported torch (2.11 - 2.13), in a venv of its own:
#   bash scripts/check_torch.sh 2.11.0 [pytest args...]
# torch 2.13 has a CPU wheel here; 2.11 and 2.12 come only as CUDA builds (a 530 MB wheel and
# about 3 GB of NVIDIA libraries, 1.5 minutes to install), which run on CPU as well. Too
# long for CI's budget: run it when the supported range or PyTorch's internals move.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/check_torch.sh TORCH_VERSION [pytest args]}
shift
VENV=${KAREUS_TORCH_VENV:-/tmp/kareus-torch-$VERSION}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==$VERSION"
  "$VENV/bin/python" -m pip install -q -e ".[dev,hf]"
fi
"$VENV/bin/python" - <<'PY'
import torch
from kareus._torch_internals import self_test
print(f"torch {torch.__version__}: the internals kareus reads")
for name, ok in self_test().items():
    print(f"  {'yes' if ok else 'NO ':3}  {name}")
PY
if [ "$#" -eq 0 ]; then
  set -- tests/test_per_sample.py tests/test_split_nanobatches.py tests/test_outline.py \
    tests/test_opinfo.py tests/test_stacks.py tests/test_tensor_parallel.py tests/test_models.py
fi
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider "$@"
