#!/usr/bin/env python3
"""Tiny random Hugging Face models and their float64 forward/backward goldens.

For each variant NAME writes tests/golden/models/NAME/:
  config.json, model.safetensors  as save_pretrained writes them (float32)
  golden.safetensors              input_ids I32 [T], logits F64 [T,V], loss F64 [1],
                                  grad.<hf name> F64 per trainable parameter
  errors.json                     relative L2 errors of torch fp32 and bf16-autocast runs vs the golden

The golden is computed in float64 end to end. transformers' own model.double() is not: its RMSNorm,
softmax, RoPE angles and causal-LM loss upcast/downcast through float32. Those four places are
patched for float64 inputs only (fp32/bf16 runs go through the unpatched code), and the result is
cross-checked against an independent float64 forward written here (f64_selfcheck in errors.json).
"""
import argparse, copy, json, math, os, sys, time

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.numpy import save_file
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

MODULES = {"llama": modeling_llama, "qwen2": modeling_qwen2, "qwen3": modeling_qwen3, "mistral": modeling_mistral}
CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}

L, E, T, V = 2, 32, 40, 128
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# original 64 with theta 1e4 and head_dim 8: the yarn ramp runs over dimensions 0..2, so the first pair keeps
# its frequency, the second is half interpolated, the rest are interpolated; attention_factor 1 + 0.1 ln 4.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 2.0}
# (name, family, seed, config overrides)
VARIANTS = [
    ("llama_mha_tied", "llama", 1, dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                                        tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6)),
    ("llama_gqa_untied", "llama", 2, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=56,
                                          tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5)),
    # head_dim 8: wavelengths 2*pi*10000^(k/4) = 6.3, 63, 628, 6283; with original context 64 the bands are
    # < 16 unchanged, 16..64 smoothed, > 64 divided by 8, so all three llama3 bands are exercised.
    ("llama3_scaling", "llama", 3, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                        tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=LLAMA3,
                                        max_position_embeddings=128, rms_norm_eps=1e-5)),
    ("llama_attn_bias", "llama", 4, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                         tie_word_embeddings=True, rope_theta=10000.0, attention_bias=True,
                                         rms_norm_eps=1e-6)),
    ("qwen2", "qwen2", 5, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=56,
                               tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False,
                               rms_norm_eps=1e-6)),
    ("qwen3", "qwen3", 6, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=48,
                               tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    ("mistral", "mistral", 7, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=56,
                                   tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None,
                                   rms_norm_eps=1e-5)),
    ("qwen2_yarn", "qwen2", 8, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                    tie_word_embeddings=True, rope_theta=10000.0, rope_scaling=YARN,
                                    max_position_embeddings=256, use_sliding_window=False, rms_norm_eps=1e-6)),
    ("llama_linear", "llama", 9, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                      tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=LINEAR,
                                      rms_norm_eps=1e-5)),
]

# ---------------------------------------------------------------- float64 patches (only for float64 tensors)
F64 = {"on": False}


def head_dim(cfg):
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def inv_freq64(cfg):
    rp = cfg.rope_parameters
    hd = head_dim(cfg)
    inv = 1.0 / (rp["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if rp.get("rope_type", "default") == "llama3":
        f, lo, hi, old = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]
        wl = 2 * math.pi / inv
        out = np.where(wl > old / lo, inv / f, inv)
        s = (old / wl - lo) / (hi - lo)
        mid = ~(wl < old / hi) & ~(wl > old / lo)
        inv = np.where(mid, (1 - s) * out / f + s * out, out)
    elif rp.get("rope_type") == "linear":
        inv = inv / rp["factor"]
    elif rp.get("rope_type") == "yarn":
        # The YaRN paper's ramp, in float64 (transformers computes it in float32).
        f, old = rp["factor"], rp["original_max_position_embeddings"]
        fast, slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1
        dim_of = lambda rot: hd * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(rp["rope_theta"]))
        lo, hi = math.floor(dim_of(fast)), math.ceil(dim_of(slow))
        lo, hi = max(lo, 0), min(hi, hd - 1)
        ramp = np.clip((np.arange(hd // 2, dtype=np.float64) - lo) / (hi - lo if hi != lo else 0.001), 0, 1)
        inv = inv / f * ramp + inv * (1 - ramp)
    else:
        assert rp.get("rope_type", "default") == "default", rp
    return torch.from_numpy(inv)


def patch_family(mod):
    fam = mod.__name__.split(".")[-1].replace("modeling_", "")
    pre = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[fam]
    norm = getattr(mod, pre + "RMSNorm")
    norm_fwd = norm.forward

    def norm_forward(self, x):
        if F64["on"] and x.dtype == torch.float64:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
        return norm_fwd(self, x)
    norm.forward = norm_forward

    rot = getattr(mod, pre + "RotaryEmbedding")
    rot_fwd = rot.forward

    def rot_forward(self, x, position_ids):
        if F64["on"] and x.dtype == torch.float64:
            fr = position_ids[..., None].to(torch.float64) * self.inv_freq64.to(x.device)
            emb = torch.cat((fr, fr), dim=-1)
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return rot_fwd(self, x, position_ids)
    rot.forward = rot_forward

    eager = mod.eager_attention_forward

    def eager_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if not (F64["on"] and query.dtype == torch.float64):
            return eager(module, query, key, value, attention_mask, scaling, dropout, **kw)
        k = mod.repeat_kv(key, module.num_key_value_groups)
        v = mod.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w
    mod.eager_attention_forward = eager_forward


for _m in MODULES.values():
    patch_family(_m)


# ---------------------------------------------------------------- independent float64 reference
def ref_loss_logits(m, cfg, fam, ids):
    P = dict(m.named_parameters())
    W = lambda n: P[n]
    lin = lambda x, n: x @ W(n + ".weight").T + (P[n + ".bias"] if n + ".bias" in P else 0)
    rms = lambda x, w, eps: w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n, H, Hkv, hd, eps = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg), cfg.rms_norm_eps
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq64(cfg)[None]
    rp = cfg.rope_parameters
    # YaRN scales cos and sin by 0.1 ln(factor) + 1 (the paper's sqrt(1/t)); every other type by 1.
    af = 0.1 * math.log(rp["factor"]) + 1 if rp.get("rope_type") == "yarn" and rp["factor"] > 1 else 1.0
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None] * af, torch.cat([ang.sin()] * 2, -1)[:, None] * af
    rope = lambda x: x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    x = W("model.embed_tokens.weight")[ids]
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        h = rms(x, W(p + "input_layernorm.weight"), eps)
        q = lin(h, p + "self_attn.q_proj").view(n, H, hd)
        k = lin(h, p + "self_attn.k_proj").view(n, Hkv, hd)
        v = lin(h, p + "self_attn.v_proj").view(n, Hkv, hd)
        if fam == "qwen3":
            q, k = rms(q, W(p + "self_attn.q_norm.weight"), eps), rms(k, W(p + "self_attn.k_norm.weight"), eps)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        a = torch.softmax(s.masked_fill(mask, -math.inf), -1)
        x = x + lin(torch.einsum("hts,shd->thd", a, v).reshape(n, H * hd), p + "self_attn.o_proj")
        h = rms(x, W(p + "post_attention_layernorm.weight"), eps)
        x = x + lin(F.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    logits = rms(x, W("model.norm.weight"), eps) @ m.lm_head.weight.T
    return F.cross_entropy(logits[:-1], ids[1:]), logits


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def run_variant(name, fam, seed, over, outdir):
    Cfg, Cls = CLASSES[fam]
    kw = dict(vocab_size=V, hidden_size=E, num_hidden_layers=L, hidden_act="silu", max_position_embeddings=64,
              attention_dropout=0.0, initializer_range=0.2)  # 0.2, not 0.02: attention far from uniform
    if fam == "llama":
        kw["mlp_bias"] = False
    kw.update(over)
    cfg = Cfg(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Cls(cfg).float().eval()
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for mname, mod in model.named_modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.weight.copy_(1 + 0.1 * torch.randn(mod.weight.shape, generator=g))
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ids = torch.randint(0, V, (T,), generator=g)
    d = os.path.join(outdir, name)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    cfg = model.config

    # golden: float64, patched
    m64 = copy.deepcopy(model).double()
    m64.model.rotary_emb.inv_freq64 = inv_freq64(cfg)
    hf32 = m64.model.rotary_emb.inv_freq.double()
    assert float(((hf32 - m64.model.rotary_emb.inv_freq64) / m64.model.rotary_emb.inv_freq64).abs().max()) < 1e-6
    F64["on"] = True
    logits = m64(ids[None]).logits[0]
    loss = F.cross_entropy(logits[:-1], ids[1:])  # = transformers' causal-LM loss, without its float32 cast
    loss.backward()
    loss = loss.detach()
    F64["on"] = False
    names = [n for n, _ in m64.named_parameters()]
    golden = {"input_ids": ids.numpy().astype(np.int32), "logits": logits.detach().numpy(),
              "loss": loss.detach().reshape(1).numpy()}
    for n, p in m64.named_parameters():
        golden["grad." + n] = p.grad.numpy()
    save_file(golden, os.path.join(d, "golden.safetensors"))

    # self-check against the independent reference
    params = [p for _, p in m64.named_parameters()]
    rloss, rlogits = ref_loss_logits(m64, cfg, fam, ids)
    rgrads = torch.autograd.grad(rloss, params)
    selfcheck = max([rel(logits, rlogits), abs(float(loss.detach() - rloss.detach()) / float(rloss.detach()))] +
                    [rel(p.grad, rg) for p, rg in zip(params, rgrads)])

    def errs(run):
        m = copy.deepcopy(run[0])
        m.zero_grad(set_to_none=True)
        with run[1]():
            out = m(ids[None], labels=ids[None])
        out.loss.backward()
        e = {"logits": rel(out.logits[0], logits), "loss": abs(float(out.loss.detach()) - float(loss.detach())) / abs(float(loss))}
        for n, p in m.named_parameters():
            e["grad." + n] = rel(p.grad, golden_t["grad." + n])
        return e
    golden_t = {k: torch.from_numpy(v) for k, v in golden.items()}
    import contextlib
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    m64raw = copy.deepcopy(model).double()  # transformers' own double path, for reference
    res = {"fp32": errs((model, contextlib.nullcontext)), "bf16": errs((model, bf16)),
           "hf_double_as_is": errs((m64raw, contextlib.nullcontext)), "f64_selfcheck": selfcheck,
           "torch_version": torch.__version__, "transformers_version": transformers.__version__}
    with open(os.path.join(d, "errors.json"), "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
    return dict(name=name, params=sum(p.numel() for p in model.parameters()), kb=size / 1024,
                fp32=max(res["fp32"].values()), bf16=max(res["bf16"].values()),
                hf64=max(res["hf_double_as_is"].values()), self=selfcheck, loss=float(loss))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "..", "tests", "golden", "models"))
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    a = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    t0 = time.time()
    rows = [run_variant(n, f, s, o, os.path.abspath(a.out)) for n, f, s, o in VARIANTS if not a.only or n in a.only]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; max relative error over tensors")
    print(f"{'variant':18} {'params':>7} {'KB':>6} {'loss':>8} {'fp32':>9} {'bf16':>9} {'hf_f64':>9} {'selfchk':>9}")
    for r in rows:
        print(f"{r['name']:18} {r['params']:7d} {r['kb']:6.0f} {r['loss']:8.4f} {r['fp32']:9.2e} {r['bf16']:9.2e} "
              f"{r['hf64']:9.2e} {r['self']:9.2e}")
    print(f"{time.time() - t0:.1f} s")
    bad = [r["name"] for r in rows if r["self"] > 1e-12]
    if bad:
        sys.exit(f"float64 self-check failed for {bad}")


if __name__ == "__main__":
    main()
