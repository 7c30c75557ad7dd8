#!/usr/bin/env python3
"""bitsandbytes AdamW8bit golden for oomless' AdamW8bit (tests/optim8bit_test.cpp).

bitsandbytes' CPU update (backends/cpu/ops.py, its pure-torch path with the native CPU blockwise quantiser)
applies the weight decay before the Adam step, p *= 1 - lr wd, then p += update; its CUDA kernel, which
oomless follows, applies it after: p = (p + update) * (1 - lr wd). So this script runs bnb.optim.AdamW8bit
with weight_decay 0 and applies p *= 1 - lr wd itself after each step to the decaying tensors: bitsandbytes'
own states and update, in the CUDA kernel's order.

Three tensors: "small" (3, 300) = 900 elements, under min_8bit_size 4096 (fp32 state), decaying; "odd"
(17, 257) = 4369 elements (8-bit state, a last block of 17), decaying; "even" (5120) (8-bit, 20 full
blocks), no decay. 20 steps of random gradients (float16 values, so the file is small) whose scale changes
per block and step, and one step where "odd" gets an all-zero block of gradient.

  init.<name>                 F32  starting parameter
  grad<k>.<name>              F16  gradient of step k (1..20), exact in float32
  after1.<name>, after20.<name>   F32  parameter after step 1 and after step 20
  state1.<name>, state2.<name>    U8 codes (8-bit tensors) or F32 (small) after 20 steps
  absmax1.<name>, absmax2.<name>  F32  block scales after 20 steps (8-bit tensors)
  signed_map, unsigned_map    F32 [256]  create_dynamic_map(signed=True / False)
  lr                          F64 [20]
  hparams                     F64 [4]  beta1, beta2, eps, weight_decay
metadata "golden": JSON {"decay": {name: bool}, "versions": {...}}. Deterministic (seeded, CPU).
"""
import json
import os

import bitsandbytes as bnb
import bitsandbytes.functional as BF
import numpy as np
import safetensors
import torch
from safetensors.numpy import save_file

STEPS = 20
BETA1, BETA2, EPS, WD = 0.9, 0.995, 1e-8, 0.1
SHAPES = {"small": ((3, 300), True), "odd": ((17, 257), True), "even": ((5120,), False)}


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(4321)
    lrs = [float(x) for x in 10.0 ** rng.uniform(-3, -2, STEPS)]
    init = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, (s, _) in SHAPES.items()}
    grads = []
    for k in range(STEPS):
        g = {}
        for n, (s, _) in SHAPES.items():
            x = rng.standard_normal(s).astype(np.float32).reshape(-1)
            # scale per 256-element block: 1e-2 .. 1e2, rounded to float16
            scales = 10.0 ** rng.uniform(-2, 2, (x.size + 255) // 256)
            x = (x * np.repeat(scales, 256)[: x.size]).astype(np.float16).astype(np.float32)
            if k == 5 and n == "odd":
                x[512:768] = 0
            g[n] = x.reshape(s)
        grads.append(g)

    params = {n: torch.nn.Parameter(torch.from_numpy(init[n]).clone()) for n in SHAPES}
    opt = bnb.optim.AdamW8bit(list(params.values()), lr=lrs[0], betas=(BETA1, BETA2), eps=EPS, weight_decay=0.0)
    out = {}
    for n in SHAPES:
        out["init." + n] = init[n]
    for k in range(STEPS):
        for grp in opt.param_groups:
            grp["lr"] = lrs[k]
        for n, p in params.items():
            p.grad = torch.from_numpy(grads[k][n]).clone()
            out[f"grad{k + 1}.{n}"] = grads[k][n].astype(np.float16)
        opt.step()
        with torch.no_grad():
            for n, p in params.items():
                if SHAPES[n][1]:
                    p.mul_(1.0 - lrs[k] * WD)
        if k in (0, STEPS - 1):
            for n, p in params.items():
                out[f"after{k + 1}.{n}"] = p.detach().numpy().copy()
    for n, p in params.items():
        st = opt.state[p]
        for key in ("state1", "state2", "absmax1", "absmax2"):
            if key in st:
                out[f"{key}.{n}"] = st[key].numpy().copy()
    out["signed_map"] = BF.create_dynamic_map(signed=True).numpy()
    out["unsigned_map"] = BF.create_dynamic_map(signed=False).numpy()
    out["lr"] = np.array(lrs, dtype=np.float64)
    out["hparams"] = np.array([BETA1, BETA2, EPS, WD], dtype=np.float64)

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    d = os.path.join(root, "tests", "golden", "optim")
    os.makedirs(d, exist_ok=True)
    meta = {"golden": json.dumps({"decay": {n: d for n, (_, d) in SHAPES.items()},
                                  "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__,
                                               "numpy": np.__version__, "safetensors": safetensors.__version__}})}
    path = os.path.join(d, "adamw8bit.safetensors")
    save_file(out, path, metadata=meta)
    print(path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
