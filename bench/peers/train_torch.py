"""The PyTorch + transformers side of bench/peers: trains a Hugging Face folder on the exact token stream
an `oomless train --dump-tokens` run saw, with the same optimizer settings, and writes one JSON line per
step (step, loss, lr, grad_norm, tokens_per_s, seconds).

What it does per optimizer step, as `oomless train` does: lr from the same warmup + schedule formula;
every sequence contributes sum(CE over supervised targets) / N, N = the step's supervised targets over all
micro-batches; global-norm clipping; AdamW (decoupled weight decay on matrices and embeddings, none on norms
and biases), torch.optim.AdamW(fused=True). attn_implementation="sdpa"; --dtype bf16 runs the forward
under torch.autocast("cpu", torch.bfloat16) with fp32 master weights. --lora R trains a PEFT LoRA of rank R
on all-linear instead (the base frozen; AdamW over the adapter, decay on its matrices as on oomless's);
--optim adamw8bit uses bitsandbytes.optim.AdamW8bit
instead (the same groups), --optim galore galore_torch's GaLoreAdamW on the decoder layers' matrices. --qlora loads the base through bitsandbytes 4-bit (nf4, double quantisation, compute dtype fp32 or bf16 as
--dtype) and PEFT's prepare_model_for_kbit_training (without gradient checkpointing: oomless keeps every
activation too), the QLoRA recipe.
"""
import argparse
import json
import math
import sys
import time


def lr_at(step, lr, min_lr, warmup, total, schedule):
    if step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    decay = total - warmup
    progress = 1.0 if decay == 0 else min(max((step - warmup) / decay, 0.0), 1.0)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_lr + (lr - min_lr) * shape


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (e.g. from `oomless convert`)")
    ap.add_argument("--tokens", required=True, help="the --dump-tokens file of an oomless run")
    ap.add_argument("--metrics", required=True, help="output JSON lines")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1, help="sequences per forward (micro-batch)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--schedule", choices=["cosine", "linear", "constant"], default="cosine")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora", type=int, default=0, help="PEFT LoRA of this rank on all-linear (0: full training)")
    ap.add_argument("--lora-alpha", type=float, default=0, help="default 2 x rank, as oomless")
    ap.add_argument("--qlora", action="store_true", help="the base in bitsandbytes NF4 (double quantised)")
    ap.add_argument("--optim", choices=["adamw", "adamw8bit", "galore"], default="adamw",
                    help="torch.optim.AdamW (fused), bitsandbytes.optim.AdamW8bit or galore_torch.GaLoreAdamW")
    ap.add_argument("--galore-rank", type=int, default=0, help="default hidden size / 4, as oomless")
    ap.add_argument("--galore-gap", type=int, default=200)
    ap.add_argument("--galore-scale", type=float, default=1.0, help="as oomless (galore_torch's projector default)")
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.qlora:
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa",
                                                     quantization_config=q, device_map="cpu")
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa")
    if a.lora > 0:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=a.lora, lora_alpha=a.lora_alpha or 2 * a.lora, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if a.optim == "galore":
        # galore_torch's GaLoreAdamW on the 2-D tensors of the decoder layers (oomless's --optim galore), its
        # AdamW for the rest; the same decay groups.
        from galore_torch import GaLoreAdamW
        proj = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and ".layers." in n]
        ids = {id(p) for p in proj}
        rank = a.galore_rank or model.config.hidden_size // 4
        groups = [{"params": [p for p in decay if id(p) not in ids], "weight_decay": a.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0},
                  {"params": proj, "weight_decay": a.weight_decay, "rank": rank, "update_proj_gap": a.galore_gap,
                   "scale": a.galore_scale, "proj_type": "std"}]
        opt = GaLoreAdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    elif a.optim == "adamw8bit":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, fused=True)
    warmup = min(a.warmup, a.steps)
    V = model.config.vocab_size

    out = open(a.metrics, "w")
    with open(a.tokens) as f:
        for step in range(1, a.steps + 1):
            line = f.readline()
            if not line:
                sys.exit(f"train_torch.py: {a.tokens} ends before step {step}; dump at least --steps steps")
            rec = json.loads(line)
            assert rec["step"] == step, f"{a.tokens}: expected step {step}, found {rec['step']}"
            t0 = time.perf_counter()
            ids = torch.tensor(rec["ids"], dtype=torch.long)
            tg = torch.tensor(rec["targets"], dtype=torch.long)
            N = int((tg != -100).sum())
            lr = lr_at(step, a.lr, a.min_lr, warmup, a.steps, a.schedule)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for i in range(0, ids.shape[0], a.batch):
                x, y = ids[i:i + a.batch], tg[i:i + a.batch]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                    logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1), ignore_index=-100,
                                       reduction="sum")
                (loss / N).backward()
                loss_sum += float(loss.detach())
            norm = torch.nn.utils.clip_grad_norm_(params, a.clip if a.clip > 0 else float("inf"))
            opt.step()
            dt = time.perf_counter() - t0
            out.write(json.dumps({"step": step, "loss": loss_sum / N, "lr": lr, "grad_norm": float(norm),
                                  "tokens_per_s": ids.numel() / dt, "seconds": dt}) + "\n")
            out.flush()
            print(f"step {step}/{a.steps}  loss {loss_sum / N:.4f}  {ids.numel() / dt:.0f} tok/s", file=sys.stderr)


if __name__ == "__main__":
    main()
