#!/usr/bin/env bash
# Creates .venv and installs lightning-dynamix with its test tools and its optional torchft into it.
# torch comes first: torch==2.13.0 (CPU build where one is provided), or the torch already
# installed for $PYTHON, reused through --system-site-packages, so pip never pulls a second
# (CUDA) build. Re-running is cheap: it installs again only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup: reusing the torch installed for $PYTHON ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi

stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --disable-pip-version-check "torch==2.13.0"
  fi
  "$VENV/bin/python" -m pip install --disable-pip-version-check -e ".[dev,ft]"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
