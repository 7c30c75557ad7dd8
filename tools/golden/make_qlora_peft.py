#!/usr/bin/env python3
"""QLoRA goldens: PEFT LoRA and DoRA adapters on a bitsandbytes 4-bit model, with float64 gradients.

The base is tests/golden/bnb4/llama_gqa_untied (make_nf4.py: tests/golden/models/llama_gqa_untied loaded
with BitsAndBytesConfig(nf4, double quantisation, compute dtype float32) and saved by transformers). For
each variant NAME writes tests/golden/peft/NAME/ as make_peft.py does:
  adapter_config.json, adapter_model.safetensors   PeftModel.save_pretrained on the 4-bit model (float32;
                   base_model_name_or_path is the 4-bit folder)
  golden.safetensors  input_ids I32 [T], logits F64 [T, V], loss F64 [1], grad.<adapter key> F64: the same
                   adapted model in float64 with each projection's weight as bitsandbytes dequantises it
                   (deq.* of the 4-bit golden) and every other tensor the base model's, through
                   make_peft.py's independent float64 forward (the norm of DoRA detached)
  errors.json      "fp32": PEFT + bitsandbytes on CPU (Linear4bit, float32 compute) against that golden;
                   versions
Adapter values as make_peft.py draws them (lora_A 0.3 randn, lora_B 0.1 randn, DoRA magnitudes the row norms
of dequant(W) + s B A times 1 + 0.1 randn).

Run: tools/golden/.venv/bin/python tools/golden/make_qlora_peft.py
"""
import json
import os
import sys

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import numpy as np
import torch
import transformers
import peft
import bitsandbytes
from peft import LoraConfig, get_peft_model
from safetensors.numpy import save_file
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_peft as mp  # noqa: E402  (its helpers, and make_models' float64 patches)

ROOT = mp.ROOT
BNB = os.path.join("tests", "golden", "bnb4", "llama_gqa_untied")
SRC = os.path.join("tests", "golden", "models", "llama_gqa_untied")
VARIANTS = [
    ("bnb4_llama_gqa_untied_lora", 21, dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)),
    ("bnb4_llama_gqa_untied_dora", 22, dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                            use_dora=True)),
]


def run(name, seed, kw):
    os.chdir(ROOT)
    d = os.path.join("tests", "golden", "peft", name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    dora = kw.get("use_dora", False)
    deq = {k[len("deq."):]: v for k, v in load_file(os.path.join(BNB, "golden.safetensors")).items()
           if k.startswith("deq.")}
    ids = load_file(os.path.join(SRC, "golden.safetensors"))["input_ids"].long()

    q = AutoModelForCausalLM.from_pretrained(BNB, dtype=torch.float32, device_map="cpu")
    q.config._attn_implementation = "eager"
    q.eval()
    pm = get_peft_model(q, LoraConfig(task_type="CAUSAL_LM", **kw))
    g = torch.Generator().manual_seed(1000 + seed)
    values = {}
    with torch.no_grad():
        for mod_name, mod in sorted(mp.lora_layers(pm).items()):
            A, B = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            A.copy_(0.3 * torch.randn(A.shape, generator=g))
            B.copy_(0.1 * torch.randn(B.shape, generator=g))
            if dora:
                W = deq[mod_name + ".weight"].double()
                norm = (W + mod.scaling["default"] * (B.double() @ A.double())).norm(dim=1)
                mag = (norm * (1 + 0.1 * torch.randn(norm.shape, generator=g, dtype=torch.float64))).float()
                mod.lora_magnitude_vector["default"].weight.copy_(mag)
    for n, p in pm.named_parameters():
        if p.requires_grad:
            values[mp.adapter_key(n)] = p.detach().float().clone()
    pm.save_pretrained(d)
    os.remove(os.path.join(d, "README.md"))

    # PEFT + bitsandbytes, float32 on CPU.
    out = pm(input_ids=ids[None], labels=ids[None])
    out.loss.backward()
    grads32 = {mp.adapter_key(n): p.grad.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}

    # float64: the base with the dequantised projections, the same adapter, make_peft's reference forward.
    base = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32).double()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n in deq:
                p.copy_(deq[n].double())
    targets = {t["name"]: t for t in mp.describe_targets(pm)}
    adapter64 = {k: v.double().requires_grad_(True) for k, v in values.items()}
    loss, logits = mp.ref_loss_logits(base, base.config, "llama", ids, adapter64, targets, dora)
    keys = sorted(adapter64)
    g64 = torch.autograd.grad(loss, [adapter64[k] for k in keys])
    golden = {"input_ids": ids.numpy().astype(np.int32), "logits": logits.detach().numpy(),
              "loss": loss.detach().reshape(1).numpy()}
    errs = {"logits": mp.rel(out.logits[0], logits),
            "loss": abs(float(out.loss) - float(loss)) / abs(float(loss))}
    for k, gk in zip(keys, g64):
        golden["grad." + k] = gk.numpy()
        errs["grad." + k] = mp.rel(grads32[k], gk)
    save_file(golden, os.path.join(d, "golden.safetensors"))
    res = {"fp32": errs, "peft_version": peft.__version__, "bitsandbytes_version": bitsandbytes.__version__,
           "torch_version": torch.__version__, "transformers_version": transformers.__version__}
    with open(os.path.join(d, "errors.json"), "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{name}: loss {float(loss):.6f}, PEFT+bitsandbytes fp32 max error {max(errs.values()):.2e}")


def main():
    torch.set_num_threads(1)
    for v in VARIANTS:
        run(*v)


if __name__ == "__main__":
    main()
