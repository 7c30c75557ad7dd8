#!/usr/bin/env bash
# Creates bench/estimate/.venv with DeepSpeed (pinned in requirements.txt) for bench/estimate/peers.py,
# unless every pin is already there. DeepSpeed ships as a source package: DS_BUILD_OPS=0 keeps its build
# pure Python (no CUDA or C++ op is compiled). It is installed without dependencies because peers.py runs
# under tools/golden/.venv, whose torch, pydantic, numpy and friends it uses; so that venv is set up first
# and this one is made from the same interpreter (msgpack's compiled module must match its Python).
# Safe to run again.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
golden="$here/../../tools/golden"
venv="$here/.venv"
req="$here/requirements.txt"

"$golden/setup.sh"

check() {  # exit 0 when every pin in requirements.txt is installed in the venv
    [ -x "$venv/bin/python" ] || return 1
    "$venv/bin/python" "$golden/check_pins.py" "$req" bench/estimate/.venv
}

if check 2>/dev/null; then
    echo "bench/estimate/.venv: up to date"
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    "$golden/.venv/bin/python" -m venv "$venv"
fi
DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --disable-pip-version-check --no-deps -r "$req"
check
echo "bench/estimate/.venv: ready"
