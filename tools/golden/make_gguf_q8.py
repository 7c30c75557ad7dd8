#!/usr/bin/env python3
"""Q8_0 golden (tests/golden/gguf/q8_0.json) from gguf-py's quantize, for oomless's GGUF writer.

    tools/golden/.venv/bin/python tools/golden/make_gguf_q8.py

Holds the float32 inputs (as their bit patterns) and the Q8_0 bytes gguf.quants.quantize gives: random
normal blocks, a block of zeros, one whose values sit on rounding ties (x / d = k + 0.5), one with a single
large value, tiny (subnormal-scale) values and negative extremes.
"""

import json
import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    rng = np.random.default_rng(7)
    blocks = [rng.standard_normal(32 * 5).astype(np.float32) * 0.05]
    blocks.append(np.zeros(32, np.float32))
    ties = ((np.arange(32) - 16.0 + 0.5) / 127.0).astype(np.float32)  # x / d near k + 0.5
    ties[0] = 1.0  # max |x| = 1, so d = 1/127
    blocks.append(ties)
    one = np.full(32, 1e-3, np.float32)
    one[5] = 1000.0
    blocks.append(one)
    blocks.append((rng.standard_normal(32) * 1e-30).astype(np.float32))
    blocks.append(-np.abs(rng.standard_normal(32)).astype(np.float32) * 3)
    x = np.concatenate(blocks).astype(np.float32)
    q = quantize(x.reshape(-1, 32), GGMLQuantizationType.Q8_0).reshape(-1)
    doc = {
        "versions": {"gguf": gguf.__version__ if hasattr(gguf, "__version__") else "unknown", "numpy": np.__version__},
        "input_f32_bits": [int(v) for v in x.view(np.uint32)],
        "q8_0_hex": q.tobytes().hex(),
    }
    out = os.path.join(ROOT, "tests", "golden", "gguf", "q8_0.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(out, x.size, "values,", len(q), "bytes")


if __name__ == "__main__":
    main()
