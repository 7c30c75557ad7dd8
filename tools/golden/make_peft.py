#!/usr/bin/env python3
"""PEFT LoRA / rsLoRA / DoRA adapters on the tiny golden models, and their float64 goldens.

For each variant NAME writes tests/golden/peft/NAME/:
  adapter_config.json, adapter_model.safetensors   as PeftModel.save_pretrained writes them (float32)
  targets.json     the modules PEFT adapted (name, r, lora_alpha, scaling, in/out features), the modules it
                   wrapped for modules_to_save, and the base model's named_modules()
and, for the variants with numbers (not the config-only ones):
  golden.safetensors  input_ids I32 [T] (the model golden's), logits F64 [T,V], loss F64 [1],
                      grad.<adapter key> F64 for every tensor of adapter_model.safetensors,
                      merged.<hf name> F64: merge_and_unload()'s layer-0 q_proj (variants with a merge golden)
  errors.json      torch fp32 / bf16-autocast errors against the golden, the float64 self-check, the merge
                   checks, the warnings PeftModel.from_pretrained gave on reloading the saved adapter, versions

Adapter values are drawn in float32 (so the saved float32 file holds exactly the values the float64 run used):
lora_A 0.3 randn, lora_B 0.1 randn (non-zero, so lora_A gets a gradient), DoRA magnitudes the row norms of
W + scale B A times (1 + 0.1 randn), a modules_to_save copy the base weight + 0.01 randn. The float64 run uses
make_models.py's float64 patches of transformers and is checked against an independent float64 forward here.

Run from anywhere; paths in adapter_config.json are relative to the repository root
(base_model_name_or_path "tests/golden/models/NAME"). PYTHONHASHSEED is pinned (the script re-executes itself)
because PEFT writes target_modules from a Python set.
"""
import argparse, contextlib, copy, hashlib, json, math, os, sys, time, warnings

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import torch
import torch.nn.functional as F
import transformers
import peft
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import save_file
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import make_models as mm  # noqa: E402  (its float64 patches of transformers apply on import)

ALL = "all-linear"
# (name, base model, seed, LoraConfig arguments, numbers?, merge golden?)
VARIANTS = [
    ("llama_gqa_untied_lora", "llama_gqa_untied", 11,
     dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0), True, True),
    ("qwen2_dora", "qwen2", 12,
     dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0, use_dora=True), True, True),
    # DoRA with dropout, the masks oomless draws (DROPOUT_SEED) applied in PEFT's training forward.
    ("qwen2_dora_dropout", "qwen2", 16,
     dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.3, use_dora=True), True, False),
    ("qwen3_rslora_lm_head", "qwen3", 13,
     dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0, use_rslora=True, modules_to_save=["lm_head"]),
     True, False),
    # Config-only: module lists with a layer filter, per-module rank and alpha, dropout.
    ("mistral_patterns", "mistral", 14,
     dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1],
          rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 16}, lora_dropout=0.05), False, False),
    # Config-only: a regex target, a regex exclusion, embed_tokens saved on a tied model (both keys written).
    ("llama_mha_tied_regex", "llama_mha_tied", 15,
     dict(r=2, lora_alpha=4, target_modules=r"model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)",
          exclude_modules=r".*\.0\.mlp\..*", modules_to_save=["embed_tokens"], ensure_weight_tying=True,
          init_lora_weights="gaussian"), False, False),
]


# The dropout seed the C++ test gives Model::set_dropout_seed; masks as oomless's dropout_keep draws them.
DROPOUT_SEED = 1234
PROJ_INDEX = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 3, "gate_proj": 4, "up_proj": 5, "down_proj": 6}
M64 = (1 << 64) - 1


def oomless_mask(module_name, T, K, p):
    """(T, K) float64 inverted-dropout mask of an adapted projection: Model::dropout_seed and dropout_keep."""
    parts = module_name.split(".")
    layer, proj = int(parts[parts.index("layers") + 1]), PROJ_INDEX[parts[-1]]
    seed = DROPOUT_SEED ^ ((0xD1B54A32D192ED03 * (layer * 7 + proj + 1)) & M64)
    j = np.arange(T * K, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15) * (j + np.uint64(1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    keep = (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 >= p
    return torch.from_numpy(np.where(keep, 1.0 / (1.0 - p), 0.0).reshape(T, K))


class FixedDropout(torch.nn.Module):
    """PEFT's lora_dropout module replaced by a given mask (not nn.Identity, so PEFT takes its dropout path)."""
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return x * self.mask.to(x.dtype)


def fix_dropout(pm, T, p):
    """Every LoRA layer's dropout as oomless's masks; the model in training mode (PEFT's dropout branch)."""
    if p == 0:
        return
    for name, mod in lora_layers(pm).items():
        mod.lora_dropout["default"] = FixedDropout(oomless_mask(name, T, mod.get_base_layer().in_features, p))
    pm.train()


def adapter_key(param_name):
    """The key save_pretrained writes for a trainable parameter of the PeftModel (adapter name removed)."""
    k = param_name.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
    k = k.replace(".modules_to_save.default.", ".")
    return k.replace(".default.", ".")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def lora_layers(pm):
    return {n: m for n, m in pm.base_model.model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


def set_adapter_values(pm, seed, use_dora):
    """Seeded float32 values for every trainable tensor; returns {adapter key: float32 tensor}."""
    g = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, mod in sorted(lora_layers(pm).items()):
            A, B = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            A.copy_(0.3 * torch.randn(A.shape, generator=g))
            B.copy_(0.1 * torch.randn(B.shape, generator=g))
            if use_dora:
                W = mod.get_base_layer().weight.double()
                norm = (W + mod.scaling["default"] * (B.double() @ A.double())).norm(dim=1)
                mag = (norm * (1 + 0.1 * torch.randn(norm.shape, generator=g, dtype=torch.float64))).float()
                mod.lora_magnitude_vector["default"].weight.copy_(mag)
        for n, p in sorted(pm.named_parameters()):
            if p.requires_grad and ".modules_to_save." in n:
                p.copy_(p + 0.01 * torch.randn(p.shape, generator=g))
    for n, p in pm.named_parameters():
        if p.requires_grad:
            values[adapter_key(n)] = p.detach().float().clone()
    return values


def load_values(pm, values):
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(values[adapter_key(n)].to(p.dtype))


# ---------------------------------------------------------------- independent float64 reference with adapters
def ref_loss_logits(base, cfg, fam, ids, adapter, targets, use_dora, dropout=0.0):
    """transformers' decoder written out in float64, every targeted projection with LoRA (or DoRA) added; with
    dropout x_d = x * mask on the adapter's input and DoRA as y = b + x W^T + (g - 1) x_d W^T + g s B A x_d."""
    P = {n: p.detach().double() for n, p in base.named_parameters()}
    for k, v in adapter.items():  # modules_to_save copies replace the base weights
        if not (".lora_" in k):
            P[k.removeprefix("base_model.model.")] = v.double()

    def lin(x, n):
        W = P[n + ".weight"]
        b = P.get(n + ".bias", 0)
        if n not in targets:
            return x @ W.T + b
        key = "base_model.model." + n
        A, Bm, s = adapter[key + ".lora_A.weight"].double(), adapter[key + ".lora_B.weight"].double(), targets[n]["scaling"]
        xd = x * oomless_mask(n, x.shape[0], x.shape[1], dropout) if dropout else x
        lora = (xd @ A.T) @ Bm.T * s
        if not use_dora:
            return x @ W.T + b + lora
        # DoRA: y = b + m / ||W + s B A||_row (W x + s B A x), the norm a constant (detached)
        norm = (W + s * Bm @ A).norm(dim=1).detach()
        g = adapter[key + ".lora_magnitude_vector"].double() / norm
        if dropout:
            return b + x @ W.T + (g - 1) * (xd @ W.T) + g * lora
        return b + g * (x @ W.T + lora)

    rms = lambda x, w, eps: w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n, H, Hkv, hd, eps = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, mm.head_dim(cfg), cfg.rms_norm_eps
    ang = torch.arange(n, dtype=torch.float64)[:, None] * mm.inv_freq64(cfg)[None]
    assert cfg.rope_parameters.get("rope_type", "default") == "default"
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rope = lambda x: x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    x = P["model.embed_tokens.weight"][ids]
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        h = rms(x, P[p + "input_layernorm.weight"], eps)
        q = lin(h, p + "self_attn.q_proj").view(n, H, hd)
        k = lin(h, p + "self_attn.k_proj").view(n, Hkv, hd)
        v = lin(h, p + "self_attn.v_proj").view(n, Hkv, hd)
        if fam == "qwen3":
            q, k = rms(q, P[p + "self_attn.q_norm.weight"], eps), rms(k, P[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        a = torch.softmax(s.masked_fill(mask, -math.inf), -1)
        x = x + lin(torch.einsum("hts,shd->thd", a, v).reshape(n, H * hd), p + "self_attn.o_proj")
        h = rms(x, P[p + "post_attention_layernorm.weight"], eps)
        x = x + lin(F.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = P["lm_head.weight"] if "lm_head.weight" in P and not cfg.tie_word_embeddings else P["model.embed_tokens.weight"]
    logits = rms(x, P["model.norm.weight"], eps) @ head.T
    return F.cross_entropy(logits[:-1], ids[1:]), logits


def describe_targets(pm):
    out = []
    for name, mod in sorted(lora_layers(pm).items()):
        base = mod.get_base_layer()
        out.append({"name": name, "r": mod.r["default"], "lora_alpha": mod.lora_alpha["default"],
                    "scaling": mod.scaling["default"], "in_features": base.in_features,
                    "out_features": base.out_features, "use_dora": bool(mod.use_dora["default"])})
    return out


def saved_modules(pm):
    return sorted(n for n, m in pm.base_model.model.named_modules()
                  if isinstance(m, peft.utils.other.ModulesToSaveWrapper))


def tensor_digest(t):
    a = t.detach().double().contiguous().numpy()
    return {"sha256_f64": hashlib.sha256(a.tobytes()).hexdigest(), "norm": float(np.linalg.norm(a)),
            "sum": float(a.sum())}


def run_variant(name, model_name, seed, lora_kw, numbers, merge, outroot):
    os.chdir(ROOT)  # base_model_name_or_path is the path as given: keep it relative to the repository
    model_dir = os.path.join("tests", "golden", "models", model_name)
    fam = json.load(open(os.path.join(model_dir, "config.json")))["model_type"]
    d = os.path.join(outroot, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))

    def base32():
        m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        m.config._attn_implementation = "eager"
        return m.eval()

    lcfg = lambda: LoraConfig(task_type="CAUSAL_LM", **copy.deepcopy(lora_kw))
    model = base32()
    modules = [n for n, _ in model.named_modules() if n]
    pm32 = get_peft_model(model, lcfg())
    values = set_adapter_values(pm32, 1000 + seed, lora_kw.get("use_dora", False))
    pm32.save_pretrained(d)
    os.remove(os.path.join(d, "README.md"))  # the model card template save_pretrained adds
    os.chmod(os.path.join(d, "adapter_model.safetensors"), 0o644)
    saved = load_file(os.path.join(d, "adapter_model.safetensors"))
    # A tied model with embed_tokens saved (ensure_weight_tying) gets the same matrix under lm_head too.
    extra = set(saved) - set(values)
    if extra == {"base_model.model.lm_head.weight"}:
        values["base_model.model.lm_head.weight"] = values["base_model.model.model.embed_tokens.weight"]
    assert set(saved) == set(values), (sorted(set(saved) - set(values)), sorted(set(values) - set(saved)))
    for k in saved:
        assert torch.equal(saved[k], values[k]), k
    targets = describe_targets(pm32)
    info = {"targets": targets, "modules_to_save": saved_modules(pm32), "modules": modules,
            "peft_version": peft.__version__, "transformers_version": transformers.__version__,
            "torch_version": torch.__version__}
    with open(os.path.join(d, "targets.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")

    # Reload as a user would: PeftModel.from_pretrained must not warn, and must give back the same values.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = PeftModel.from_pretrained(base32(), d)
    load_warnings = sorted({str(w.message) for w in caught if not issubclass(w.category, FutureWarning)})
    for n, p in reloaded.named_parameters():
        k = adapter_key(n)
        if k in values:
            assert torch.equal(p.detach().float(), values[k]), k
    if not numbers:
        return dict(name=name, kb=dir_kb(d), loss=float("nan"), fp32=0, bf16=0, self=0, warnings=load_warnings)

    # float64 golden, transformers patched as in make_models.py
    g = load_file(os.path.join(model_dir, "golden.safetensors"))
    ids = g["input_ids"].long()
    m64 = base32().double()
    m64.model.rotary_emb.inv_freq64 = mm.inv_freq64(m64.config)
    pm64 = get_peft_model(m64, lcfg())
    load_values(pm64, values)
    drop = lora_kw.get("lora_dropout", 0.0)
    fix_dropout(pm64, len(ids), drop)
    for n, p in pm64.named_parameters():
        assert p.dtype == torch.float64, n
    mm.F64["on"] = True
    logits = pm64(input_ids=ids[None]).logits[0]
    loss = F.cross_entropy(logits[:-1], ids[1:])  # transformers' causal-LM loss without its float32 cast
    loss.backward()
    mm.F64["on"] = False
    golden = {"input_ids": ids.numpy().astype(np.int32), "logits": logits.detach().numpy(),
              "loss": loss.detach().reshape(1).numpy()}
    grads = {}
    for n, p in pm64.named_parameters():
        if p.requires_grad:
            grads[adapter_key(n)] = p.grad.detach().clone()
            golden["grad." + adapter_key(n)] = p.grad.numpy()
    assert set(grads) == set(values)

    # independent float64 reference
    tmap = {t["name"]: t for t in targets}
    adapter64 = {k: v.double().requires_grad_(True) for k, v in values.items()}
    base64 = base32().double()
    rloss, rlogits = ref_loss_logits(base64, base64.config, fam, ids, adapter64, tmap, lora_kw.get("use_dora", False),
                                     drop)
    keys = sorted(adapter64)
    rgrads = torch.autograd.grad(rloss, [adapter64[k] for k in keys])
    selfcheck = max([rel(logits, rlogits), abs(float(loss.detach() - rloss.detach()) / float(rloss.detach()))] +
                    [rel(grads[k], rg) for k, rg in zip(keys, rgrads)])

    def errs(autocast):
        m = get_peft_model(base32(), lcfg())
        load_values(m, values)
        fix_dropout(m, len(ids), drop)
        with autocast():
            out = m(input_ids=ids[None], labels=ids[None])
        out.loss.backward()
        e = {"logits": rel(out.logits[0], logits), "loss": abs(float(out.loss) - float(loss)) / abs(float(loss))}
        for n, p in m.named_parameters():
            if p.requires_grad:
                e["grad." + adapter_key(n)] = rel(p.grad, grads[adapter_key(n)])
        return e

    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    res = {"fp32": errs(contextlib.nullcontext), "bf16": errs(bf16), "f64_selfcheck": selfcheck,
           "load_warnings": load_warnings, "peft_version": peft.__version__,
           "torch_version": torch.__version__, "transformers_version": transformers.__version__}

    if merge:
        pmm = get_peft_model(base32().double(), lcfg())
        load_values(pmm, values)
        merged = pmm.merge_and_unload()
        sd = merged.state_dict()
        golden["merged.model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"].numpy()
        merged.model.rotary_emb.inv_freq64 = mm.inv_freq64(merged.config)
        mm.F64["on"] = True
        with torch.no_grad():
            mlogits = merged(input_ids=ids[None]).logits[0]
        mm.F64["on"] = False
        # Every tensor of the merged model (lm_head of a tied model is the embedding, listed once), float64.
        res["merged"] = {"logits_vs_unmerged": rel(mlogits, logits),
                         "tensors": {k: tensor_digest(v) for k, v in sorted(sd.items())
                                     if not (merged.config.tie_word_embeddings and k == "lm_head.weight")}}
    save_file(golden, os.path.join(d, "golden.safetensors"))
    os.chmod(os.path.join(d, "golden.safetensors"), 0o644)
    with open(os.path.join(d, "errors.json"), "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
        f.write("\n")
    return dict(name=name, kb=dir_kb(d), loss=float(loss), fp32=max(v for v in res["fp32"].values()),
                bf16=max(v for v in res["bf16"].values()), self=selfcheck, warnings=load_warnings)


def dir_kb(d):
    return sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d)) / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "golden", "peft"))
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    a = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    t0 = time.time()
    out = os.path.abspath(a.out)
    rows = [run_variant(*v, out) for v in VARIANTS if not a.only or v[0] in a.only]
    print(f"peft {peft.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'variant':22} {'KB':>6} {'loss':>8} {'fp32':>9} {'bf16':>9} {'selfchk':>9}  load warnings")
    for r in rows:
        print(f"{r['name']:22} {r['kb']:6.0f} {r['loss']:8.4f} {r['fp32']:9.2e} {r['bf16']:9.2e} {r['self']:9.2e}  "
              f"{r['warnings'] or 'none'}")
    print(f"{time.time() - t0:.1f} s")
    bad = [r["name"] for r in rows if r["self"] > 1e-12 or r["warnings"]]
    if bad:
        sys.exit(f"float64 self-check failed or reloading warned for {bad}")


if __name__ == "__main__":
    main()
