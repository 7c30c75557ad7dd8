#!/bin/sh
# What a Q4_K GGUF base costs inside the GEMM: `oomless train --lora 16` on a Llama shape whose widths are
# multiples of Q4_K's 256 (bench/shapes/q4k-1024: 8 layers, width 1024, MLP 2816, 107M parameters, the
# bundled tokenizer), randomly initialised, written once as an f32 Hugging Face folder and once as a Q4_K
# GGUF (`oomless convert --type q4_k`, every matrix in Q4_K), trained on the same token stream with the
# base in f32 and in the GGUF's blocks; REPS rounds in alternating order. Prints each run's tokens/s
# (median of the steps after the first) and the median of the per-round ratios q4_k / f32 step time.
# usage: bench/real_model/q4k_cost.sh [BUILD_DIR=build/release] [DTYPE=bf16] [T=512] [REPS=3] [STEPS=5]
set -eu
build=${1:-build/release}; dtype=${2:-bf16}; T=${3:-512}; reps=${4:-3}; steps=${5:-5}
bin=$build/oomless; w=$build/q4k-cost
mkdir -p "$w/shape"
cp bench/shapes/q4k-1024/config.json data/tokenizer/tokenizer.json data/tokenizer/tokenizer_config.json "$w/shape/"
[ -f "$w/f32/model.safetensors" ] || "$bin" convert --model "$w/shape/config.json" --out "$w/f32" > /dev/null
[ -f "$w/q4k.gguf" ] || "$bin" convert --model "$w/f32" --out "$w/q4k.gguf" --type q4_k
[ -s "$w/data.ids" ] || "$bin" tokenize --model "$w/f32" --text-file data/kjv/train.txt --no-special > "$w/data.ids"
"$bin" probe --quick | head -2
tps() {  # median tokens/s of steps 2.. of a metrics.jsonl
  grep '"type":"train"' "$1" | tail -n +2 | sed 's/.*"tokens_per_s":\([0-9.e+]*\).*/\1/' | sort -g |
    awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
run() {  # run NAME MODEL
  rm -rf "$w/run-$1"
  "$bin" train --model "$2" --data "$w/data.ids" --seq "$T" --batch 1 --steps "$steps" --lr 1e-4 --warmup 1 \
    --lora 16 --dtype "$dtype" --threads 2 --eval-every 0 --save-every 0 --out "$w/run-$1" > "$w/run-$1.log" 2>&1 ||
    { cat "$w/run-$1.log"; exit 1; }
  tps "$w/run-$1/metrics.jsonl"
}
: > "$w/ratios"
r=0
while [ $r -lt "$reps" ]; do
  if [ $((r % 2)) -eq 0 ]; then f=$(run f32 "$w/f32"); q=$(run q4k "$w/q4k.gguf"); else q=$(run q4k "$w/q4k.gguf"); f=$(run f32 "$w/f32"); fi
  echo "round $r ($dtype, T=$T): tok/s f32 $f  q4_k-gguf $q"
  echo "$f $q" >> "$w/ratios"
  r=$((r + 1))
done
med() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
echo "step time / f32 step time, median of $reps rounds: q4_k gguf $(awk '{ print $1 / $2 }' "$w/ratios" | med)x"
