#!/bin/sh
# Data parallel over MPI ranks on this machine (`mpirun -np N oomless train`):
#  - 2 and 3 ranks give the 1-rank run's losses and final weights within fp32 rounding (the same global batch);
#  - a rerun with 2 ranks gives the same bytes (weights and optimizer state);
#  - a checkpoint of 3 ranks resumes on 2 ranks and on 1, each continuing as the 1-rank run does; one of 2 ranks
#    resumes on 2 to the uninterrupted run's bytes;
#  - ranks started with different settings stop with an error naming the rank, and leave no run folder;
#  - ZeRO stages 1, 2 and 3 (--zero 1, 2, 3): the same with the optimizer state (and gradients, and the layers'
#    weights) sharded, which every rank holds less of; stage 3 with a LoRA adapter (the frozen base's layer weights
#    sharded) gives the 1-rank run's losses and stage 1's adapter bit for bit; stages 2 and 3 with --chunk give the
#    1-rank chunked run's losses; stage 3 under bf16 compute sends the projection matrices in bf16 (fewer bytes, the
#    same weights as stage 2);
#  - gradients summed in bf16 (--grad-sum-dtype bf16): half the bytes, the 1-rank losses within 1e-4, rerun bitwise;
#  - a rank killed in the middle of a run stops the others within a minute, and its last checkpoint resumes.
# Skipped (77) when mpirun or an MPI build is missing.
# usage: dist_dp.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; work=$3/dist_dp
. "$src/tests/cli/dist_lib.sh"
args="--model preset:micro --data $src/data/kjv/eval.txt --seq 48 --batch 6 --eval-every 0 --threads 1 --lr 3e-3"

# A 4-step run folder as if it had stopped after its step-2 checkpoint.
back_to_step_2() {
  rm -rf "$1/checkpoint-4"
  python3 -c "
import json, sys
p = sys.argv[1]; lines = [l for l in open(p) if json.loads(l).get('step', 0) <= 2]
open(p, 'w').writelines(lines)" "$1/metrics.jsonl"
}
# `resume_from RUN "N [FLAGS]"`: RUN cut back to its step-2 checkpoint, continued on N ranks with FLAGS: the 1-rank
# losses.
resume_from() {
  n=${2%% *}; tag=$1-to-$n
  cp -r "$work/$1" "$work/$tag" && back_to_step_2 "$work/$tag"
  mpi $n train $args --steps 4 --save-every 2 ${2#$n} --out "$work/$tag" --resume > "$work/$tag.log" 2>&1 \
    || { echo "$1 -> $2: resume failed"; cat "$work/$tag.log"; exit 1; }
  got=$(losses "$work/$tag/metrics.jsonl")
  same_losses "$ref" "$got" || { echo "$1 -> $2: losses $got, 1 rank: $ref"; exit 1; }
}
"$bin" train $args --steps 4 --save-every 2 --out "$work/one" > "$work/one.log" 2>&1 || { echo "1 rank failed"; cat "$work/one.log"; exit 1; }
ref=$(losses "$work/one/metrics.jsonl")
for n in 2 3; do
  mpi $n train $args --steps 4 --save-every 2 --out "$work/r$n" > "$work/r$n.log" 2>&1 || { echo "$n ranks failed"; cat "$work/r$n.log"; exit 1; }
  got=$(losses "$work/r$n/metrics.jsonl")
  same_losses "$ref" "$got" || { echo "$n ranks: losses $got, 1 rank: $ref"; exit 1; }
  close "$work/one/checkpoint-4/model.safetensors" "$work/r$n/checkpoint-4/model.safetensors" 1e-5 \
    || { echo "$n ranks: final weights differ from 1 rank's"; exit 1; }
  grep -q "\"ranks\":{\"size\":$n" "$work/r$n/metrics.jsonl" || { echo "$n ranks: no per-rank memory in metrics.jsonl"; exit 1; }
  echo "$n ranks: the 1-rank losses ($got) and weights"
done

mpi 2 train $args --steps 4 --save-every 2 --out "$work/r2b" > "$work/r2b.log" 2>&1 || { echo "2 ranks again failed"; cat "$work/r2b.log"; exit 1; }
for f in model.safetensors optimizer.safetensors; do
  cmp -s "$work/r2/checkpoint-4/$f" "$work/r2b/checkpoint-4/$f" || { echo "2 ranks twice: $f differs"; exit 1; }
done
echo "2 ranks twice: the same bytes"

# A 3-rank run's step-2 checkpoint, continued on 2 ranks and on 1 rank.
for n in 2 1; do
  resume_from r3 "$n"
  close "$work/one/checkpoint-4/model.safetensors" "$work/r3-to-$n/checkpoint-4/model.safetensors" 1e-5 \
    || { echo "3 ranks -> $n: final weights differ from 1 rank's"; exit 1; }
  echo "3 ranks' checkpoint resumed on $n: the 1-rank losses"
done

# The 2-rank run's step-2 checkpoint resumed on 2 ranks: the uninterrupted run's bytes.
cp -r "$work/r2" "$work/again2" && back_to_step_2 "$work/again2"
mpi 2 train $args --steps 4 --save-every 2 --out "$work/again2" --resume > "$work/again2.log" 2>&1 \
  || { echo "2 ranks -> 2: resume failed"; cat "$work/again2.log"; exit 1; }
cmp -s "$work/r2/checkpoint-4/model.safetensors" "$work/again2/checkpoint-4/model.safetensors" \
  || { echo "2 ranks -> 2: resumed weights differ from the uninterrupted run's"; exit 1; }
echo "2 ranks' checkpoint resumed on 2: the uninterrupted run's bytes"

# ZeRO stages 1 and 2: `zero_run STAGE N TAG` runs N ranks under --zero STAGE and checks the 1-rank losses, weights
# and optimizer file (rank 0 writes every rank's part).
zero_run() {  # STAGE N TAG [FLAGS]
  mpi $2 train $args --steps 4 --save-every 2 --zero $1 ${4:-} --out "$work/$3" > "$work/$3.log" 2>&1 || { echo "zero $1, $2 ranks failed"; cat "$work/$3.log"; exit 1; }
  got=$(losses "$work/$3/metrics.jsonl")
  same_losses "$ref" "$got" || { echo "zero $1, $2 ranks: losses $got, 1 rank: $ref"; exit 1; }
  for f in model optimizer; do
    close "$work/one/checkpoint-4/$f.safetensors" "$work/$3/checkpoint-4/$f.safetensors" 1e-5 \
      || { echo "zero $1, $2 ranks: $f.safetensors differs from 1 rank's"; exit 1; }
  done
}

# Stage 1 (--zero 1): the optimizer state sharded over the ranks. 2 and 3 ranks: the above, and --zero 0's weights
# bit for bit; a rerun the same bytes; its checkpoint resumed on 3 ranks with --zero 1 and on 1 rank without, as
# the 1-rank run continues; and each rank's ledger holding less optimizer state.
for n in 2 3; do
  zero_run 1 $n z$n
  cmp -s "$work/r$n/checkpoint-4/model.safetensors" "$work/z$n/checkpoint-4/model.safetensors" \
    || { echo "zero 1, $n ranks: weights differ from --zero 0's on $n ranks (the same sums in the same order)"; exit 1; }
  echo "zero 1, $n ranks: the 1-rank losses, weights and optimizer state; --zero 0's weights bit for bit"
done
mpi 2 train $args --steps 4 --save-every 2 --zero 1 --out "$work/z2b" > "$work/z2b.log" 2>&1 || { echo "zero 1 again failed"; cat "$work/z2b.log"; exit 1; }
for f in model.safetensors optimizer.safetensors; do
  cmp -s "$work/z2/checkpoint-4/$f" "$work/z2b/checkpoint-4/$f" || { echo "zero 1, 2 ranks twice: $f differs"; exit 1; }
done
echo "zero 1, 2 ranks twice: the same bytes"
python3 -c "
import json, sys
zero = [json.loads(l) for l in open(sys.argv[1]) if '\"train\"' in l][-1]
plain = [json.loads(l) for l in open(sys.argv[2]) if '\"train\"' in l][-1]
opt = lambda m: sum(m[t].get('optimizer', {}).get('peak', 0) for t in m if isinstance(m[t], dict))
assert opt(zero['memory']) < opt(plain['memory']), (opt(zero['memory']), opt(plain['memory']))
assert max(zero['ranks']['peak']) < max(plain['ranks']['peak']), (zero['ranks'], plain['ranks'])
print('zero 1, 3 ranks: rank 0 holds %d of %d optimizer bytes; peaks %s vs %s' % (opt(zero['memory']), opt(plain['memory']),
      zero['ranks']['peak'], plain['ranks']['peak']))" "$work/z3/metrics.jsonl" "$work/r3/metrics.jsonl" \
  || { echo "zero 1: no less optimizer state on the ranks"; exit 1; }
# `oomless estimate --ranks 3` (and with --zero 1): the largest rank's peak, within 1% of the runs' ledgers.
for z in 0 1; do
  run=r3; [ $z = 1 ] && run=z3
  estimate_is_ledger "$work/$run" $args --steps 4 --ranks 3 --zero $z \
    || { echo "estimate --ranks 3 --zero $z: not the ledger's peak"; exit 1; }
done
for to in "3 --zero 1" "1"; do
  resume_from z3 "$to"
  echo "zero 1: 3 ranks' checkpoint resumed on $to: the 1-rank losses"
done
cp -r "$work/z2" "$work/zagain" && back_to_step_2 "$work/zagain"
mpi 2 train $args --steps 4 --save-every 2 --zero 1 --out "$work/zagain" --resume > "$work/zagain.log" 2>&1 \
  || { echo "zero 1, 2 ranks -> 2: resume failed"; cat "$work/zagain.log"; exit 1; }
for f in model.safetensors optimizer.safetensors; do
  cmp -s "$work/z2/checkpoint-4/$f" "$work/zagain/checkpoint-4/$f" || { echo "zero 1, 2 ranks -> 2: $f differs"; exit 1; }
done
echo "zero 1: 2 ranks' checkpoint resumed on 2: the uninterrupted run's bytes"
# With the optimizer state on disk (ZeRO-Offload's place) and with a LoRA adapter (only its tensors sharded):
# 2 ranks under --zero 1 resumed on 3 give the 1-rank losses.
for extra in "--optim-state disk --spill-dir $work" "--lora 8"; do
  tag=$(echo "$extra" | tr -c 'a-z0-9\n' _ | cut -c1-20)
  "$bin" train $args $extra --steps 4 --out "$work/one$tag" > "$work/one$tag.log" 2>&1 || { echo "$extra: 1 rank failed"; cat "$work/one$tag.log"; exit 1; }
  mpi 2 train $args $extra --steps 4 --save-every 2 --zero 1 --out "$work/zx$tag" > "$work/zx$tag.log" 2>&1 \
    || { echo "$extra: 2 ranks failed"; cat "$work/zx$tag.log"; exit 1; }
  back_to_step_2 "$work/zx$tag"
  mpi 3 train $args $extra --steps 4 --save-every 2 --zero 1 --out "$work/zx$tag" --resume > "$work/zx$tag.2.log" 2>&1 \
    || { echo "$extra: resuming on 3 failed"; cat "$work/zx$tag.2.log"; exit 1; }
  want=$(losses "$work/one$tag/metrics.jsonl"); got=$(losses "$work/zx$tag/metrics.jsonl")
  same_losses "$want" "$got" || { echo "$extra: zero 1 on 2 then 3 ranks: losses $got, 1 rank: $want"; exit 1; }
  echo "zero 1 with $extra, 2 ranks then 3: the 1-rank losses"
done
# Stage 2 (--zero 2): the layers' gradients summed into their owners as backward finishes each layer (the
# model keeps one layer's). 2 and 3 ranks: the 1-rank losses, weights and optimizer state; a rerun the same
# bytes; resumed on 2 ranks and on 1; less gradient memory on every rank; the estimate the ledger's.
for n in 2 3; do
  zero_run 2 $n y$n
  estimate_is_ledger "$work/y$n" $args --steps 4 --ranks $n --zero 2 && holds_less "$work/y$n" "$work/one" grads \
    || { echo "zero 2, $n ranks: memory"; exit 1; }
  echo "zero 2, $n ranks: the 1-rank losses, weights and optimizer state"
done
# `rerun_and_resume STAGE TAG`: 2 ranks under --zero STAGE again give TAG2's bytes; TAG3's step-2 checkpoint resumed
# on 2 ranks (the same stage) and on 1 gives the 1-rank losses.
rerun_and_resume() {
  mpi 2 train $args --steps 4 --save-every 2 --zero $1 --out "$work/${2}2b" > "$work/${2}2b.log" 2>&1 \
    || { echo "zero $1 again failed"; exit 1; }
  for f in model.safetensors optimizer.safetensors; do
    cmp -s "$work/${2}2/checkpoint-4/$f" "$work/${2}2b/checkpoint-4/$f" || { echo "zero $1, 2 ranks twice: $f differs"; exit 1; }
  done
  for to in "2 --zero $1" "1"; do resume_from ${2}3 "$to"; done
  echo "zero $1: reruns bitwise; 3 ranks' checkpoint resumed on 2 and on 1"
}
rerun_and_resume 2 y
# Stage 3 (--zero 3): the layers' weights sharded too, each layer's sent to every rank before its forward and again
# before its backward. 2 ranks with --zero-prefetch no (one gathered layer), 3 with the default (the next layer sent
# while one computes, into a second copy): the 1-rank losses, weights and optimizer state, and --zero 2's weights
# bit for bit (the same values reach every product); the estimate the ledger's; with one gathered layer less weight
# memory on every rank (this model has two layers: with two copies a rank holds them all); a rerun with the default
# the same bytes as the first without prefetching; resumed on 2 ranks and on 1.
for n in 2 3; do
  pf=$([ $n = 2 ] && echo "--zero-prefetch no" || echo "")
  zero_run 3 $n x$n "$pf"
  cmp -s "$work/y$n/checkpoint-4/model.safetensors" "$work/x$n/checkpoint-4/model.safetensors" \
    || { echo "zero 3, $n ranks: weights differ from --zero 2's on $n ranks"; exit 1; }
  estimate_is_ledger "$work/x$n" $args --steps 4 --ranks $n --zero 3 $pf || { echo "zero 3, $n ranks: memory"; exit 1; }
  if [ -n "$pf" ]; then
    holds_less "$work/x$n" "$work/y$n" weights && holds_less "$work/x$n" "$work/y$n" peak \
      || { echo "zero 3, $n ranks: memory"; exit 1; }
  fi
  echo "zero 3, $n ranks ${pf:-(prefetching)}: the 1-rank losses, weights and optimizer state; --zero 2's weights bit for bit"
done
rerun_and_resume 3 x
# Stage 3 with a LoRA adapter (--zero 3 --lora 8): the frozen base's layer weights sharded and sent as above, the
# adapters whole on every rank (their optimizer state sharded as --zero 1 shards it). 2 ranks without prefetching and
# 3 with: the 1-rank losses and adapter, and --zero 1's adapter and optimizer state bit for bit on the same N (the
# same base values reach every product); less weight memory on every rank (without); the estimate the largest
# rank's ledger; the 3-rank checkpoint resumed on 1 rank continues as the 1-rank run does.
lref=$(losses "$work/one__lora_8/metrics.jsonl")  # the 1-rank LoRA run of the --zero 1 checks above
for n in 2 3; do
  pf=$([ $n = 2 ] && echo "--zero-prefetch no" || echo "")
  for z in 1 3; do
    mpi $n train $args --lora 8 --steps 4 --save-every 2 --zero $z $pf --out "$work/l${z}_$n" > "$work/l${z}_$n.log" 2>&1 \
      || { echo "--lora 8 --zero $z, $n ranks failed"; cat "$work/l${z}_$n.log"; exit 1; }
  done
  got=$(losses "$work/l3_$n/metrics.jsonl")
  same_losses "$lref" "$got" || { echo "--lora 8 --zero 3, $n ranks: losses $got, 1 rank: $lref"; exit 1; }
  close "$work/one__lora_8/checkpoint-4/adapter_model.safetensors" "$work/l3_$n/checkpoint-4/adapter_model.safetensors" 1e-5 \
    || { echo "--lora 8 --zero 3, $n ranks: the adapter differs from 1 rank's"; exit 1; }
  for f in adapter_model.safetensors optimizer.safetensors; do
    cmp -s "$work/l1_$n/checkpoint-4/$f" "$work/l3_$n/checkpoint-4/$f" \
      || { echo "--lora 8 --zero 3, $n ranks: $f differs from --zero 1's"; exit 1; }
  done
  estimate_is_ledger "$work/l3_$n" $args --lora 8 --steps 4 --ranks $n --zero 3 $pf \
    || { echo "--lora 8 --zero 3, $n ranks: memory"; exit 1; }
  [ -z "$pf" ] || holds_less "$work/l3_$n" "$work/one__lora_8" weights || { echo "--lora 8 --zero 3, $n ranks: memory"; exit 1; }
  echo "--lora 8 --zero 3, $n ranks: the 1-rank losses and adapter; --zero 1's adapter and optimizer state bit for bit"
done
ref_saved=$ref; ref=$lref; args_saved=$args; args="$args --lora 8"
resume_from l3_3 "1"
ref=$ref_saved; args=$args_saved
echo "--lora 8 --zero 3: 3 ranks' checkpoint resumed on 1: the 1-rank losses"
# Prefetching over six layers (micro's widths, six layers, random init: the pass turns, an evaluation between steps, a
# frozen base kept across steps): 2 ranks with --zero-prefetch yes, 3 (three layers ahead) and no give the same
# weights, full training and LoRA, to the byte; with 3 the estimate is the ledger's (four layers' storage).
"$bin" convert --model preset:micro --out "$work/micro" > /dev/null 2>&1 || { echo "convert preset:micro failed"; exit 1; }
mkdir -p "$work/six" && cp "$work/micro"/tokenizer*.json "$work/six/"
sed 's/"num_hidden_layers": 2/"num_hidden_layers": 6/' "$work/micro/config.json" > "$work/six/config.json"
grep -q '"num_hidden_layers": 6' "$work/six/config.json" || { echo "no six-layer config"; exit 1; }
targs="--model $work/six/config.json --data $src/data/kjv/eval.txt --eval-data $src/data/kjv/eval.txt --seq 32 \
--batch 4 --steps 3 --eval-every 1 --threads 1 --zero 3 --save-optimizer no"
for extra in "" "--lora 4"; do
  for pf in yes 3 no; do
    mpi 2 train $targs $extra --zero-prefetch $pf --out "$work/t$pf" > "$work/t$pf.log" 2>&1 \
      || { echo "six layers, --zero 3 $extra --zero-prefetch $pf failed"; cat "$work/t$pf.log"; exit 1; }
  done
  f=$([ -n "$extra" ] && echo adapter_model || echo model).safetensors
  for pf in yes 3; do
    cmp -s "$work/t$pf/checkpoint-3/$f" "$work/tno/checkpoint-3/$f" \
      || { echo "six layers, --zero 3 $extra: $f differs with --zero-prefetch $pf and without"; exit 1; }
    [ "$(losses "$work/t$pf/metrics.jsonl")" = "$(losses "$work/tno/metrics.jsonl")" ] \
      || { echo "six layers, --zero 3 $extra: losses differ with --zero-prefetch $pf and without"; exit 1; }
  done
  estimate_is_ledger "$work/t3" $targs $extra --zero-prefetch 3 --ranks 2 \
    || { echo "six layers, --zero 3 $extra --zero-prefetch 3: memory"; exit 1; }
  holds_less "$work/tno" "$work/t3" weights || { echo "six layers, --zero 3 $extra: no less held without prefetching"; exit 1; }
  rm -rf "$work/tyes" "$work/t3" "$work/tno"
  echo "six layers, --zero 3 $extra: the same bytes with one and three layers sent ahead and without"
done
# bf16 compute under --zero 3 (six layers, 2 ranks): the projection matrices travel in bf16, the values the products
# read (each owner rounds its own, the others widen them on arrival), so the weights are --zero 2's bit for bit (full
# training) and the adapter --zero 1's (LoRA), fewer bytes are sent than by the same run in fp32, and the estimate
# is the ledger's.
sent() { python3 -c "import json,sys; print(sum([json.loads(l) for l in open(sys.argv[1]) if '\"train\"' in l][-1]['ranks']['bytes_sent']))" "$1"; }
bargs=$(echo "$targs" | sed 's/ --zero 3//')
for extra in "" "--lora 4"; do
  z=$([ -n "$extra" ] && echo 1 || echo 2)
  for run in "b3 --zero 3 --dtype bf16" "b$z --zero $z --dtype bf16" "f3 --zero 3 --dtype fp32"; do
    mpi 2 train $bargs $extra ${run#* } --out "$work/${run%% *}" > "$work/${run%% *}.log" 2>&1 \
      || { echo "six layers, $extra ${run#* } failed"; cat "$work/${run%% *}.log"; exit 1; }
  done
  f=$([ -n "$extra" ] && echo adapter_model || echo model).safetensors
  cmp -s "$work/b3/checkpoint-3/$f" "$work/b$z/checkpoint-3/$f" \
    || { echo "six layers, bf16 $extra: --zero 3's $f differs from --zero $z's"; exit 1; }
  [ "$(sent "$work/b3/metrics.jsonl")" -lt "$(sent "$work/f3/metrics.jsonl")" ] \
    || { echo "six layers, bf16 $extra --zero 3: $(sent "$work/b3/metrics.jsonl") bytes sent, fp32 $(sent "$work/f3/metrics.jsonl")"; exit 1; }
  estimate_is_ledger "$work/b3" $bargs $extra --zero 3 --dtype bf16 --ranks 2 || { echo "six layers, bf16 $extra --zero 3: memory"; exit 1; }
  rm -rf "$work/b3" "$work/b$z" "$work/f3"
  echo "six layers, bf16 $extra --zero 3: --zero $z's $f bit for bit, fewer bytes sent than in fp32"
done
# Gradients summed in bf16 (--grad-sum-dtype bf16, 2 ranks): plain data parallel sends half the bytes of the fp32
# run; with --zero 0, 1 and 2 the losses stay within 1e-4 of the 1-rank run's (each rank's gradient rounded to
# bf16: the fp32 sums agree to 1e-6) and the weights within 5% of the largest entry of each tensor (Adam's steps on
# entries whose gradient is near zero move most); a rerun gives the same bytes. An unknown dtype is refused.
for run in "hf --zero 0 --grad-sum-dtype fp32" "h0 --zero 0 --grad-sum-dtype bf16" "h0b --zero 0 --grad-sum-dtype bf16" \
           "h1 --zero 1 --grad-sum-dtype bf16" "h2 --zero 2 --grad-sum-dtype bf16"; do
  tag=${run%% *}
  mpi 2 train $args --steps 4 --save-every 4 ${run#* } --out "$work/$tag" > "$work/$tag.log" 2>&1 \
    || { echo "${run#* }, 2 ranks failed"; cat "$work/$tag.log"; exit 1; }
done
for tag in h0 h1 h2; do
  got=$(losses "$work/$tag/metrics.jsonl")
  near_losses "$ref" "$got" || { echo "$tag: bf16 sums, 2 ranks: losses $got, 1 rank: $ref"; exit 1; }
  close "$work/one/checkpoint-4/model.safetensors" "$work/$tag/checkpoint-4/model.safetensors" 0.05 \
    || { echo "$tag: bf16 sums, 2 ranks: weights"; exit 1; }
done
cmp -s "$work/h0/checkpoint-4/model.safetensors" "$work/h0b/checkpoint-4/model.safetensors" \
  || { echo "bf16 sums: a rerun gives other weights"; exit 1; }
[ "$(sent "$work/h0/metrics.jsonl")" -le "$(( $(sent "$work/hf/metrics.jsonl") * 51 / 100 ))" ] \
  || { echo "bf16 sums: $(sent "$work/h0/metrics.jsonl") bytes sent, fp32 $(sent "$work/hf/metrics.jsonl")"; exit 1; }
mpi 2 train $args --steps 1 --grad-sum-dtype fp16 --out "$work/bad" > "$work/bad.log" 2>&1 && { echo "--grad-sum-dtype fp16: ran"; exit 1; }
grep -q "grad-sum-dtype fp16" "$work/bad.log" || { echo "--grad-sum-dtype fp16: no error naming it"; cat "$work/bad.log"; exit 1; }
rm -rf "$work/bad" "$work/hf" "$work/h0" "$work/h0b" "$work/h1" "$work/h2"
echo "bf16 gradient sums, 2 ranks, --zero 0/1/2: the 1-rank losses within 1e-4, half the bytes, the same bytes rerun"
# Stages 2 and 3 with chunk-recurrent training (--chunk 16): each chunk's layer gradients summed into their owners
# as its backward finishes the layer, each layer's weights gathered for every chunk's pass. 2 ranks under --zero 2
# and 3 under --zero 3 give the 1-rank --chunk 16 run's losses, and the estimate is the largest rank's ledger peak.
"$bin" train $args --steps 4 --chunk 16 --out "$work/k1" > "$work/k1.log" 2>&1 || { echo "--chunk 16, 1 rank failed"; cat "$work/k1.log"; exit 1; }
for run in "2 --zero 2" "3 --zero 3"; do
  n=${run%% *}; tag=k$n
  mpi $n train $args --steps 4 --chunk 16 ${run#$n} --out "$work/$tag" > "$work/$tag.log" 2>&1 \
    || { echo "--chunk 16 $run ranks failed"; cat "$work/$tag.log"; exit 1; }
  want=$(losses "$work/k1/metrics.jsonl"); got=$(losses "$work/$tag/metrics.jsonl")
  same_losses "$want" "$got" || { echo "--chunk 16, $run ranks: losses $got, 1 rank: $want"; exit 1; }
  estimate_is_ledger "$work/$tag" $args --steps 4 --chunk 16 --ranks $n ${run#$n} \
    || { echo "--chunk 16, $run ranks: the estimate is not the ledger's peak"; exit 1; }
  echo "--chunk 16, $run ranks: the 1-rank losses; the estimate the ledger's"
done
for bad in "--zero 4" "--zero 2 --lora 8" "--zero 3 --lora 8 --dora" "--zero 3 --lora 8 --qlora" \
           "--zero 3 --zero-prefetch maybe" "--zero 3 --zero-prefetch 4"; do
  mpi 2 train $args --steps 1 $bad --out "$work/bad" > "$work/bad.log" 2>&1 && { echo "$bad: ran"; exit 1; }
  grep -q "zero" "$work/bad.log" || { echo "$bad: no error naming --zero"; cat "$work/bad.log"; exit 1; }
  rm -rf "$work/bad"
done
echo "--zero 4, --zero 2 with --lora, --zero 3 with DoRA or a quantised base, an unknown or too deep --zero-prefetch: refused"

# Other settings on one rank (an MPMD launch): an error naming it, from every rank; no folder left.
mpirun -np 1 "$bin" train $args --steps 2 --out "$work/mixed" : -np 1 "$bin" train $args --steps 2 --lr 1e-3 --out "$work/mixed" \
  > "$work/mixed.log" 2>&1 && { echo "mixed settings: ran"; exit 1; }
grep -q "rank 1 was started with other settings than rank 0" "$work/mixed.log" || { echo "mixed settings: no such error"; cat "$work/mixed.log"; exit 1; }
[ ! -e "$work/mixed" ] || { echo "mixed settings: left $work/mixed"; exit 1; }
echo "mixed settings: refused"

# A batch the ranks cannot share evenly.
mpi 4 train $args --steps 1 --out "$work/uneven" > "$work/uneven.log" 2>&1 && { echo "6 sequences on 4 ranks: ran"; exit 1; }
grep -q "4 ranks share each step's --batch x --grad-accum = 6 sequences" "$work/uneven.log" || { echo "uneven: no such error"; cat "$work/uneven.log"; exit 1; }
echo "6 sequences on 4 ranks: refused"

# A rank killed mid-run: the job ends (non-zero) within a minute and the last checkpoint resumes.
mpirun -np 2 "$bin" train $args --steps 100000 --save-every 2 --out "$work/killed" > "$work/killed.log" 2>&1 &
launcher=$!
i=0
until ls -d "$work/killed"/checkpoint-* > /dev/null 2>&1; do
  i=$((i + 1)); [ $i -le 600 ] || { echo "kill: no checkpoint after 60 s"; kill $launcher; exit 1; }
  sleep 0.1
done
victim=$(pgrep -P $launcher | tail -n 1)
[ -n "$victim" ] || { echo "kill: no rank process found"; kill $launcher; exit 1; }
kill -9 "$victim"
i=0
while kill -0 $launcher 2> /dev/null; do
  i=$((i + 1)); [ $i -le 600 ] || { echo "kill: the other rank still runs after 60 s"; kill -9 $launcher; exit 1; }
  sleep 0.1
done
wait $launcher && { echo "kill: the launcher reported success"; exit 1; }
last=$(ls -d "$work/killed"/checkpoint-* | sort -t- -k2 -n | tail -n 1)
step=${last##*-}
"$bin" train $args --steps $((step + 2)) --save-every 2 --out "$work/killed" --resume > "$work/killed.2.log" 2>&1 \
  || { echo "kill: resuming $last failed"; cat "$work/killed.2.log"; exit 1; }
echo "rank killed after $last: the run stopped, and resumed from it"
