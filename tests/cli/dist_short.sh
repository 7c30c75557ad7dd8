#!/bin/sh
# Every distributed path once, on the fewest ranks that take it: the sanitizer build's share of the MPI tests
# (dist_dp.sh and dist_cp.sh, the whole matrix, run in the other builds). Data parallel, ZeRO stages 1, 2 and 3
# on 2 ranks, context parallel on 2, and beside data parallel on 4 (2 groups of 2): each gives the 1-rank run's
# losses and evaluations (fp32 rounding) and writes its checkpoint through rank 0; page-sparse context parallel
# on 3 ranks gives the 1-rank run's in chunks, zigzag on 3 the 1-rank run's, ZeRO stage 3 with a LoRA adapter
# on 2 the 1-rank LoRA run's, stage 3 under bf16 compute stage 2's weights, and gradients summed in bf16 (--zero 0
# and 2) the 1-rank run's within 1e-4.
# Skipped (77) when mpirun or an MPI build is missing.
# usage: dist_short.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; work=$3/dist_short
. "$src/tests/cli/dist_lib.sh"
args="--model preset:micro --data $src/data/kjv/eval.txt --eval-data $src/data/kjv/eval.txt --seq 48 --batch 4 \
--steps 2 --eval-every 1 --threads 1 --lr 3e-3"
evals() { python3 -c "import json,sys; print(' '.join('%.9f' % json.loads(l)['loss'] for l in open(sys.argv[1]) if '\"eval\"' in l))" "$1"; }

"$bin" train $args --out "$work/one" > "$work/one.log" 2>&1 || { echo "1 rank failed"; cat "$work/one.log"; exit 1; }
ref="$(losses "$work/one/metrics.jsonl") / $(evals "$work/one/metrics.jsonl")"
for run in "2" "2 --zero 1" "2 --zero 2" "2 --zero 3" "2 --context-parallel 2" "4 --context-parallel 2"; do
  n=${run%% *}; tag=$(echo "$run" | tr -c 'a-z0-9\n' _)
  mpi $n train $args ${run#$n} --out "$work/$tag" > "$work/$tag.log" 2>&1 || { echo "$run: failed"; cat "$work/$tag.log"; exit 1; }
  [ -f "$work/$tag/checkpoint-2/model.safetensors" ] || { echo "$run: no checkpoint"; exit 1; }
  got="$(losses "$work/$tag/metrics.jsonl") / $(evals "$work/$tag/metrics.jsonl")"
  same_losses "$(echo "$ref" | tr -d /)" "$(echo "$got" | tr -d /)" || { echo "$run ranks: $got, 1 rank: $ref"; exit 1; }
  echo "$run ranks: the 1-rank losses and evaluations"
done

# Page-sparse context parallel on 3 ranks (every rank both asks for pages and serves them): the 1-rank run in chunks
# of a slice.
sargs="$args --page 4 --sparse-pages 1"
"$bin" train $sargs --chunk 16 --out "$work/sone" > "$work/sone.log" 2>&1 || { echo "sparse, 1 rank failed"; cat "$work/sone.log"; exit 1; }
mpi 3 train $sargs --context-parallel 3 --out "$work/s3" > "$work/s3.log" 2>&1 || { echo "sparse, 3 ranks failed"; cat "$work/s3.log"; exit 1; }
want="$(losses "$work/sone/metrics.jsonl") $(evals "$work/sone/metrics.jsonl")"
got="$(losses "$work/s3/metrics.jsonl") $(evals "$work/s3/metrics.jsonl")"
same_losses "$want" "$got" || { echo "sparse, 3 ranks: $got, 1 rank in chunks: $want"; exit 1; }
echo "sparse context parallel, 3 ranks: the 1-rank losses and evaluations in chunks of 16"
mpi 3 train $args --context-parallel 3 --cp-split zigzag --out "$work/zz3" > "$work/zz3.log" 2>&1 \
  || { echo "zigzag, 3 ranks failed"; cat "$work/zz3.log"; exit 1; }
got="$(losses "$work/zz3/metrics.jsonl") / $(evals "$work/zz3/metrics.jsonl")"
same_losses "$(echo "$ref" | tr -d /)" "$(echo "$got" | tr -d /)" || { echo "zigzag, 3 ranks: $got, 1 rank: $ref"; exit 1; }
echo "zigzag context parallel, 3 ranks: the 1-rank losses and evaluations"
# ZeRO stage 3 with a LoRA adapter on 2 ranks (the frozen base's layer weights sharded): the 1-rank LoRA run's.
"$bin" train $args --lora 8 --out "$work/lone" > "$work/lone.log" 2>&1 || { echo "LoRA, 1 rank failed"; cat "$work/lone.log"; exit 1; }
mpi 2 train $args --lora 8 --zero 3 --out "$work/l3" > "$work/l3.log" 2>&1 || { echo "LoRA, --zero 3 failed"; cat "$work/l3.log"; exit 1; }
want="$(losses "$work/lone/metrics.jsonl") $(evals "$work/lone/metrics.jsonl")"
got="$(losses "$work/l3/metrics.jsonl") $(evals "$work/l3/metrics.jsonl")"
same_losses "$want" "$got" || { echo "LoRA, --zero 3 on 2 ranks: $got, 1 rank: $want"; exit 1; }
echo "LoRA with --zero 3, 2 ranks: the 1-rank losses and evaluations"
# ZeRO stage 3 under bf16 compute on 2 ranks (the projection matrices sent in bf16): stage 2's weights bit for bit.
for z in 2 3; do
  mpi 2 train $args --dtype bf16 --zero $z --out "$work/b$z" > "$work/b$z.log" 2>&1 \
    || { echo "bf16, --zero $z failed"; cat "$work/b$z.log"; exit 1; }
done
cmp -s "$work/b2/checkpoint-2/model.safetensors" "$work/b3/checkpoint-2/model.safetensors" \
  || { echo "bf16, --zero 3 on 2 ranks: the weights differ from --zero 2's"; exit 1; }
echo "bf16 with --zero 3, 2 ranks: --zero 2's weights bit for bit"
# Gradients summed in bf16 on 2 ranks, all-reduced (--zero 0) and summed into their owners (--zero 2): the 1-rank
# losses and evaluations within 1e-4.
for z in 0 2; do
  mpi 2 train $args --grad-sum-dtype bf16 --zero $z --out "$work/h$z" > "$work/h$z.log" 2>&1 \
    || { echo "bf16 sums, --zero $z failed"; cat "$work/h$z.log"; exit 1; }
  got="$(losses "$work/h$z/metrics.jsonl") $(evals "$work/h$z/metrics.jsonl")"
  near_losses "$(echo "$ref" | tr -d /)" "$got" || { echo "bf16 sums, --zero $z on 2 ranks: $got, 1 rank: $ref"; exit 1; }
done
echo "bf16 gradient sums, --zero 0 and 2, 2 ranks: the 1-rank losses and evaluations within 1e-4"
