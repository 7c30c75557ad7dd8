#!/usr/bin/env python3
"""SmolLM2-135M-Instruct goldens (transformers, float32, from the GGUF that scripts/fetch_smollm2.sh fetches).

Writes tests/golden/smollm2/:
  eval.ids       WINDOWS*SEQ token ids of real English text, one line, decimal, space separated
  eval.json      {"seq", "windows", "loss": mean next-token CE over all windows, "per_window": [...], ...}
  generate.json  chat prompt ids, 32 greedy tokens, top-1 minus top-2 logit per step, decoded text
"""
import argparse, hashlib, json, os, subprocess, sys, time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
TEXTS = [os.path.join(ROOT, "data", "kjv", "eval.txt"), "/usr/share/common-licenses/GPL-3"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="path of SmolLM2-135M-Instruct.Q4_1.gguf (default: run scripts/fetch_smollm2.sh)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "golden", "smollm2"))
    ap.add_argument("--text", help="English text file (default: data/kjv/eval.txt, else GPL-3)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(min(16, os.cpu_count() or 1))

    gguf = a.gguf or subprocess.run([os.path.join(ROOT, "scripts", "fetch_smollm2.sh")], check=True,
                                    stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    d, name = os.path.split(os.path.abspath(gguf))
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    t_load = time.time() - t0
    os.makedirs(a.out, exist_ok=True)

    # ---- eval windows
    t0 = time.time()
    path = a.text or next(p for p in TEXTS if os.path.exists(p))
    text = open(path, encoding="utf-8").read(64 * 1024)  # first 64 KiB is plenty for 4 x 256 tokens
    ids = tok(text, add_special_tokens=False).input_ids
    n = a.seq * a.windows
    assert len(ids) > n + 16, f"{path}: only {len(ids)} tokens"
    ids = ids[:n]
    per = []
    with torch.no_grad():
        for w in range(a.windows):
            x = torch.tensor(ids[w * a.seq:(w + 1) * a.seq])[None]
            per.append(float(model(x, labels=x).loss))  # mean over seq-1 predictions
    ev = {"seq": a.seq, "windows": a.windows, "loss": sum(per) / len(per), "per_window": per,
          "predictions_per_window": a.seq - 1, "text": os.path.relpath(path, ROOT) if path.startswith(ROOT) else path,
          "text_prefix_sha256": hashlib.sha256(text.encode()).hexdigest(), "text_prefix_bytes": len(text.encode()),
          "gguf": name, "dtype": "float32", "torch_version": torch.__version__,
          "transformers_version": transformers.__version__}
    with open(os.path.join(a.out, "eval.ids"), "w") as f:
        f.write(" ".join(map(str, ids)) + "\n")
    with open(os.path.join(a.out, "eval.json"), "w") as f:
        json.dump(ev, f, indent=1)
        f.write("\n")
    t_eval = time.time() - t0

    # ---- greedy generation, plain loop, full forward each step
    t0 = time.time()
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    seq, toks, gaps = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(a.new_tokens):
            logits = model(torch.tensor(seq)[None]).logits[0, -1]
            top = torch.topk(logits, 2)
            toks.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            seq.append(toks[-1])
    gen = {"messages": MESSAGES, "prompt": prompt, "prompt_ids": prompt_ids, "tokens": toks, "top2_gap": gaps,
           "text": tok.decode(toks), "eos_token_id": tok.eos_token_id, "gguf": name, "dtype": "float32",
           "torch_version": torch.__version__, "transformers_version": transformers.__version__}
    with open(os.path.join(a.out, "generate.json"), "w") as f:
        json.dump(gen, f, indent=1)
        f.write("\n")
    t_gen = time.time() - t0

    print(f"text {ev['text']}: {n} tokens; loss {ev['loss']:.6f} per window {[round(x, 4) for x in per]}")
    print(f"prompt {len(prompt_ids)} tokens; greedy: {gen['text']!r}")
    print(f"min top2 gap {min(gaps):.4f} at step {gaps.index(min(gaps))}")
    print(f"times: load {t_load:.1f} s, eval {t_eval:.1f} s, generate {t_gen:.1f} s")


if __name__ == "__main__":
    main()
