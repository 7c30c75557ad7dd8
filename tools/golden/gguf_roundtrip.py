#!/usr/bin/env python3
"""oomless's GGUF files read by gguf-py (llama.cpp's own Python reader, from PyPI).

    tools/golden/.venv/bin/python tools/golden/gguf_roundtrip.py --oomless build/release/oomless --work DIR [--model M]

Writes MODEL (default preset:micro) with `oomless convert --out X.gguf --type T` for T in f32, f16, bf16 and
q8_0, opens each with gguf.GGUFReader and checks: the architecture's hyperparameters, the tokenizer
metadata, the same tensors (names, shapes) in every file; matrices in the asked type and 1-D tensors in F32;
and the data: F16 = the F32 file's values cast by numpy, BF16 = their round-to-nearest-even top halves,
Q8_0 = gguf-py's own quantize of the F32 values, byte for byte; Q4_K (which gguf-py cannot quantise)
dequantised by gguf-py within 15% RMS of the F32 values (rows not a multiple of 256 are Q8_0 there, checked
as above). Exit status 1 on any difference.
"""

import argparse
import os
import subprocess
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize, quantize


def field(r, key):
    f = r.fields[key]
    if f.types and f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0] if len(f.data) == 1 else [f.parts[i].tolist()[0] for i in f.data]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oomless", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="preset:micro")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    readers = {}
    for t in ["f32", "f16", "bf16", "q8_0", "q4_k"]:
        path = os.path.join(a.work, f"model-{t}.gguf")
        subprocess.run([a.oomless, "convert", "--model", a.model, "--out", path, "--type", t], check=True)
        readers[t] = GGUFReader(path)
    bad = []
    r32 = readers["f32"]
    arch = field(r32, "general.architecture")
    for t, r in readers.items():
        for key in [f"{arch}.block_count", f"{arch}.embedding_length", f"{arch}.attention.head_count",
                    f"{arch}.attention.head_count_kv", f"{arch}.context_length", "tokenizer.ggml.model",
                    "tokenizer.ggml.eos_token_id"]:
            if field(r, key) != field(r32, key):
                bad.append(f"{t}: {key} differs")
        if len(r.fields["tokenizer.ggml.tokens"].data) != len(r32.fields["tokenizer.ggml.tokens"].data):
            bad.append(f"{t}: token count differs")
        names = [x.name for x in r.tensors]
        if names != [x.name for x in r32.tensors]:
            bad.append(f"{t}: tensor names differ")
        for x, x32 in zip(r.tensors, r32.tensors):
            want_type = GGMLQuantizationType.F32 if len(x32.shape) == 1 or t == "f32" else {
                "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16, "q8_0": GGMLQuantizationType.Q8_0,
                "q4_k": GGMLQuantizationType.Q4_K}[t]
            if t == "q4_k" and want_type == GGMLQuantizationType.Q4_K and int(x32.shape[0]) % 256 != 0:  # shape is ne: ne[0], the row length, first
                want_type = GGMLQuantizationType.Q8_0
            if x.tensor_type != want_type:
                bad.append(f"{t}: {x.name} is {x.tensor_type.name}, expected {want_type.name}")
                continue
            f32 = np.asarray(x32.data, dtype=np.float32).reshape(-1)
            got = np.asarray(x.data).reshape(-1).view(np.uint8)
            if want_type == GGMLQuantizationType.F32:
                want = f32.view(np.uint8)
            elif want_type == GGMLQuantizationType.F16:
                want = f32.astype(np.float16).view(np.uint8)
            elif want_type == GGMLQuantizationType.BF16:
                u = f32.view(np.uint32).astype(np.uint64)
                want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)
            elif want_type == GGMLQuantizationType.Q4_K:
                deq = dequantize(np.asarray(x.data), GGMLQuantizationType.Q4_K).reshape(-1)
                rms = float(np.sqrt(np.mean((deq - f32) ** 2)) / max(np.sqrt(np.mean(f32 ** 2)), 1e-30))
                if not rms < 0.15:
                    bad.append(f"{t}: {x.name} dequantised by gguf-py is {rms:.3f} RMS from the F32 values")
                continue
            else:
                want = quantize(f32.reshape(-1, 32), GGMLQuantizationType.Q8_0).reshape(-1)
            if not np.array_equal(got, want):
                bad.append(f"{t}: {x.name} data differs from gguf-py's")
    print(f"{a.model}: {arch}, {len(r32.tensors)} tensors, {len(r32.fields['tokenizer.ggml.tokens'].data)} tokens; "
          f"f16/bf16/q8_0/q4_k files checked against gguf-py from the f32 file")
    for b in bad:
        print("FAIL", b)
    print("gguf-py reads oomless's GGUF files as written" if not bad else f"{len(bad)} differences")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
