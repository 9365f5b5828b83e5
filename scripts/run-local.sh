#!/usr/bin/env bash
# Install the agent into .venv and run it in local mode with the debugEcho example.
# Extra arguments are passed to `akri agent`. State goes to ${AKRI_STATE_DIR:-/tmp/akri-state}.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
# An editable install runs from these sources: compile them now, or every start compiles
# ~60 modules again (~70 ms) when PYTHONDONTWRITEBYTECODE is set (docs/performance.md).
.venv/bin/python -m compileall -q agent discovery_handlers
exec .venv/bin/akri agent --local \
    --state-dir "${AKRI_STATE_DIR:-/tmp/akri-state}" \
    --config examples/debug-echo.yaml "$@"
