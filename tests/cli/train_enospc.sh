#!/bin/sh
# A full disk while saving (OOMLESS_FAULT_ENOSPC_AFTER: writes fail with ENOSPC past N bytes) stops the run
# with a clear error and leaves the previous checkpoint intact: a later --resume continues from it.
# usage: train_enospc.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; out=$3/train_enospc
rm -rf "$out"
args="--model preset:micro --data $src/data/kjv/eval.txt --seq 32 --batch 2 --save-every 2 --eval-every 0 --keep 0"
"$bin" train $args --steps 4 --out "$out" > "$out.log" 2>&1 || { echo "first run failed"; cat "$out.log"; exit 1; }
rm -rf "$out/checkpoint-4"
OOMLESS_FAULT_ENOSPC_AFTER=100000 "$bin" train $args --steps 4 --out "$out" --resume > "$out.full.log" 2>&1
rc=$?
[ $rc -ne 0 ] || { echo "expected a failure on a full disk"; exit 1; }
grep -q "no space left on device" "$out.full.log" || { echo "no clear ENOSPC message"; cat "$out.full.log"; exit 1; }
grep -q "previous checkpoint is intact" "$out.full.log" || { echo "message does not say the checkpoint is intact"; cat "$out.full.log"; exit 1; }
[ ! -e "$out/checkpoint-4" ] || { echo "a partial checkpoint-4 was left"; exit 1; }
"$bin" train $args --steps 4 --out "$out" --resume > "$out.again.log" 2>&1 || { echo "resume after ENOSPC failed"; cat "$out.again.log"; exit 1; }
grep -q "resumed from .*checkpoint-2" "$out.again.log" || { echo "did not resume from checkpoint-2"; exit 1; }
echo "ENOSPC: clear error, checkpoint-2 intact, resumed from it"
