#!/bin/sh
# What dequantising the frozen base inside the GEMM costs: `oomless train --lora 16` on SmolLM2-135M-Instruct
# with the base in f32 (its Hugging Face conversion), in NF4 (--qlora, double-quantised scales) and in the
# Q4_1 GGUF's own blocks, the same token stream, --dtype D, T tokens, REPS rounds in rotating order. Prints
# each run's tokens/s (median over the steps after the first) and the medians of the per-round ratios
# quantised / f32.
# usage: bench/real_model/dequant_cost.sh [BUILD_DIR=build/release] [DTYPE=bf16] [T=1024] [REPS=3] [STEPS=5]
set -eu
build=${1:-build/release}; dtype=${2:-bf16}; T=${3:-1024}; reps=${4:-3}; steps=${5:-5}
bin=$build/oomless; w=$build/dequant-cost
mkdir -p "$w"
gguf=$(scripts/fetch_smollm2.sh | tail -1)
[ -f "$w/hf/model.safetensors" ] || "$bin" convert --model "$gguf" --out "$w/hf" > /dev/null
[ -s "$w/data.ids" ] || "$bin" tokenize --model "$w/hf" --text-file data/kjv/train.txt --no-special > "$w/data.ids"
"$bin" probe --quick | head -2
tps() {  # median tokens/s of steps 2.. of a metrics.jsonl
  grep '"type":"train"' "$1" | tail -n +2 | sed 's/.*"tokens_per_s":\([0-9.e+]*\).*/\1/' | sort -g |
    awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
run() {  # run NAME MODEL EXTRA...
  name=$1; model=$2; shift 2
  rm -rf "$w/$name"
  "$bin" train --model "$model" --data "$w/data.ids" --seq "$T" --batch 1 --steps "$steps" --lr 1e-4 --warmup 1 \
    --lora 16 --dtype "$dtype" --threads 2 --eval-every 0 --save-every 0 --out "$w/$name" "$@" > "$w/$name.log" 2>&1 ||
    { cat "$w/$name.log"; exit 1; }
  tps "$w/$name/metrics.jsonl"
}
: > "$w/ratios"
r=0
while [ $r -lt "$reps" ]; do
  case $((r % 3)) in
    0) f=$(run f32 "$w/hf"); n=$(run nf4 "$w/hf" --qlora); g=$(run gguf "$gguf") ;;
    1) n=$(run nf4 "$w/hf" --qlora); g=$(run gguf "$gguf"); f=$(run f32 "$w/hf") ;;
    *) g=$(run gguf "$gguf"); f=$(run f32 "$w/hf"); n=$(run nf4 "$w/hf" --qlora) ;;
  esac
  echo "round $r ($dtype, T=$T): tok/s f32 $f  nf4-dq $n  q4_1-gguf $g"
  echo "$f $n $g" >> "$w/ratios"
  r=$((r + 1))
done
med() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
nr=$(awk '{ print $1 / $2 }' "$w/ratios" | med); gr=$(awk '{ print $1 / $3 }' "$w/ratios" | med)
echo "step time / f32 step time, median of $reps rounds: nf4-dq ${nr}x, q4_1 gguf ${gr}x"
