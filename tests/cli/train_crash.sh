#!/bin/sh
# A crash at every step k of the checkpoint save sequence (OOMLESS_CRASH_AT=k, k = 1..9), then the run
# continued (with --resume when a complete checkpoint survived, else started again): the final weights are
# bitwise those of an uninterrupted run.
# usage: train_crash.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; work=$3/train_crash
rm -rf "$work"; mkdir -p "$work"
args="--model preset:micro --data $src/data/kjv/eval.txt --seq 32 --batch 2 --steps 4 --save-every 2 --eval-every 0 --keep 1"
"$bin" train $args --out "$work/whole" > "$work/whole.log" 2>&1 || { echo "uninterrupted run failed"; cat "$work/whole.log"; exit 1; }
k=1
while [ $k -le 9 ]; do
  out="$work/k$k"
  OOMLESS_CRASH_AT=$k "$bin" train $args --out "$out" > "$out.log" 2>&1
  rc=$?
  [ $rc -eq 86 ] || { echo "k=$k: expected the crash hook's exit code 86, got $rc"; cat "$out.log"; exit 1; }
  if ls -d "$out"/checkpoint-* > /dev/null 2>&1; then mode=--resume; else mode=; fi
  "$bin" train $args --out "$out" $mode > "$out.2.log" 2>&1 || { echo "k=$k: continuing failed"; cat "$out.2.log"; exit 1; }
  cmp -s "$work/whole/checkpoint-4/model.safetensors" "$out/checkpoint-4/model.safetensors" \
    || { echo "k=$k: final weights differ from the uninterrupted run"; exit 1; }
  echo "k=$k: ${mode:-restarted}, same final weights"
  k=$((k + 1))
done
