#!/usr/bin/env bash
# The PyTorch side of bench/peers needs torch, transformers and safetensors from PyPI. They are pinned in
# tools/golden/requirements.txt (the versions the goldens were made with); this creates that venv,
# tools/golden/.venv, when it is missing or incomplete, and does nothing otherwise.
set -euo pipefail
exec "$(cd "$(dirname "$0")" && pwd)/../../tools/golden/setup.sh"
