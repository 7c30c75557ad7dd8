#!/usr/bin/env python3
"""bitsandbytes NF4 goldens for oomless' src/quant/ (tests/nf4_test.cpp, tests/nf4_slowtest.cpp).

Writes, with bitsandbytes' CPU path (bitsandbytes.functional on CPU tensors, torch on 1 thread unless
said otherwise):

tests/golden/nf4/nf4.safetensors
  nf4_code F32 [16], dynamic_map F32 [256]   get_4bit_type("nf4"), create_dynamic_map()
  input.NAME          F32 or BF16, a tensor quantised (shape as given to quantize_4bit); several cases
                      (blocksizes, with and without double quant) share one
  CASE.packed         U8 [(n+1)/2]  quantize_4bit's output (flattened; bnb stores it as [(n+1)/2, 1])
  CASE.absmax         F32 [blocks]  (plain cases)
  CASE.absmax_codes   U8 [blocks], CASE.nested_absmax F32 [ceil(blocks/256)], CASE.offset F32 [1],
  CASE.absmax_deq     F32 [blocks]  (double-quantised cases: compress_statistics=True; absmax_deq is
                      dequantize_blockwise(codes) + offset, the scales dequantize_4bit uses)
  CASE.dequant        F32 [n]       dequantize_4bit with the state's dtype set to float32 (only for
                      some cases; the others carry its SHA-256 in the metadata)
  torch_mean.n I32, torch_mean.threads I32, torch_mean.value F32: torch.mean of the float32 vector
                      x[i] = ((i * 2654435761) mod 2^32) / 2^32 with torch.set_num_threads(threads)
  metadata "golden": JSON {"cases": {CASE: {"input", "n", "shape", "dtype", "blocksize", "double_quant",
                      "dequant_sha256", "dequant_bf16_sha256" (bf16 inputs: bnb's own bf16 output)}},
                      "versions": {...}, "cpu_capability": ...}

tests/golden/bnb4/llama_gqa_untied/   tests/golden/models/llama_gqa_untied loaded by transformers with
  BitsAndBytesConfig(load_in_4bit, nf4, double quant, compute dtype float32) on CPU and saved with
  save_pretrained (config.json with quantization_config, model.safetensors, generation_config.json),
  plus golden.safetensors: input_ids I32 [T] (the model golden's ids), logits F32 [T, V] and loss F32 [1]
  of the quantised model in float32 (labels = input_ids), deq.<linear>.weight F32 (out, in): each
  linear's weight as bitsandbytes dequantises it. Metadata "golden": versions.

tests/golden/nf4/smollm2.json (with --gguf PATH, else skipped): for a few tensors of the
  SmolLM2-135M-Instruct Q4_1 GGUF, the SHA-256 of gguf-py's float32 dequantisation and of
  quantize_4bit's outputs from it (blocksize 64; plain; double quant with torch on 1 and 2 threads).

Run: tools/golden/.venv/bin/python tools/golden/make_nf4.py [--gguf PATH]
Deterministic: seeded; rerunning rewrites identical files.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

import numpy as np
import torch

import bitsandbytes
import bitsandbytes.functional as F
import safetensors
import transformers
from safetensors.numpy import save_file
from safetensors.torch import load_file
from safetensors.torch import save_file as save_torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_NF4 = os.path.join(ROOT, "tests", "golden", "nf4")
OUT_BNB4 = os.path.join(ROOT, "tests", "golden", "bnb4", "llama_gqa_untied")
SRC_MODEL = os.path.join(ROOT, "tests", "golden", "models", "llama_gqa_untied")


def versions():
    from importlib.metadata import version
    return {"torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__,
            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__, "gguf": version("gguf")}


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def u8(t):
    return t.contiguous().view(torch.uint8).numpy().reshape(-1).copy()


def f32(t):
    return t.contiguous().to(torch.float32).numpy().reshape(-1).copy()


def special_values(n, rng):
    """A float32 tensor of n values with the cases that decide ties and edges: an all-zero block, the
    exact midpoints between NF4 codes (times a block absmax of 1), the codes themselves, -0, subnormals,
    values at +-absmax, then random normals."""
    code = F.get_4bit_type("nf4", device="cpu").numpy()
    mids = (code[:-1] + code[1:]) / np.float32(2)
    x = rng.standard_normal(n).astype(np.float32)
    x[0:64] = 0
    x[64:79] = mids
    x[79] = 1.0
    x[80:95] = np.nextafter(mids, np.float32(2))
    x[95] = -1.0
    x[96:111] = np.nextafter(mids, np.float32(-2))
    x[111] = 1.0
    x[112:128] = code
    x[128:132] = [-0.0, 1e-45, -1e-40, 1e-38]
    x[132] = 3.0
    x[133] = -3.0
    return x


def quantize_case(x, blocksize, dq):
    """bnb's quantize_4bit / dequantize_4bit on tensor x: a dict of the arrays to store."""
    p, st = F.quantize_4bit(x, blocksize=blocksize, quant_type="nf4", compress_statistics=dq)
    out = {"packed": u8(p)}
    if dq:
        out["absmax_codes"] = u8(st.absmax)
        out["nested_absmax"] = f32(st.state2.absmax)
        out["offset"] = f32(st.offset.reshape(1))
        deq = F.dequantize_blockwise(st.absmax, st.state2) + st.offset
        out["absmax_deq"] = f32(deq)
        assert st.state2.blocksize == 256
    else:
        out["absmax"] = f32(st.absmax)
    native = F.dequantize_4bit(p, st)
    st.dtype = torch.float32
    out["dequant"] = f32(F.dequantize_4bit(p, st))
    extra = {}
    if x.dtype == torch.bfloat16:
        extra["dequant_bf16_sha256"] = sha(u8(native))
    return out, extra


def make_nf4(rng):
    torch.set_num_threads(1)
    tensors = {"nf4_code": F.get_4bit_type("nf4", device="cpu").numpy(),
               "dynamic_map": F.create_dynamic_map().numpy()}
    cases = {}

    def add(name, x, blocksize, dq, keep_dequant, input_name):
        arrays, extra = quantize_case(x, blocksize, dq)
        if input_name not in tensors:
            tensors[input_name] = x.contiguous().clone()
        for k, v in arrays.items():
            if k == "dequant" and not keep_dequant:
                continue
            tensors[name + "." + k] = v
        cases[name] = dict(n=int(x.numel()), shape=list(x.shape), dtype=str(x.dtype).replace("torch.", ""),
                           blocksize=blocksize, double_quant=dq, input=input_name,
                           dequant_sha256=sha(arrays["dequant"]), **extra)

    shapes = [(1,), (63,), (65,), (1000,), (4099,), (37, 130)]
    inputs = {}
    for shape in shapes:
        n = int(np.prod(shape))
        x = special_values(n, rng) if n >= 1000 else rng.standard_normal(n).astype(np.float32)
        x *= np.float32(rng.uniform(0.01, 2.0))
        inputs[shape] = torch.from_numpy(x.reshape(shape))
    for shape, x in inputs.items():
        tag = "x".join(str(s) for s in shape)
        for bs in (64, 128, 256):
            for dq in (False, True):
                keep = bs == 64 and dq and x.numel() <= 1000
                add(f"f32_{tag}_bs{bs}{'_dq' if dq else ''}", x, bs, dq, keep_dequant=keep,
                    input_name=f"input.f32_{tag}")
        xb = x.to(torch.bfloat16)
        for bs, dq in ((64, False), (64, True), (128, True)):
            add(f"bf16_{tag}_bs{bs}{'_dq' if dq else ''}", xb, bs, dq, keep_dequant=False,
                input_name=f"input.bf16_{tag}")
    # More than 256 scales: several nested blocks, the last one partial.
    big = torch.from_numpy((rng.standard_normal(16999) * 0.05).astype(np.float32)).to(torch.bfloat16)
    add("bf16_16999_bs64_dq", big, 64, True, keep_dequant=False, input_name="input.bf16_16999")
    # Edge cases: every scale equal (absmax - offset is all zero), an all-zero tensor, NaN and inf.
    add("f32_const256_bs64_dq", torch.full((256,), 0.5), 64, True, keep_dequant=True, input_name="input.f32_const256")
    for dq in (False, True):
        add(f"f32_zeros130_bs64{'_dq' if dq else ''}", torch.zeros(130), 64, dq, keep_dequant=True,
            input_name="input.f32_zeros130")
    sp = torch.from_numpy(rng.standard_normal(200).astype(np.float32))
    sp[3], sp[70], sp[140], sp[141] = float("nan"), float("inf"), float("-inf"), float("nan")
    add("f32_nonfinite200_bs64", sp, 64, False, keep_dequant=True, input_name="input.f32_nonfinite200")

    # torch.mean's float32 summation order (the double-quant offset).
    ns, ts, vs = [], [], []
    for n in (1, 3, 7, 8, 9, 31, 100, 257, 1000, 5000, 32767, 32768, 40000, 100003, 442368):
        i = np.arange(n, dtype=np.uint64)
        x = torch.from_numpy((((i * 2654435761) % (1 << 32)).astype(np.float64) / 2.0**32).astype(np.float32))
        for t in (1, 2, 3, 16):
            torch.set_num_threads(t)
            ns.append(n), ts.append(t), vs.append(float(x.mean()))
    torch.set_num_threads(1)
    tensors["torch_mean.n"] = np.array(ns, dtype=np.int32)
    tensors["torch_mean.threads"] = np.array(ts, dtype=np.int32)
    tensors["torch_mean.value"] = np.array(vs, dtype=np.float32)

    meta = {"golden": json.dumps({"cases": cases, "versions": versions(),
                                  "cpu_capability": torch.backends.cpu.get_cpu_capability()}, sort_keys=True)}
    os.makedirs(OUT_NF4, exist_ok=True)
    path = os.path.join(OUT_NF4, "nf4.safetensors")
    save_torch({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
                for k, v in tensors.items()}, path, metadata=meta)
    print(path, os.path.getsize(path), "bytes,", len(cases), "cases")


def make_bnb4():
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    torch.set_num_threads(1)
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    m = AutoModelForCausalLM.from_pretrained(SRC_MODEL, quantization_config=cfg, device_map="cpu",
                                             dtype=torch.float32)
    if os.path.isdir(OUT_BNB4):
        shutil.rmtree(OUT_BNB4)
    m.save_pretrained(OUT_BNB4)
    ids = load_file(os.path.join(SRC_MODEL, "golden.safetensors"))["input_ids"].to(torch.int64)
    with torch.no_grad():
        out = m(ids[None], labels=ids[None])
    g = {"input_ids": ids.to(torch.int32).numpy(), "logits": out.logits[0].float().numpy(),
         "loss": np.array([float(out.loss)], dtype=np.float32)}
    import bitsandbytes.nn as bnn
    for name, mod in m.named_modules():
        if isinstance(mod, bnn.Linear4bit):
            w = mod.weight
            st = w.quant_state
            st_dtype = st.dtype
            st.dtype = torch.float32
            g["deq." + name + ".weight"] = F.dequantize_4bit(w.data, st).numpy()
            st.dtype = st_dtype
    meta = {"golden": json.dumps({"versions": versions(), "source": "tests/golden/models/llama_gqa_untied"},
                                 sort_keys=True)}
    save_file(g, os.path.join(OUT_BNB4, "golden.safetensors"), metadata=meta)
    for f in sorted(os.listdir(OUT_BNB4)):
        print(os.path.join(OUT_BNB4, f), os.path.getsize(os.path.join(OUT_BNB4, f)), "bytes")


SMOLLM2_TENSORS = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.5.ffn_down.weight", "blk.29.ffn_up.weight",
                   "token_embd.weight"]


def make_smollm2(path):
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    res = {}
    for name in SMOLLM2_TENSORS:
        t = by_name[name]
        x = np.ascontiguousarray(dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1))
        e = {"type": t.tensor_type.name, "n": int(x.size), "f32_sha256": sha(x)}
        xt = torch.from_numpy(x)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for dq in (False, True):
                if not dq and threads == 2:
                    continue
                p, st = F.quantize_4bit(xt, blocksize=64, quant_type="nf4", compress_statistics=dq)
                key = "dq_t%d" % threads if dq else "plain"
                d = {"packed_sha256": sha(u8(p))}
                if dq:
                    d["absmax_codes_sha256"] = sha(u8(st.absmax))
                    d["nested_absmax_sha256"] = sha(f32(st.state2.absmax))
                    d["offset"] = float(st.offset)
                else:
                    d["absmax_sha256"] = sha(f32(st.absmax))
                st.dtype = torch.float32
                d["dequant_sha256"] = sha(f32(F.dequantize_4bit(p, st)))
                e[key] = d
        res[name] = e
        print(name, e["n"], "elements")
    torch.set_num_threads(1)
    out = {"gguf": os.path.basename(path), "blocksize": 64, "tensors": res, "versions": versions()}
    dst = os.path.join(OUT_NF4, "smollm2.json")
    with open(dst, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(dst, os.path.getsize(dst), "bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (scripts/fetch_smollm2.sh prints its path)")
    ap.add_argument("--only", nargs="*", choices=["nf4", "bnb4", "smollm2"], help="parts to make (default all)")
    a = ap.parse_args()
    parts = set(a.only or ["nf4", "bnb4", "smollm2"])
    if "nf4" in parts:
        make_nf4(np.random.default_rng(20250412))
    if "bnb4" in parts:
        make_bnb4()
    if "smollm2" in parts:
        if a.gguf:
            make_smollm2(a.gguf)
        else:
            print("smollm2: skipped (no --gguf)", file=sys.stderr)


if __name__ == "__main__":
    main()
