#!/usr/bin/env bash
# Creates .venv and installs lightning-dynamix with its test tools and its optional torchft, transformers and
# litdata into it.
# torch comes first: torch==2.13.0 (CPU build where one is provided), or the torch already
# installed for $PYTHON, reused through --system-site-packages, so no installer ever pulls a second
# (CUDA) build. Re-running is cheap: it installs again only when pyproject.toml changed.
#
# pip chooses the torch wheel (it reads this machine's pip configuration: its wheel folders and
# indexes); uv, where pip can install it, installs the wheels (28 s with their bytecode, against pip's 50 s for the
# same set); without uv, pip installs everything. SETUP_INSTALLER=pip forces pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

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
  uv=()
  # uv only in a venv of its own: it does not count packages reused from the system's site-packages
  if [ "${SETUP_INSTALLER:-uv}" = uv ] && grep -q "include-system-site-packages = false" "$VENV/pyvenv.cfg" &&
    "${PIP[@]}" --quiet uv 2>/dev/null; then
    # compiled as pip compiles them: a Python run with PYTHONDONTWRITEBYTECODE would compile torch at every import
    uv=("$VENV/bin/uv" pip install --compile-bytecode --python "$VENV/bin/python")
  fi
  install() {  # with uv where it works (it may not reach the indexes pip is configured with), else with pip
    if [ ${#uv[@]} -gt 0 ] && "${uv[@]}" "$@"; then
      return
    fi
    "${PIP[@]}" "$@"
  }
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    "$VENV/bin/python" -m pip download --disable-pip-version-check --quiet --no-deps -d "$wheels" "torch==2.13.0"
    install "$wheels"/torch-*.whl
  fi
  install -e ".[dev,ft,transformers,streaming]"
  # LitData without its dependencies: they are the `streaming` extra, less torchvision (see pyproject.toml)
  install --no-deps "litdata==0.2.76"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi

# the checkout's bytecode, as pip compiles an installed package's (an editable install's modules are the checkout's):
# where PYTHONDONTWRITEBYTECODE is set, every process would compile each module it imports (0.6 s a process)
"$VENV/bin/python" -m compileall -q -j 0 lightning_dynamix tests examples scripts >/dev/null
