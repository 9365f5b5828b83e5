#!/usr/bin/env bash
# Install the project with its test/dev extras into .venv and run the whole suite:
# ruff (lint and format check), mypy --strict, then pytest. Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# node-opcua (pinned by its lockfile) for the OPC UA interop tests, where node is installed
# (tests/handlers/test_opcua_interop.py skips without node, fails without this install)
NODE_OPCUA=tests/interop/node_opcua
if command -v npm >/dev/null && [ ! "$NODE_OPCUA/node_modules/.package-lock.json" -nt "$NODE_OPCUA/package-lock.json" ]; then
    npm ci --prefix "$NODE_OPCUA" --no-audit --no-fund --loglevel=error >/dev/null
fi
echo "== ruff" && .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy --strict" && .venv/bin/mypy
# two processes (AKRI_TEST_WORKERS; 0 runs in this one): the suite mostly waits on sockets and
# subprocesses. A short base directory: the agents' unix socket paths under it, xdist's
# popen-gwN/ included, stay within the 107 bytes Linux allows.
BASETEMP="$(mktemp -d /tmp/akt.XXXX)"
trap 'rm -rf "$BASETEMP"' EXIT
echo "== pytest" && .venv/bin/python -m pytest -q -n "${AKRI_TEST_WORKERS:-2}" \
    --basetemp "$BASETEMP" "$@"
