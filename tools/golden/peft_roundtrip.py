"""Adapters between oomless and PEFT, both ways, on a tiny transformers model (tests/golden/models/NAME).

1. oomless trains a LoRA (a few steps: plain, rsLoRA with --lora-dropout, DoRA); PeftModel.from_pretrained
   loads the checkpoint folder and its loss on the same windows equals `oomless eval --adapter`'s.
2. `oomless merge` writes a folder that transformers loads; its loss equals PEFT's merge_and_unload().
3. An adapter PEFT trained and saved (tests/golden/peft/NAME_lora) gives PEFT's loss in `oomless eval --adapter`.
Prints one line per comparison and exits 1 when any relative difference is above 1e-5 (fp32).

usage: tools/golden/.venv/bin/python tools/golden/peft_roundtrip.py --oomless build/release/oomless [--work DIR]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def windows(ids, T):
    return [ids[i:i + T] for i in range(0, len(ids) - T + 1, T)]


def torch_loss(model, ids, T):
    tot, n = 0.0, 0
    with torch.no_grad():
        for w in windows(ids, T):
            x = torch.tensor([w])
            out = model(input_ids=x, labels=x)
            tot += out.loss.item() * (T - 1)
            n += T - 1
    return tot / n


def oomless_loss(binary, args):
    out = subprocess.run([binary, "eval", "--json"] + args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["loss"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oomless", required=True)
    ap.add_argument("--model", default="llama_gqa_untied")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    work = a.work or tempfile.mkdtemp(prefix="peft-roundtrip-")
    os.makedirs(work, exist_ok=True)
    base = os.path.join(ROOT, "tests/golden/models", a.model)
    T = 16
    # Token ids inside the tiny vocabulary: a fixed pseudo-random stream.
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (T * 24,), generator=g).tolist()
    data = os.path.join(work, "data.ids")
    with open(data, "w") as f:
        for i in range(0, len(ids), 48):
            f.write(" ".join(map(str, ids[i:i + 48])) + "\n")
    bad = []

    def report(what, x, y):
        rel = abs(x - y) / abs(y)
        print(f"{what:58s} oomless {x:.9f}  peer {y:.9f}  rel {rel:.2e}")
        if rel > 1e-5:
            bad.append(what)

    for tag, extra in [("lora", []), ("rslora+dropout", ["--rslora", "--lora-dropout", "0.1"]), ("dora", ["--dora"])]:
        out = os.path.join(work, "run-" + tag)
        shutil.rmtree(out, ignore_errors=True)  # a run refuses a folder that holds an earlier one
        subprocess.run([a.oomless, "train", "--model", base, "--data", data, "--seq", str(T), "--batch", "2",
                        "--steps", "6", "--lr", "5e-2", "--warmup", "1", "--eval-every", "0", "--lora", "4",
                        "--out", out] + extra, check=True, capture_output=True)
        ck = os.path.join(out, "checkpoint-6")
        m = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        pm = PeftModel.from_pretrained(m, ck)
        pm.eval()
        peft_loss = torch_loss(pm, ids, T)
        report(f"{tag}: oomless adapter, PEFT loads it", oomless_loss(a.oomless, ["--model", base, "--adapter", ck,
                                                                                   "--data", data, "--seq", str(T)]),
               peft_loss)
        merged = os.path.join(out, "merged")
        subprocess.run([a.oomless, "merge", "--model", base, "--adapter", ck, "--out", merged], check=True,
                       capture_output=True)
        hf = AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32)
        report(f"{tag}: oomless merge in transformers vs PEFT merge_and_unload", torch_loss(hf, ids, T),
               torch_loss(pm.merge_and_unload(), ids, T))
    peft_dir = os.path.join(ROOT, "tests/golden/peft", a.model + "_lora")
    if os.path.isdir(peft_dir):
        m = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        pm = PeftModel.from_pretrained(m, peft_dir)
        pm.eval()
        report("PEFT adapter, oomless loads it", oomless_loss(a.oomless, ["--model", base, "--adapter", peft_dir,
                                                                          "--data", data, "--seq", str(T)]),
               torch_loss(pm, ids, T))
    print("peft round trip:", "FAIL " + ", ".join(bad) if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
