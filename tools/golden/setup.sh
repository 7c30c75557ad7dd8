#!/usr/bin/env bash
# Creates tools/golden/.venv and installs requirements.txt into it, unless every pinned package is
# already there at its pinned version. Safe to run again.   PYTHON=python3.11 tools/golden/setup.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
req="$here/requirements.txt"
py="${PYTHON:-python3}"

check() {  # exit 0 when every pin in requirements.txt is installed in the venv
    [ -x "$venv/bin/python" ] || return 1
    "$venv/bin/python" "$here/check_pins.py" "$req" tools/golden/.venv
}

if check 2>/dev/null; then
    echo "tools/golden/.venv: up to date"
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv" || { echo "setup.sh: '$py -m venv' failed (apt-get install python3-venv)" >&2; exit 1; }
fi
"$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
"$venv/bin/python" -m pip install --disable-pip-version-check -r "$req"
check
echo "tools/golden/.venv: ready"
