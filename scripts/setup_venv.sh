#!/usr/bin/env bash
# Create ./.venv (if missing) and install cpcompile with its test extras into it.
# Used by the demo and test commands of the README, and by CI, so all three set up alike.
# The install is editable, so a code change needs no reinstall: pip runs only when the venv is
# new or pyproject.toml, this script or the checkout's place changed (.venv/.cpcompile-installed
# holds their hash).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.cpcompile-installed
want=$( { pwd; cat pyproject.toml scripts/setup_venv.sh; } |
  .venv/bin/python -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -f "$stamp"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned to a CPU-capable release; any torch>=2.11 works with cpcompile.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,triton,train,hf]"
echo "$want" > "$stamp"
