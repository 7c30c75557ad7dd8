#!/bin/sh
# Full fine-tuning of a model's shape (bench/shapes/NAME/config.json, initialised at random: no weight file),
# one real training step of T tokens, under each named combination of the optimizer-state options. Prints,
# per combination, peak RSS (/usr/bin/time -v), the step's time and the ledger by tier and category
# (the train log's "memory after setup" line and metrics.jsonl).
#
#   today   --optim adamw, state in memory, every gradient kept     (16 bytes a parameter before activations)
#   8bit    --optim adamw8bit                                       (10)
#   disk    --optim adamw --optim-state disk --step-in-backward     (4 + one layer's gradients)
#   best    --optim adamw8bit --optim-state disk --step-in-backward (4 + one layer's gradients; 2 on disk)
#   OPTIM-TIER (e.g. adamw-device, adamw8bit-disk, galore-host, galore8bit-disk): --optim OPTIM --optim-state TIER
#
# usage: bench/optim/fit_full_ft.sh [SHAPE=tinyllama-1.1b] [T=1024] [COMBOS="best today"] [OOMLESS=build/release/oomless]
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
shape=${1:-tinyllama-1.1b}; T=${2:-1024}; combos=${3:-best today}; bin=${4:-$root/build/release/oomless}
cfg=$root/bench/shapes/$shape/config.json
work=$root/build/fit-$shape; mkdir -p "$work"
V=$(sed -n 's/.*"vocab_size": *\([0-9]*\).*/\1/p' "$cfg")
"$bin" tokenize --model preset:micro --text-file "$root/data/kjv/eval.txt" --no-special |
  tr ' ' '\n' | awk -v V="$V" 'NF { printf "%d\n", $1 % V }' > "$work/data.ids"
"$bin" probe --quick | head -3
common="--model $cfg --data $work/data.ids --seq $T --batch 1 --steps 1 --save-policy none --eval-every 0 --save-every 0 --save-optimizer no"
for combo in $combos; do
  case $combo in
    today) flags="--optim adamw" ;;
    8bit) flags="--optim adamw8bit" ;;
    disk) flags="--optim adamw --optim-state disk --step-in-backward --clip 1 --clip-norm previous" ;;
    best) flags="--optim adamw8bit --optim-state disk --step-in-backward --clip 1 --clip-norm previous" ;;
    adamw-*|adamw8bit-*|galore-*|galore8bit-*) flags="--optim ${combo%-*} --optim-state ${combo##*-}" ;;
    *) echo "unknown combination $combo (today, 8bit, disk, best, or OPTIM-TIER)" >&2; exit 2 ;;
  esac
  rm -rf "$work/$combo"
  echo "== $combo: $flags"
  # shellcheck disable=SC2086
  /usr/bin/time -v "$bin" train $common $flags --out "$work/$combo" > "$work/$combo.log" 2> "$work/$combo.time" ||
    { tail -5 "$work/$combo.log" "$work/$combo.time"; continue; }
  grep -E "memory after setup|^step" "$work/$combo.log" "$work/$combo.time"
  grep -E "Maximum resident|Elapsed" "$work/$combo.time"
  tail -1 "$work/$combo/metrics.jsonl"
done
