#!/bin/sh
# SIGINT during `oomless train`: the run finishes its current step, saves it and exits with 130; the
# checkpoint verifies and --resume continues to the planned total.
# usage: train_sigint.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; out=$3/train_sigint
rm -rf "$out" "$out.log" "$out.resume.log"  # a stale log would end the wait below at once
"$bin" train --model preset:micro --data "$src/data/kjv/eval.txt" --seq 64 --batch 2 --steps 20000 --save-every 0 \
  --eval-every 0 --out "$out" > "$out.log" 2>&1 &
pid=$!
# Wait until training is under way (a few steps logged), then interrupt.
i=0
while [ $i -lt 600 ]; do
  if grep -q "^step 3/" "$out.log" 2>/dev/null; then break; fi
  sleep 0.1; i=$((i + 1))
done
kill -INT $pid
wait $pid
rc=$?
[ $rc -eq 130 ] || { echo "expected exit code 130 after SIGINT, got $rc"; cat "$out.log"; exit 1; }
ck=$(ls -d "$out"/checkpoint-* 2>/dev/null | head -1)
[ -n "$ck" ] || { echo "no checkpoint saved on SIGINT"; cat "$out.log"; exit 1; }
step=${ck##*-}
[ "$step" -ge 3 ] && [ "$step" -lt 20000 ] || { echo "unexpected checkpoint step $step"; exit 1; }
"$bin" train --model preset:micro --data "$src/data/kjv/eval.txt" --seq 64 --batch 2 --steps $((step + 2)) \
  --save-every 0 --eval-every 0 --out "$out" --resume > "$out.resume.log" 2>&1 \
  || { echo "resume failed"; cat "$out.resume.log"; exit 1; }
grep -q "resumed from .*checkpoint-$step" "$out.resume.log" || { echo "did not resume from checkpoint-$step"; exit 1; }
echo "SIGINT saved checkpoint-$step and the run resumed from it"
