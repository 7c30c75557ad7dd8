"""Reference numbers for tests/gguf_slowtest.cpp from the real SmolLM2-135M-Instruct Q4_1 GGUF, and
transformers' tokenizer.json for it.

  tests/golden/gguf/smollm2_ref.json             config transformers derives; for a few tensors the HF name,
                                                 ggml type, shape and values at fixed flat indices (after
                                                 gguf-py's dequantiser and transformers' Q/K un-permutation)
  tests/golden/tokenizers/smollm2/tokenizer.json tok.backend_tokenizer.to_str() (written only when absent;
                                                 otherwise compared and the difference reported)

Run: tools/golden/.venv/bin/python tools/golden/gguf_smollm2.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import gguf
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
         "blk.7.ffn_down.weight", "blk.29.attn_output.weight", "blk.29.ffn_norm.weight", "output_norm.weight"]


def main(path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint, LlamaTensorProcessor
    from transformers import AutoTokenizer

    parsed = load_gguf_checkpoint(path, return_tensors=False)
    config = {k: v for k, v in parsed["config"].items() if not k.startswith("_")}
    proc = LlamaTensorProcessor(config=config)
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out = {"config": config, "tensors": {}}
    for name in NAMES:
        t = by_name[name]
        w = proc.process(weights=dequantize(t.data, t.tensor_type), name=name).weights.reshape(-1)
        idx = sorted(i for i in {0, 1, 31, 32, 577, w.size // 3, w.size // 2 + 7, w.size - 1} if i < w.size)
        out["tensors"][name] = {
            "type": t.tensor_type.name,
            "shape": [int(s) for s in reversed(t.shape.tolist())],
            "index": idx,
            "value": [float(w[i]) for i in idx],
            "sum": float(w.astype(np.float64).sum()),
        }
    with open(os.path.join(ROOT, "tests", "golden", "gguf", "smollm2_ref.json"), "w") as f:
        json.dump(out, f, indent=1)

    d = tempfile.mkdtemp()
    os.symlink(os.path.abspath(path), os.path.join(d, "m.gguf"))
    tok = AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")
    shutil.rmtree(d)
    text = tok.backend_tokenizer.to_str(pretty=True)
    dst = os.path.join(ROOT, "tests", "golden", "tokenizers", "smollm2", "tokenizer.json")
    if os.path.exists(dst):
        same = json.load(open(dst)) == json.loads(text)
        print(dst, "exists;", "identical to transformers' GGUF tokenizer" if same else "DIFFERS from transformers' GGUF tokenizer")
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "w") as f:
            f.write(text)
        print("wrote", dst)


if __name__ == "__main__":
    main(sys.argv[1])
