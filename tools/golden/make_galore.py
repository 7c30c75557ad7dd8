#!/usr/bin/env python3
"""galore_torch golden for oomless' GaLore (tests/galore_test.cpp): GaLoreAdamW and GaLoreAdamW8bit over
10 steps of five tensors.

Tensors (oomless' names; projected: the 2-D ones under model.layers.):
  model.layers.0.self_attn.q_proj.weight (48, 32)  projected, right (m >= n), decays
  model.layers.0.mlp.down_proj.weight    (32, 80)  projected, left (m < n), decays
  model.layers.1.mlp.up_proj.weight      (520, 16) projected, right; its low-rank moments (520, 8) have
                                                   4160 elements: 8-bit in GaLoreAdamW8bit
  model.embed_tokens.weight              (64, 32)  AdamW, decays
  model.norm.weight                      (32)      AdamW, no decay
rank 8, update gap 4 (projectors made at steps 1, 5 and 9), scale 0.25. The projector's singular vectors get oomless' sign rule
(each vector's largest-magnitude entry positive, Ops::svd_basis) by wrapping get_orthogonal_matrix; GaLore's
result depends on the signs only through projectors made at different steps.

GaLoreAdamW8bit is bitsandbytes' Optimizer2State, whose CPU update applies weight decay before the step; its
CUDA kernel (which oomless follows) after. The script gives the non-projected tensors weight decay 0 and
multiplies the decaying one by 1 - lr wd after each step (GaLore itself applies the projected tensors' decay
after the update in both). torch.cuda.synchronize, which galore_torch calls after every update, is made a
no-op so it runs on a CPU. (On a CPU, GaLoreAdamW8bit leaves the projected tensors whose low-rank state is
under bitsandbytes' min_8bit_size, q_proj and down_proj here, without any Adam update: only their decay
moves them. tests/galore_test.cpp says how it uses those two.)

  init.<name>                                 F32
  grad<k>.<name> (k = 1..10)                  F16  (exact in float32)
  galore.<name>, galore8bit.<name>            F32  parameters after 10 steps
  galore.after1.<name>                        F32  after step 1
  lr F64 [10], hparams F64 [7]: beta1, beta2, eps, weight_decay, rank, gap, scale
"""
import json
import os

import bitsandbytes as bnb
import galore_torch
import galore_torch.galore_projector as gp
import numpy as np
import safetensors
import torch
from safetensors.numpy import save_file

STEPS = 10
BETA1, BETA2, EPS, WD = 0.9, 0.999, 1e-6, 0.1
RANK, GAP, SCALE = 8, 4, 0.25
TENSORS = [("model.layers.0.self_attn.q_proj.weight", (48, 32), True),
           ("model.layers.0.mlp.down_proj.weight", (32, 80), True),
           ("model.layers.1.mlp.up_proj.weight", (520, 16), True),
           ("model.embed_tokens.weight", (64, 32), True),
           ("model.norm.weight", (32,), False)]


def canonical(x, dim):
    """Flip each vector (rows: dim=1 is a row's entries; columns: dim=0) so its largest |entry| is positive."""
    idx = x.abs().argmax(dim=dim, keepdim=True)
    sign = torch.sign(torch.gather(x, dim, idx))
    sign[sign == 0] = 1
    return x * sign


_orig = gp.GaLoreProjector.get_orthogonal_matrix


def _canonical_orthogonal(self, weights, rank, type):
    m = _orig(self, weights, rank, type)
    if type == "right":
        return canonical(m, 1)  # (r, n): rows are vectors
    if type == "left":
        return canonical(m, 0)  # (m, r): columns are vectors
    return m


gp.GaLoreProjector.get_orthogonal_matrix = _canonical_orthogonal
torch.cuda.synchronize = lambda *a, **k: None


def run(cls, init, grads, lrs, after_decay):
    params = {n: torch.nn.Parameter(torch.from_numpy(init[n]).clone()) for n, _, _ in TENSORS}
    groups = [{"params": [params[n] for n, _, _ in TENSORS[:3]], "rank": RANK, "update_proj_gap": GAP,
               "scale": SCALE, "proj_type": "std", "weight_decay": WD},
              {"params": [params["model.embed_tokens.weight"]], "weight_decay": 0.0 if after_decay else WD},
              {"params": [params["model.norm.weight"]], "weight_decay": 0.0}]
    opt = cls(groups, lr=lrs[0], betas=(BETA1, BETA2), eps=EPS)
    out = {}
    for k in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lrs[k]
        for n, p in params.items():
            p.grad = torch.from_numpy(grads[k][n]).clone()
        opt.step()
        if after_decay:
            with torch.no_grad():
                params["model.embed_tokens.weight"].mul_(1.0 - lrs[k] * WD)
        if k == 0:
            out.update({"after1." + n: p.detach().numpy().copy() for n, p in params.items()})
    out.update({n: p.detach().numpy().copy() for n, p in params.items()})
    return out


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(2024)
    lrs = [float(x) for x in 10.0 ** rng.uniform(-3, -2, STEPS)]
    init = {n: (0.2 * rng.standard_normal(s)).astype(np.float32) for n, s, _ in TENSORS}
    init["model.norm.weight"] = (1.0 + 0.1 * rng.standard_normal(32)).astype(np.float32)
    # float16 values (exact in float32) keep the file small
    grads = [{n: (10.0 ** rng.uniform(-2, 0) * rng.standard_normal(s)).astype(np.float16).astype(np.float32)
              for n, s, _ in TENSORS} for _ in range(STEPS)]
    out = {"init." + n: a for n, a in init.items()}
    for k in range(STEPS):
        out.update({f"grad{k + 1}.{n}": a.astype(np.float16) for n, a in grads[k].items()})
    for n, a in run(galore_torch.GaLoreAdamW, init, grads, lrs, False).items():
        out["galore." + n] = a
    for n, a in run(galore_torch.GaLoreAdamW8bit, init, grads, lrs, True).items():
        if not n.startswith("after1."):
            out["galore8bit." + n] = a
    out["lr"] = np.array(lrs, dtype=np.float64)
    out["hparams"] = np.array([BETA1, BETA2, EPS, WD, RANK, GAP, SCALE], dtype=np.float64)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    d = os.path.join(root, "tests", "golden", "optim")
    os.makedirs(d, exist_ok=True)
    meta = {"golden": json.dumps({"decay": {n: dec for n, _, dec in TENSORS},
                                  "versions": {"torch": torch.__version__, "galore-torch": "1.0",
                                               "bitsandbytes": bnb.__version__, "numpy": np.__version__,
                                               "safetensors": safetensors.__version__}})}
    path = os.path.join(d, "galore.safetensors")
    save_file(out, path, metadata=meta)
    os.chmod(path, 0o644)
    print(path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
