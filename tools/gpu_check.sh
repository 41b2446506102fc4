#!/usr/bin/env bash
# The prepared GPU check (issue 16): what only a GPU can show, as one JSON object, in at
# most 8 minutes on one GPU. Runs anywhere: without CUDA the CPU-safe half runs and the
# CUDA sections say "skipped". See tools/gpu_check.py for the sections.
#
#   tools/gpu_check.sh [OUT.json [ARGS...]]  (default: gpu_check.json in the current folder;
#                                             ARGS go to gpu_check.py, e.g. --smoke: tiny sizes)
#   PYTHON=.venv/bin/python GPU_CHECK_DIR=/local/nvme tools/gpu_check.sh
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
out="${1:-gpu_check.json}"
shift || true
if ! "$py" -c "import offload_engine" 2>/dev/null; then
    "$py" -m pip install --quiet -e "$here"
fi
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" >&2
# 480 s: the check's budget; the JSON is written even when a section fails (exit 1)
status=0
timeout 480 "$py" "$here/tools/gpu_check.py" --path "${GPU_CHECK_DIR:-${TMPDIR:-/tmp}}" "$@" > "$out" || status=$?
cat "$out"
exit "$status"
