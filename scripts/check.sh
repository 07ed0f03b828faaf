#!/usr/bin/env bash
# Lint, format check and type check: the same for people and for CI.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${KAREUS_BIN:-.venv/bin}
"$BIN/ruff" check .
"$BIN/ruff" format --check .
"$BIN/mypy" kareus
