#!/usr/bin/env python3
"""torch.optim.AdamW golden for oomless' AdamW (tests/optim_test.cpp).

Writes tests/golden/optim/adamw.safetensors: the parameters of a tiny model laid out as oomless'
param_specs() lays them out (L=1, E=8, F=12, H=2, Hkv=1, D=4, V=16, tied embeddings, q/k/v and o biases,
q/k norms), random gradients for 5 steps, and the parameters and moments after those steps. Norm
weights and biases form a no-decay group, everything else decays; the learning rate changes every step.

  init.<name>      F32  starting parameter (norms near 1, biases and matrices random)
  grad<k>.<name>   F32  gradient of step k (1..5); one tensor has an all-zero gradient at step 3
  fp32.<name>      F32  parameter after 5 steps of torch.optim.AdamW in float32
  fp32.m.<name>, fp32.v.<name>   F32  exp_avg and exp_avg_sq after 5 steps
  f64.<name>, f64.m.<name>, f64.v.<name>   F64  the same run in float64 from the same inputs
  lr               F64 [5]  learning rate of each step
  hparams          F64 [4]  beta1, beta2, eps, weight_decay
metadata "golden": JSON {"decay": {name: true|false}, "versions": {...}}.

Deterministic: seeded, CPU, and rewritten identically from run to run.
"""
import json, os

import numpy as np
import safetensors
import torch
from safetensors.numpy import save_file

L, E, F, H, HKV, D, V = 1, 8, 12, 2, 1, 4, 16
STEPS = 5
LRS = [5e-2, 2e-2, 3e-2, 1e-2, 4e-2]
BETA1, BETA2, EPS, WD = 0.85, 0.9995, 1e-7, 0.5


def specs():
    """(name, shape, decay) in oomless' param_specs() order for the config above."""
    p = [("model.embed_tokens.weight", (V, E), True)]
    for l in range(L):
        pre = f"model.layers.{l}."
        p += [(pre + "input_layernorm.weight", (E,), False),
              (pre + "self_attn.q_proj.weight", (H * D, E), True), (pre + "self_attn.q_proj.bias", (H * D,), False),
              (pre + "self_attn.k_proj.weight", (HKV * D, E), True), (pre + "self_attn.k_proj.bias", (HKV * D,), False),
              (pre + "self_attn.v_proj.weight", (HKV * D, E), True), (pre + "self_attn.v_proj.bias", (HKV * D,), False),
              (pre + "self_attn.o_proj.weight", (E, H * D), True), (pre + "self_attn.o_proj.bias", (E,), False),
              (pre + "self_attn.q_norm.weight", (D,), False), (pre + "self_attn.k_norm.weight", (D,), False),
              (pre + "post_attention_layernorm.weight", (E,), False),
              (pre + "mlp.gate_proj.weight", (F, E), True), (pre + "mlp.up_proj.weight", (F, E), True),
              (pre + "mlp.down_proj.weight", (E, F), True)]
    p.append(("model.norm.weight", (E,), False))
    return p  # tied: no lm_head.weight


def run(init, grads, decay, dtype):
    # clone: from_numpy shares memory, and the optimizer updates parameters in place.
    params = {n: torch.nn.Parameter(torch.from_numpy(init[n]).to(dtype).clone()) for n in init}
    groups = [{"params": [params[n] for n in init if decay[n]], "weight_decay": WD},
              {"params": [params[n] for n in init if not decay[n]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LRS[0], betas=(BETA1, BETA2), eps=EPS, foreach=False, fused=False)
    for k in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = LRS[k]
        for n, p in params.items():
            p.grad = torch.from_numpy(grads[k][n]).to(dtype).clone()
        opt.step()
    out = {}
    for n, p in params.items():
        st = opt.state[p]
        out[n] = p.detach().numpy().copy()
        out["m." + n] = st["exp_avg"].numpy().copy()
        out["v." + n] = st["exp_avg_sq"].numpy().copy()
    return out


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(1234)
    sp = specs()
    decay = {n: d for n, _, d in sp}
    init = {}
    for n, shape, _ in sp:
        if n.endswith("norm.weight"):
            init[n] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            init[n] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    grads = []
    for k in range(STEPS):
        g = {}
        for i, (n, shape, _) in enumerate(sp):
            # Scales from 1e-3 to 10 per tensor and step, so the moments are far from the first step's.
            scale = 10.0 ** rng.uniform(-3, 1)
            g[n] = (scale * rng.standard_normal(shape)).astype(np.float32)
            if k == 2 and i == 3:
                g[n][:] = 0
        grads.append(g)

    out = {}
    for n in init:
        out["init." + n] = init[n]
    for k in range(STEPS):
        for n in init:
            out[f"grad{k + 1}.{n}"] = grads[k][n]
    for n, a in run(init, grads, decay, torch.float32).items():
        out["fp32." + n] = a.astype(np.float32)
    for n, a in run(init, grads, decay, torch.float64).items():
        out["f64." + n] = a.astype(np.float64)
    out["lr"] = np.array(LRS, dtype=np.float64)
    out["hparams"] = np.array([BETA1, BETA2, EPS, WD], dtype=np.float64)

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    d = os.path.join(root, "tests", "golden", "optim")
    os.makedirs(d, exist_ok=True)
    # One metadata key: the writer orders several keys differently from run to run.
    meta = {"golden": json.dumps({"decay": decay,
                                  "versions": {"torch": torch.__version__, "numpy": np.__version__,
                                               "safetensors": safetensors.__version__}})}
    path = os.path.join(d, "adamw.safetensors")
    save_file(out, path, metadata=meta)
    print(path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
