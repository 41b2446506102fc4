#!/usr/bin/env bash
# One command to set up and run:  ./quickstart.sh demo [ARGS...]   |   ./quickstart.sh test [PYTEST ARGS...]
# Setup is idempotent: a virtual environment in .venv with the package installed editable.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c 'import offload_engine, pytest, tensorstore, transformers, torchtitan.models.llama3' >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  # torch first, pinned: where a CPU wheel of 2.13.0 is on local disk pip takes it;
  # elsewhere PyPI serves the build for the platform.
  "$VPY" -c 'import torch' >/dev/null 2>&1 || "$VPY" -m pip install -q "torch==2.13.0"
  "$VPY" -m pip install -q -e '.[test,torchtitan]'
  # torchtitan without its pinned dependencies (pyproject.toml, the torchtitan extra, says why)
  "$VPY" -m pip install -q --no-deps "torchtitan==0.3.0"
fi
# Byte-compile the package, as pip does for a regular install: an editable one is compiled
# on first import only, and never where PYTHONDONTWRITEBYTECODE is set, and then every
# command re-parses its ~160 modules (0.15 s of each offline command's 0.3 s start-up on
# the 2-vCPU VM). Up to date, this is a stat per file.
"$VPY" -m compileall -q offload_engine >/dev/null
what=${1:-demo}
shift || true
case "$what" in
  demo) exec .venv/bin/offload-engine demo "$@" ;;
  test) exec "$VPY" -m pytest "$@" ;;
  *) echo "usage: ./quickstart.sh demo|test [args...]" >&2; exit 2 ;;
esac
