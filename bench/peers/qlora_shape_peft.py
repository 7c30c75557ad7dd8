#!/usr/bin/env python3
"""PEFT + bitsandbytes QLoRA at a large model's shape: peak RSS of one real training step at each T asked for,
to set beside `bench/real_model/qlora_shape.sh` (oomless on the same shape).

The peer needs a weight file for its 4-bit load, so the first run writes one: a Hugging Face folder of the
shape's config.json with every tensor drawn at random (normal, std 0.02; norms 1) in bf16, one safetensors
shard per layer (13.5 GB for Llama-2-7B), into --work. Each T then runs in a child process under
/usr/bin/time -v doing what the QLoRA recipe does: from_pretrained with BitsAndBytesConfig(load_in_4bit, nf4,
double quantisation, compute dtype --dtype), prepare_model_for_kbit_training (gradient checkpointing as
--checkpointing), LoRA r 16 on all-linear (alpha 32, dropout 0), one forward + backward + AdamW step on T
random token ids. A watchdog in the child ends it (exit 3) when its resident memory passes --limit-gib, so a T
that does not fit reports that instead of exhausting the machine. One JSON line per T on stdout and in
--out: peak RSS (/usr/bin/time -v), the RSS after loading, seconds per phase.

usage: qlora_shape_peft.py --shape bench/shapes/llama2-7b/config.json --work DIR --T 256,512,1024
       [--checkpointing on|off] [--dtype bf16|fp32] [--limit-gib 20] [--threads 2] [--out FILE]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time


def rss_kib(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def write_checkpoint(shape, work):
    """A bf16 Hugging Face folder of the shape, drawn at random tensor by tensor (one shard per layer)."""
    import torch
    from safetensors.torch import save_file

    done = os.path.join(work, "model.safetensors.index.json")
    if os.path.exists(done):
        return
    os.makedirs(work, exist_ok=True)
    cfg = json.load(open(shape))
    E, F, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    D = E // H
    g = torch.Generator().manual_seed(0)

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards = []
    weight_map = {}

    def save(name, tensors):
        save_file(tensors, os.path.join(work, name), metadata={"format": "pt"})
        for k in tensors:
            weight_map[k] = name
        shards.append(name)

    save("embed.safetensors", {"model.embed_tokens.weight": normal(V, E)})
    for l in range(L):
        p = f"model.layers.{l}."
        save(f"layer{l:03d}.safetensors", {
            p + "self_attn.q_proj.weight": normal(H * D, E),
            p + "self_attn.k_proj.weight": normal(Hkv * D, E),
            p + "self_attn.v_proj.weight": normal(Hkv * D, E),
            p + "self_attn.o_proj.weight": normal(E, H * D),
            p + "mlp.gate_proj.weight": normal(F, E),
            p + "mlp.up_proj.weight": normal(F, E),
            p + "mlp.down_proj.weight": normal(E, F),
            p + "input_layernorm.weight": torch.ones(E, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(E, dtype=torch.bfloat16),
        })
        print(f"  wrote layer {l + 1}/{L}", file=sys.stderr, flush=True)
    save("head.safetensors", {"model.norm.weight": torch.ones(E, dtype=torch.bfloat16), "lm_head.weight": normal(V, E)})
    out = dict(cfg)
    out["torch_dtype"] = "bfloat16"
    json.dump(out, open(os.path.join(work, "config.json"), "w"), indent=1)
    json.dump({"metadata": {}, "weight_map": weight_map}, open(done + ".tmp", "w"))
    os.replace(done + ".tmp", done)


def child(a):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    limit = int(a.limit_gib * 1024 * 1024)
    phase = ["load"]

    def watchdog():
        while True:
            r = rss_kib()
            if r > limit:
                print(json.dumps({"T": a.child, "over_limit": True, "rss_kib": r, "phase": phase[0]}), flush=True)
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=watchdog, daemon=True).start()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cdt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    t = {}
    t0 = time.perf_counter()
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=cdt)
    model = AutoModelForCausalLM.from_pretrained(a.work, dtype=cdt, attn_implementation="sdpa",
                                                 quantization_config=q, device_map="cpu")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=a.checkpointing == "on")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    t["load"] = time.perf_counter() - t0
    after_load = rss_kib()
    V = model.config.vocab_size
    ids = torch.randint(0, V, (1, a.child), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    phase[0] = "forward"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        out = model(input_ids=ids, labels=ids)
    t["forward"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase[0] = "backward"
    out.loss.backward()
    t["backward"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase[0] = "step"
    opt.step()
    t["step"] = time.perf_counter() - t0
    print(json.dumps({"T": a.child, "over_limit": False, "loss": float(out.loss), "rss_after_load_kib": after_load,
                      "vmhwm_kib": rss_kib("VmHWM"), "trainable": sum(p.numel() for p in params),
                      "seconds": {k: round(v, 1) for k, v in t.items()}}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, help="a config.json (bench/shapes/NAME/config.json)")
    ap.add_argument("--work", required=True, help="folder for the drawn bf16 checkpoint (kept between runs)")
    ap.add_argument("--T", default="256,512,1024", help="sequence lengths, comma-separated, ascending")
    ap.add_argument("--checkpointing", choices=["on", "off"], default="on")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bnb_4bit_compute_dtype")
    ap.add_argument("--limit-gib", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="", help="also append the JSON lines here")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    write_checkpoint(a.shape, a.work)
    for T in [int(x) for x in a.T.split(",")]:
        cmd = ["/usr/bin/time", "-v", sys.executable, os.path.abspath(__file__), "--shape", a.shape, "--work", a.work,
               "--checkpointing", a.checkpointing, "--dtype", a.dtype, "--limit-gib", str(a.limit_gib),
               "--threads", str(a.threads), "--child", str(T)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        rec = None
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
        if rec is None:
            sys.exit(f"qlora_shape_peft.py: T={T} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
        rec.update({"peak_rss_kib": int(m.group(1)) if m else None, "wall_s": round(time.perf_counter() - t0, 1),
                    "checkpointing": a.checkpointing, "dtype": a.dtype, "limit_gib": a.limit_gib})
        line = json.dumps(rec)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
        if rec["over_limit"]:
            break


if __name__ == "__main__":
    main()
