#!/bin/sh
# report.html as a browser draws it: trains preset:micro for 60 steps (eval every 20, a --budget so the
# memory chart has its budget line) and screenshots OUT/report.html with headless Chromium (installed
# from Debian's packages when missing). Look at the PNG: charts, run table, configuration.
# usage: bench/report/screenshot.sh [OOMLESS=build/release/oomless] [WORK=build/report]
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${1:-$root/build/release/oomless}; work=${2:-$root/build/report}
command -v chromium > /dev/null || apt-get install -y chromium > /dev/null
rm -rf "$work"; mkdir -p "$work"
"$bin" train --model preset:micro --data "$root/data/kjv/train.txt" --eval-data "$root/data/kjv/eval.txt" --seq 128 \
  --batch 4 --steps 60 --eval-every 20 --budget 64MiB --out "$work/run" > "$work/train.log" 2>&1
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1360,1900 \
  --screenshot="$work/report.png" "file://$work/run/report.html" 2> "$work/chromium.log"
echo "$work/report.png"
