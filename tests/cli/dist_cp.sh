#!/bin/sh
# Context parallel over MPI ranks on this machine (`mpirun -np N oomless train --context-parallel N`): every
# sequence spread over the ranks in consecutive slices, each rank's queries attending to the earlier slices' keys.
#  - 2 and 4 ranks give the 1-rank run's losses, evaluations and gradient norms within fp32 rounding, and its
#    final weights within 2e-4 of their largest entry;
#  - a rerun with 2 ranks gives the same bytes, and so does one over a simulated slow link (OOMLESS_DIST_LINK);
#  - beside data parallel (4 ranks, --context-parallel 2: two groups of two), the 1-rank results as well;
#  - page-sparse (--sparse-pages): 2 and 4 ranks give the 1-rank run in chunks of a slice, send fewer bytes than the
#    dense ring, and the estimate is the ledger's;
#  - zigzag (--cp-split zigzag): 2 and 4 ranks, and 4 as 2 groups, give the 1-rank run and the estimate is the
#    ledger's (3 ranks: dist_short.sh); a rerun the same bytes;
#  - with --zero 1 (the optimizer state sharded as well): the 1-rank losses; with --zero 2 and 3 (gradients and the
#    layers' weights too), dense, zigzag and page-sparse: the 1-rank losses and the estimate the ledger's; under bf16
#    compute on tiny, the 1-rank losses within bf16 rounding;
#  - each rank holds a quarter of the activations on 4 ranks, and `oomless estimate --ranks 4 --context-parallel
#    4` gives the largest rank's ledger peak (within 1%); over budget without it, the estimate offers it;
#  - the 4-rank run's step-2 checkpoint resumes on 2 ranks and on 1, as the 1-rank run continues;
#  - bad settings stop with a message that names the fix: N not a divisor of the ranks, --seq not a multiple of N,
#    --chunk or --act-offload beside it, a --page that does not divide a sparse slice, a zigzag --seq not a
#    multiple of 2N, zigzag beside --sparse-pages, an unknown --cp-split or one without --context-parallel, an
#    OOMLESS_DIST_LINK that is not LATENCY_US,GB_PER_S.
# Skipped (77) when mpirun or an MPI build is missing.
# usage: dist_cp.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; work=$3/dist_cp
. "$src/tests/cli/dist_lib.sh"
args="--model preset:micro --data $src/data/kjv/eval.txt --eval-data $src/data/kjv/eval.txt --seq 48 --batch 2 \
--eval-every 2 --threads 1 --lr 3e-3 --steps 4 --save-every 2"
norms() { python3 -c "import json,sys; print(' '.join('%.12g' % json.loads(l)['grad_norm'] for l in open(sys.argv[1]) if '\"train\"' in l))" "$1"; }
evals() { python3 -c "import json,sys; print(' '.join('%.9f' % json.loads(l)['loss'] for l in open(sys.argv[1]) if '\"eval\"' in l))" "$1"; }
activations() {  # rank 0's peak activation bytes in the last step line
  python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if '\"train\"' in l][-1]['memory']['device']['activations']['peak'])" "$1"
}

"$bin" train $args --out "$work/one" > "$work/one.log" 2>&1 || { echo "1 rank failed"; cat "$work/one.log"; exit 1; }
ref=$(losses "$work/one/metrics.jsonl"); ref_eval=$(evals "$work/one/metrics.jsonl")
[ -n "$ref_eval" ] || { echo "1 rank: no evaluation in metrics.jsonl"; exit 1; }
for n in 2 4; do
  mpi $n train $args --context-parallel $n --out "$work/c$n" > "$work/c$n.log" 2>&1 \
    || { echo "$n ranks failed"; cat "$work/c$n.log"; exit 1; }
  got=$(losses "$work/c$n/metrics.jsonl"); got_eval=$(evals "$work/c$n/metrics.jsonl")
  same_losses "$ref" "$got" || { echo "$n ranks: losses $got, 1 rank: $ref"; exit 1; }
  same_losses "$ref_eval" "$got_eval" || { echo "$n ranks: evaluations $got_eval, 1 rank: $ref_eval"; exit 1; }
  same_losses "$(norms "$work/one/metrics.jsonl")" "$(norms "$work/c$n/metrics.jsonl")" \
    || { echo "$n ranks: gradient norms differ from 1 rank's"; exit 1; }
  # 2e-4: the gradients agree to about 1e-8 (the grad norms), but Adam's first steps divide each entry by its own
  # size, so an entry near zero carries its fp32 rounding into the update (data parallel's sums differ less).
  close "$work/one/checkpoint-4/model.safetensors" "$work/c$n/checkpoint-4/model.safetensors" 2e-4 \
    || { echo "$n ranks: final weights differ from 1 rank's"; exit 1; }
  echo "$n ranks: the 1-rank losses ($got), evaluations and weights"
done

mpi 2 train $args --context-parallel 2 --out "$work/c2b" > "$work/c2b.log" 2>&1 || { echo "2 ranks again failed"; cat "$work/c2b.log"; exit 1; }
for f in model.safetensors optimizer.safetensors; do
  cmp -s "$work/c2/checkpoint-4/$f" "$work/c2b/checkpoint-4/$f" || { echo "2 ranks twice: $f differs"; exit 1; }
done
echo "2 ranks twice: the same bytes"

# Beside data parallel: 4 ranks as 2 groups of 2 (--context-parallel 2), each group its share of the step's
# sequences: the 1-rank losses, evaluations, norms and weights; the estimate the largest rank's ledger peak.
mpi 4 train $args --context-parallel 2 --out "$work/g2" > "$work/g2.log" 2>&1 || { echo "4 ranks in 2 groups failed"; cat "$work/g2.log"; exit 1; }
got=$(losses "$work/g2/metrics.jsonl"); got_eval=$(evals "$work/g2/metrics.jsonl")
same_losses "$ref" "$got" || { echo "4 ranks in 2 groups: losses $got, 1 rank: $ref"; exit 1; }
same_losses "$ref_eval" "$got_eval" || { echo "4 ranks in 2 groups: evaluations $got_eval, 1 rank: $ref_eval"; exit 1; }
same_losses "$(norms "$work/one/metrics.jsonl")" "$(norms "$work/g2/metrics.jsonl")" \
  || { echo "4 ranks in 2 groups: gradient norms differ from 1 rank's"; exit 1; }
close "$work/one/checkpoint-4/model.safetensors" "$work/g2/checkpoint-4/model.safetensors" 2e-4 \
  || { echo "4 ranks in 2 groups: final weights differ from 1 rank's"; exit 1; }
estimate_is_ledger "$work/g2" $args --ranks 4 --context-parallel 2 \
  || { echo "estimate --ranks 4 --context-parallel 2: not the ledger's peak"; exit 1; }
echo "4 ranks as 2 groups of 2: the 1-rank losses ($got), evaluations and weights; the estimate the ledger's"

# A simulated slow link (OOMLESS_DIST_LINK: 2 ms latency, 50 MB/s) only delays the messages: the same bytes.
OOMLESS_DIST_LINK=2000,0.05 mpi 2 train $args --context-parallel 2 --out "$work/c2slow" > "$work/c2slow.log" 2>&1 \
  || { echo "2 ranks on a simulated link failed"; cat "$work/c2slow.log"; exit 1; }
cmp -s "$work/c2/checkpoint-4/model.safetensors" "$work/c2slow/checkpoint-4/model.safetensors" \
  || { echo "2 ranks on a simulated link: weights differ"; exit 1; }
echo "2 ranks on a simulated slow link: the same bytes"

# Page-sparse (--sparse-pages 1 --page 4: each query page reads its slice, the first page and its best earlier
# page): N ranks give the 1-rank run with chunks of a slice (--chunk 48/N, the same selection), and send fewer bytes
# than the dense ring; the estimate is the largest rank's ledger peak.
sargs="$args --page 4 --sparse-pages 1"
for n in 2 4; do
  "$bin" train $sargs --chunk $((48 / n)) --out "$work/sone$n" > "$work/sone$n.log" 2>&1 \
    || { echo "sparse, 1 rank, chunks of $((48 / n)) failed"; cat "$work/sone$n.log"; exit 1; }
  mpi $n train $sargs --context-parallel $n --out "$work/s$n" > "$work/s$n.log" 2>&1 \
    || { echo "sparse, $n ranks failed"; cat "$work/s$n.log"; exit 1; }
  want=$(losses "$work/sone$n/metrics.jsonl"); got=$(losses "$work/s$n/metrics.jsonl")
  same_losses "$want" "$got" || { echo "sparse, $n ranks: losses $got, 1 rank in chunks: $want"; exit 1; }
  same_losses "$(evals "$work/sone$n/metrics.jsonl")" "$(evals "$work/s$n/metrics.jsonl")" \
    || { echo "sparse, $n ranks: evaluations differ from 1 rank's in chunks"; exit 1; }
  same_losses "$(norms "$work/sone$n/metrics.jsonl")" "$(norms "$work/s$n/metrics.jsonl")" \
    || { echo "sparse, $n ranks: gradient norms differ from 1 rank's in chunks"; exit 1; }
  close "$work/sone$n/checkpoint-4/model.safetensors" "$work/s$n/checkpoint-4/model.safetensors" 2e-4 \
    || { echo "sparse, $n ranks: final weights differ from 1 rank's in chunks"; exit 1; }
  echo "sparse, $n ranks: the losses ($got), evaluations and weights of 1 rank in chunks of $((48 / n))"
done
[ "$(losses "$work/s4/metrics.jsonl")" != "$(losses "$work/c4/metrics.jsonl")" ] \
  || { echo "sparse, 4 ranks: the dense run's losses (no page was left out)"; exit 1; }
python3 -c "
import json, sys
last = lambda p: [json.loads(l) for l in open(p) if '\"train\"' in l][-1]['ranks']['bytes_sent']
s, d = sum(last(sys.argv[1])), sum(last(sys.argv[2]))
print('sparse, 4 ranks: %d bytes sent in 4 steps, dense %d' % (s, d))
sys.exit(0 if s < d else 1)" "$work/s4/metrics.jsonl" "$work/c4/metrics.jsonl" || { echo "sparse: not fewer bytes sent"; exit 1; }
estimate_is_ledger "$work/s4" $sargs --ranks 4 --context-parallel 4 \
  || { echo "estimate, sparse, 4 ranks: not the ledger's peak"; exit 1; }
echo "sparse, 4 ranks: the estimate the ledger's"

# Zigzag (--cp-split zigzag: rank r the pieces r and 2N-1-r of 2N): 2 and 4 ranks, and 4 as 2 groups of 2, give
# the 1-rank losses, evaluations, norms and weights; a rerun the same bytes; the estimate the largest rank's ledger.
for run in "2 --context-parallel 2" "4 --context-parallel 4" "4 --context-parallel 2"; do
  n=${run%% *}; tag=zz${n}_${run##* }
  mpi $n train $args ${run#$n} --cp-split zigzag --out "$work/$tag" > "$work/$tag.log" 2>&1 \
    || { echo "zigzag, $run: failed"; cat "$work/$tag.log"; exit 1; }
  got=$(losses "$work/$tag/metrics.jsonl"); got_eval=$(evals "$work/$tag/metrics.jsonl")
  same_losses "$ref" "$got" || { echo "zigzag, $run: losses $got, 1 rank: $ref"; exit 1; }
  same_losses "$ref_eval" "$got_eval" || { echo "zigzag, $run: evaluations $got_eval, 1 rank: $ref_eval"; exit 1; }
  same_losses "$(norms "$work/one/metrics.jsonl")" "$(norms "$work/$tag/metrics.jsonl")" \
    || { echo "zigzag, $run: gradient norms differ from 1 rank's"; exit 1; }
  close "$work/one/checkpoint-4/model.safetensors" "$work/$tag/checkpoint-4/model.safetensors" 2e-4 \
    || { echo "zigzag, $run: final weights differ from 1 rank's"; exit 1; }
  estimate_is_ledger "$work/$tag" $args --ranks $n ${run#$n} --cp-split zigzag \
    || { echo "estimate, zigzag, $run: not the ledger's peak"; exit 1; }
  echo "zigzag, $run: the 1-rank losses ($got), evaluations and weights; the estimate the ledger's"
done
mpi 2 train $args --context-parallel 2 --cp-split zigzag --out "$work/zzb" > "$work/zzb.log" 2>&1 \
  || { echo "zigzag, 2 ranks again failed"; cat "$work/zzb.log"; exit 1; }
cmp -s "$work/zz2_2/checkpoint-4/model.safetensors" "$work/zzb/checkpoint-4/model.safetensors" \
  || { echo "zigzag, 2 ranks twice: weights differ"; exit 1; }
echo "zigzag, 2 ranks twice: the same bytes"

mpi 2 train $args --context-parallel 2 --zero 1 --out "$work/z2" > "$work/z2.log" 2>&1 || { echo "--zero 1 failed"; cat "$work/z2.log"; exit 1; }
got=$(losses "$work/z2/metrics.jsonl")
same_losses "$ref" "$got" || { echo "--zero 1, 2 ranks: losses $got, 1 rank: $ref"; exit 1; }
echo "--zero 1 beside it, 2 ranks: the 1-rank losses"
# ZeRO stages 2 and 3 beside it (each rank's slice runs its layers' backward once, so the gradients can be summed
# into their owners layer by layer, and each layer's weights gathered before use): 2 ranks under --zero 2 and 3, 4
# as 2 groups of 2 zigzag under --zero 3 give the 1-rank losses and evaluations, and 4 page-sparse ranks under
# --zero 3 the 1-rank run's in chunks; each the estimate the largest rank's ledger peak.
for run in "2 --context-parallel 2 --zero 2" "2 --context-parallel 2 --zero 3" \
           "4 --context-parallel 2 --cp-split zigzag --zero 3" "4 --context-parallel 4 --page 4 --sparse-pages 1 --zero 3"; do
  n=${run%% *}; tag=$(echo "$run" | tr -c 'a-z0-9\n' _ | cut -c1-40)
  mpi $n train $args ${run#$n} --out "$work/$tag" > "$work/$tag.log" 2>&1 || { echo "$run: failed"; cat "$work/$tag.log"; exit 1; }
  case "$run" in *sparse*) want_dir=sone4 ;; *) want_dir=one ;; esac
  want="$(losses "$work/$want_dir/metrics.jsonl") $(evals "$work/$want_dir/metrics.jsonl")"
  got="$(losses "$work/$tag/metrics.jsonl") $(evals "$work/$tag/metrics.jsonl")"
  same_losses "$want" "$got" || { echo "$run: $got, 1 rank: $want"; exit 1; }
  estimate_is_ledger "$work/$tag" $args --ranks $n ${run#$n} \
    || { echo "estimate, $run: not the ledger's peak"; exit 1; }
  echo "$run: the 1-rank losses and evaluations; the estimate the ledger's"
done

# bf16 compute on tiny (D = 64: on an AMX CPU the attention's bf16 tiles): the 1-rank run's losses within 1e-4 and
# its first gradient norm within 1e-3 (bf16 rounding: each slice's probabilities are rounded against its own max).
within() {  # two lines of numbers, each within a relative TOL
  python3 -c "
import sys
a, b = [list(map(float, s.split())) for s in sys.argv[1:3]]
sys.exit(0 if len(a) == len(b) and all(abs(x - y) <= float(sys.argv[3]) * abs(x) for x, y in zip(a, b)) else 1)" "$1" "$2" "$3"
}
bargs="--model preset:tiny --data $src/data/kjv/eval.txt --seq 256 --batch 1 --steps 3 --dtype bf16 --eval-every 0 --threads 1 --lr 1e-3"
"$bin" train $bargs --out "$work/b1" > "$work/b1.log" 2>&1 || { echo "bf16, 1 rank failed"; cat "$work/b1.log"; exit 1; }
mpi 2 train $bargs --context-parallel 2 --out "$work/b2" > "$work/b2.log" 2>&1 || { echo "bf16, 2 ranks failed"; cat "$work/b2.log"; exit 1; }
l1=$(losses "$work/b1/metrics.jsonl"); l2=$(losses "$work/b2/metrics.jsonl")
within "$l1" "$l2" 1e-4 \
  && within "$(norms "$work/b1/metrics.jsonl" | cut -d' ' -f1)" "$(norms "$work/b2/metrics.jsonl" | cut -d' ' -f1)" 1e-3 \
  || { echo "bf16, 2 ranks: losses $l2, 1 rank: $l1"; exit 1; }
echo "bf16 compute, 2 ranks: the 1-rank losses ($l2) within bf16 rounding"

one=$(activations "$work/one/metrics.jsonl"); four=$(activations "$work/c4/metrics.jsonl")
[ "$((4 * four))" -eq "$one" ] || { echo "4 ranks: rank 0 holds $four activation bytes, 1 rank $one (not a quarter)"; exit 1; }
estimate_is_ledger "$work/c4" $args --ranks 4 --context-parallel 4 \
  || { echo "estimate --context-parallel 4: not the ledger's peak"; exit 1; }
"$bin" estimate $args --ranks 4 --context-parallel 4 | grep -q "one rank of 4 (context parallel: slices of 12 tokens)" \
  || { echo "estimate --context-parallel 4: its text does not say which rank and slice"; exit 1; }
echo "4 ranks: a quarter of the activations each ($four of $one bytes); the estimate the ledger's"
# Over budget on 4 ranks without it, the estimate offers --context-parallel 4 among the changes that fit.
"$bin" estimate $args --ranks 4 --budget "$(python3 -c "import json; print(json.load(open('$work/c4.estimate.json'))['estimate']['ram_peak'])")" \
  --json > "$work/est-over.json"
python3 -c "
import json, sys
e = json.load(open(sys.argv[1]))
sys.exit(0 if not e['fits'] and any(c['flags'] == '--context-parallel 4' for c in e['changes']) else 1)" "$work/est-over.json" \
  || { echo "estimate --ranks 4 over budget: --context-parallel 4 not offered"; cat "$work/est-over.json"; exit 1; }
echo "estimate --ranks 4 over budget: offers --context-parallel 4"

# The 4-rank run cut back to its step-2 checkpoint, continued on 2 ranks and on 1.
for to in "2 --context-parallel 2" "1 --context-parallel 1"; do
  n=${to%% *}; tag=c4-to-$n
  cp -r "$work/c4" "$work/$tag"
  rm -rf "$work/$tag/checkpoint-4"
  python3 -c "
import json, sys
p = sys.argv[1]; lines = [l for l in open(p) if json.loads(l).get('step', 0) <= 2]
open(p, 'w').writelines(lines)" "$work/$tag/metrics.jsonl"
  mpi $n train $args ${to#$n} --out "$work/$tag" --resume > "$work/$tag.log" 2>&1 \
    || { echo "4 ranks -> $to: resume failed"; cat "$work/$tag.log"; exit 1; }
  got=$(losses "$work/$tag/metrics.jsonl")
  same_losses "$ref" "$got" || { echo "4 ranks -> $to: losses $got, 1 rank: $ref"; exit 1; }
  echo "4 ranks' checkpoint resumed on $to: the 1-rank losses"
done

# Bad settings: each stops before training with a message naming the flag and the fix.
expect_error() {  # WANT N ARGS...: N ranks (0: no mpirun) fail and print WANT
  want=$1; n=$2; shift 2
  if [ "$n" = 0 ]; then "$bin" train "$@" > "$work/bad.log" 2>&1; else mpi "$n" train "$@" > "$work/bad.log" 2>&1; fi
  [ $? -ne 0 ] || { echo "$*: no error"; exit 1; }
  grep -q -- "$want" "$work/bad.log" || { echo "$*: no '$want' in:"; cat "$work/bad.log"; exit 1; }
}
expect_error "launch it with mpirun -np 2" 0 $args --context-parallel 2 --out "$work/bad1"
expect_error "use --context-parallel 2" 2 $args --context-parallel 3 --out "$work/bad2"
expect_error "is not a multiple of 5" 0 $args --context-parallel 5 --out "$work/bad3"
expect_error "drop --chunk" 2 $args --context-parallel 2 --chunk 16 --out "$work/bad4"
expect_error "drop --act-offload" 2 $args --context-parallel 2 --act-offload host --out "$work/bad5"
expect_error "give --page P dividing 24" 2 $args --context-parallel 2 --sparse-pages 1 --page 5 --out "$work/bad8"
expect_error "is not a multiple of 8" 4 $args --context-parallel 4 --cp-split zigzag --seq 52 --out "$work/bad9"
expect_error "drop one of them" 2 $args --context-parallel 2 --cp-split zigzag --sparse-pages 1 --page 4 --out "$work/bad10"
expect_error "contiguous or zigzag" 2 $args --context-parallel 2 --cp-split striped --out "$work/bad11"
expect_error "give --context-parallel too" 0 $args --cp-split zigzag --out "$work/bad12"
expect_error "2 groups of ranks share each step" 4 $args --context-parallel 2 --batch 1 --out "$work/bad7"
(export OOMLESS_DIST_LINK=fast; expect_error "give LATENCY_US,GB_PER_S" 2 $args --context-parallel 2 --out "$work/bad6") || exit 1
[ ! -e "$work/bad1" ] && [ ! -e "$work/bad2" ] && [ ! -e "$work/bad8" ] && [ ! -e "$work/bad9" ] || { echo "a refused run left a folder"; exit 1; }
echo "bad settings: refused with the fix named"
