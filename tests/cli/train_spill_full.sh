#!/bin/sh
# A full spill disk during chunk-recurrent training (OOMLESS_FAULT_SPILL_ENOSPC_AFTER makes spill writes
# fail with ENOSPC after N bytes): train stops with exit code 1 and an error saying the disk is full and
# naming the spill folder; the checkpoints saved before stay valid and --resume continues from them.
# usage: train_spill_full.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; out=$3/train_spill_full
rm -rf "$out" "$out.log" "$out.resume.log"
args="--model preset:micro --data $src/data/kjv/eval.txt --seq 512 --batch 1 --steps 6 --chunk 128 --page 32
  --kv-offload disk --save-every 1 --keep 0 --eval-every 0 --out $out"
OOMLESS_FAULT_SPILL_ENOSPC_AFTER=2000000 "$bin" train $args > "$out.log" 2>&1
rc=$?
[ $rc -eq 1 ] || { echo "expected exit code 1 on a full spill disk, got $rc"; cat "$out.log"; exit 1; }
grep -q "full" "$out.log" && grep -q "$out" "$out.log" || { echo "the error does not say the disk is full or name the folder:"; cat "$out.log"; exit 1; }
ck=$(ls -d "$out"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
[ -n "$ck" ] || { echo "no checkpoint was saved before the disk filled up"; cat "$out.log"; exit 1; }
"$bin" train $args --resume > "$out.resume.log" 2>&1 || { echo "resume failed"; cat "$out.resume.log"; exit 1; }
grep -q "resumed from $ck" "$out.resume.log" && grep -q "trained 6 steps" "$out.resume.log" \
  || { echo "did not resume from $ck and finish"; cat "$out.resume.log"; exit 1; }
echo "full spill disk: clean stop after $(basename "$ck"), resumed and finished"
