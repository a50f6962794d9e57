#!/usr/bin/env bash
# The Node.js client test (node's built-in runner). It starts `lucekv serve` with the repo's Python on a free port.
# `make test` calls this when node is installed. LUCEKV_PYTHON overrides the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")"
if [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi
export LUCEKV_PYTHON="${LUCEKV_PYTHON:-$(cd ../.. && pwd)/.venv/bin/python}"
exec node --test test/
