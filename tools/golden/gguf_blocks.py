"""Writes tests/golden/gguf/blocks.gguf: for every ggml type oomless dequantises, raw blocks and the
float32 values gguf-py's dequantiser gives for them.

For each type TYPE the file holds two tensors:
  TYPE.raw  the blocks, stored with ggml type TYPE (shape (rows, 256))
  TYPE.f32  gguf.quants.dequantize(TYPE.raw), float32, same shape
Blocks come from gguf.quants.quantize of random floats where gguf-py can quantize the type, plus
random raw bytes with a sane fp16 scale (which reach codes quantize never produces). Special cases
(zero scale, negative scale, subnormal scale) are included for the 32-element formats.

Run: tools/golden/.venv/bin/python tools/golden/gguf_blocks.py  (needs gguf, numpy)
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "golden", "gguf", "blocks.gguf")

COLS = 256  # elements per row: one K block, or eight 32-element blocks
ROWS = 8    # 2048 elements per type

# Byte offsets of the fp16 scales inside one block, per type (ggml-common.h layouts).
SCALE_OFFSETS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}


def random_raw(rng, qtype, n_blocks):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = (rng.standard_normal(size=(n_blocks, len(SCALE_OFFSETS[qtype]))) * 0.05).astype(np.float16)
    for k, off in enumerate(SCALE_OFFSETS[qtype]):
        raw[:, off:off + 2] = scales[:, k:k + 1].view(np.uint8).reshape(n_blocks, 2)
    return raw


def special_scales(raw, qtype):
    """Overwrite the first scale of a few blocks: 0, negative, subnormal, large."""
    off = SCALE_OFFSETS[qtype][0]
    for b, v in enumerate([0.0, -0.75, 3.0e-7, 1024.0]):
        raw[b, off:off + 2] = np.array([v], dtype=np.float16).view(np.uint8)
    return raw


def blocks_for(rng, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = ROWS * COLS // block
    if qtype in QUANTIZABLE:
        half = n_blocks // 2
        x = (rng.standard_normal(size=(half * block // COLS, COLS)) * rng.uniform(0.01, 2.0)).astype(np.float32)
        x[0, :block] = 0.0  # an all-zero block (d = 0)
        q = quantize(x, qtype).reshape(half, size)
        r = special_scales(random_raw(rng, qtype, n_blocks - half), qtype)
        raw = np.concatenate([q, r])
    else:
        raw = special_scales(random_raw(rng, qtype, n_blocks), qtype)
    return raw.reshape(ROWS, COLS // block * size)


def main():
    rng = np.random.default_rng(20240611)
    w = gguf.GGUFWriter(OUT, "oomless-golden")
    w.add_string("oomless.note", "raw ggml blocks and their gguf-py dequantisation, for tests/gguf_test.cpp")

    # Plain float types: random bit patterns (all exponents, subnormals, infinities; no NaN in F16 so the
    # comparison can stay bit-exact; BF16 includes NaNs, compared as NaN).
    f16 = rng.integers(0, 1 << 16, size=(ROWS, COLS), dtype=np.uint16)
    f16 = np.where((f16 & 0x7C00) == 0x7C00, f16 & 0x83FF, f16).astype(np.uint16)  # no inf/NaN patterns
    f16[0, :4] = [0x7C00, 0xFC00, 0x0001, 0x8000]  # +inf, -inf, smallest subnormal, -0
    bf16 = rng.integers(0, 1 << 16, size=(ROWS, COLS), dtype=np.uint16)
    f32 = rng.standard_normal(size=(ROWS, COLS)).astype(np.float32)
    plain = {
        T.F32: f32.view(np.uint8),
        T.F16: f16.view(np.uint8),
        T.BF16: bf16.view(np.uint8),
    }
    for qtype, raw in plain.items():
        ref = dequantize(raw, qtype).astype(np.float32)
        w.add_tensor(f"{qtype.name}.raw", raw, raw_dtype=qtype)
        w.add_tensor(f"{qtype.name}.f32", ref)

    for qtype in [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        raw = blocks_for(rng, qtype)
        ref = dequantize(raw, qtype)
        assert ref.dtype == np.float32 and ref.shape == (ROWS, COLS), (qtype, ref.shape)
        w.add_tensor(f"{qtype.name}.raw", raw, raw_dtype=qtype)
        w.add_tensor(f"{qtype.name}.f32", ref)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(OUT, os.path.getsize(OUT), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
