#!/bin/sh
# Chunk-recurrent training with the history on disk: the process's peak RSS (/usr/bin/time -v) agrees
# with the engine's ledger. RSS - idle must be within 10% + 64 MiB of the ledger's Device+Host peak,
# where idle is the peak RSS of the same binary doing no work (`oomless --help`: code, libraries).
# usage: chunked_rss.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR [SEQ]   (MODEL=preset:NAME, default micro)
set -u
bin=$1; src=$2; out=$3/chunked_rss; seq=${4:-16384}
rm -rf "$out" "$out.log" "$out.idle.log"
maxrss() { sed -n 's/.*Maximum resident set size (kbytes): *\([0-9]*\).*/\1/p' "$1"; }
/usr/bin/time -v "$bin" --help > "$out.idle.log" 2>&1 || { echo "oomless --help failed"; cat "$out.idle.log"; exit 1; }
/usr/bin/time -v "$bin" train --model "${MODEL:-preset:micro}" --data "$src/data/kjv/train.txt" --seq "$seq" --batch 1 --steps 1 \
  --chunk 256 --page 64 --kv-offload disk --eval-every 0 --save-every 0 --out "$out" > "$out.log" 2>&1 \
  || { echo "train failed"; cat "$out.log"; exit 1; }
idle=$(maxrss "$out.idle.log"); rss=$(maxrss "$out.log")
# The last metrics line: the first two "total" objects are Device's and Host's.
peaks=$(tail -n 1 "$out/metrics.jsonl" | grep -o '"total":{"current":[0-9]*,"peak":[0-9]*}' | head -n 2 \
  | sed 's/.*"peak":\([0-9]*\)}/\1/')
[ -n "$idle" ] && [ -n "$rss" ] && [ "$(echo "$peaks" | wc -l)" -eq 2 ] \
  || { echo "could not read RSS (idle '$idle', run '$rss') or the ledger peaks ('$peaks')"; cat "$out.log"; exit 1; }
ledger=$(echo "$peaks" | awk '{s += $1} END {printf "%d", s / 1024}')  # KiB
used=$((rss - idle)); slack=$((ledger / 10 + 65536)); diff=$((used - ledger))
echo "T=$seq: peak RSS $rss KiB, idle $idle KiB, RSS - idle $used KiB, ledger Device+Host peak $ledger KiB," \
  "difference $diff KiB (allowed +-$slack KiB)"
[ "$diff" -le "$slack" ] && [ "$diff" -ge "-$slack" ] || { echo "peak RSS does not agree with the ledger"; exit 1; }
