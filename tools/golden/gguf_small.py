"""Writes the small GGUF goldens for tests/gguf_test.cpp and tests/gguf_model_test.cpp:

  tests/golden/gguf/small.gguf                a 1-layer llama (E=32, H=4, Hkv=2, F=64) written by gguf-py's
                                              GGUFWriter: one tensor of each of F32 F16 BF16 Q8_0 Q4_0 Q4_1
                                              Q5_0 Q5_1, metadata of every value type, a byte-level (gpt2)
                                              tokenizer with control and user-defined tokens
  tests/golden/gguf/small.expected.json       what transformers makes of it: config, and per HF tensor its
                                              shape, sum and a position-weighted sum (after its dequantiser
                                              and LlamaTensorProcessor's reverse permutation)
  tests/golden/gguf/small.tokenizer.json      transformers' tokenizer.json for small.gguf
  tests/golden/gguf/spm.gguf / spm.tokenizer.json   the same for a sentencepiece ("llama") vocabulary
  fuzz/corpus/gguf/*.gguf                     small valid seeds

attn_q / attn_k are stored permuted the way llama.cpp's convert_hf_to_gguf.py does, from HF weights
given by formulas the C++ test recomputes (both representable exactly in F16 / Q8_0).

Run: tools/golden/.venv/bin/python tools/golden/gguf_small.py  (needs gguf, numpy, transformers)
"""
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T, GGUFValueType as V
from gguf.quants import dequantize, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLD = os.path.join(ROOT, "tests", "golden", "gguf")
CORPUS = os.path.join(ROOT, "fuzz", "corpus", "gguf")

E, H, HKV, F = 32, 4, 2, 64
D = E // H


def permute(w, n_head, n_head_kv):
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_q():
    r, c = np.meshgrid(np.arange(E), np.arange(E), indexing="ij")
    return (((r * E + c) % 509 - 254) / 128.0).astype(np.float32)  # exact in f16


def hf_k():
    rows = HKV * D
    r, c = np.meshgrid(np.arange(rows), np.arange(E), indexing="ij")
    q = ((r * 7 + c * 13) % 255) - 127
    q[:, 0] = 127  # pins each row's Q8_0 scale to d_r exactly
    d = 2.0 ** -(6 + (np.arange(rows) % 4))
    return (q * d[:, None]).astype(np.float32)  # exact through Q8_0


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def gpt2_vocab():
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + bytes_to_unicode()
    tokens += ["Ġt", "he", "Ġthe", "日本", "<think>", "<｜bad｜>"]
    types = [3, 3, 3] + [1] * 256 + [1, 1, 1, 1, 4, 3]
    merges = ["Ġ t", "h e", "Ġt he"]
    return tokens, types, merges


def spm_vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for tok, score in [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("▁a", -5.0), ("ab", -5.0),
                       ("▁ab", -6.0), ("abc", -7.0), ("bc", -7.5), ("<tool>", 0.0)]:
        tokens.append(tok)
        types.append(4 if tok == "<tool>" else 1)
        scores.append(score)
    return tokens, types, scores


def add_all_value_types(w, nested=False):
    w.add_uint8("test.u8", 250)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 65000)
    w.add_int16("test.i16", -32000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_uint64("test.u64", 18000000000000000000)
    w.add_int64("test.i64", -9000000000000000000)
    w.add_float32("test.f32", 0.15625)
    w.add_float64("test.f64", -2.5e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo \u65e5\u672c")
    w.add_array("test.arr_i32", [1, -2, 3])
    w.add_array("test.arr_f32", [0.5, -1.25])
    w.add_array("test.arr_str", ["a", "", "日本"])
    w.add_array("test.arr_bool", [True, False])
    if nested:  # legal GGUF, but transformers cannot parse nested arrays
        w.add_array("test.arr_nested", [[1, 2], [3]])
    w.add_key_value("test.arr_u64", [7, 18000000000000000000], V.ARRAY, sub_type=V.UINT64)


def write_model(path, tokenizer, name="small"):
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_block_count(1)
    w.add_feed_forward_length(F)
    w.add_rope_dimension_count(D)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_all_value_types(w)
    if tokenizer == "gpt2":
        tokens, types, merges = gpt2_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    else:
        tokens, types, scores = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    vocab = len(tokens)

    def q(arr, qtype):
        return quantize(arr.astype(np.float32), qtype), qtype

    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, E)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", (1 + 0.1 * rng.standard_normal(E)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", permute(hf_q(), H, H).astype(np.float16))
    raw, t = q(permute(hf_k(), H, HKV), T.Q8_0)
    w.add_tensor("blk.0.attn_k.weight", raw, raw_dtype=t)
    v = rng.standard_normal((HKV * D, E)).astype(np.float32)
    w.add_tensor("blk.0.attn_v.weight", quantize(v, T.BF16), raw_dtype=T.BF16)
    for name, shape, qtype in [("blk.0.attn_output.weight", (E, E), T.Q4_0), ("blk.0.ffn_gate.weight", (F, E), T.Q4_1),
                               ("blk.0.ffn_up.weight", (F, E), T.Q5_0), ("blk.0.ffn_down.weight", (E, F), T.Q5_1)]:
        raw, t = q(rng.standard_normal(shape), qtype)
        w.add_tensor(name, raw, raw_dtype=t)
    w.add_tensor("blk.0.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(E)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(E)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def transformers_view(path):
    """config, tensors and tokenizer.json exactly as transformers builds them from the file."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint, LlamaTensorProcessor
    from transformers import AutoTokenizer

    parsed = load_gguf_checkpoint(path, return_tensors=False)
    config = {k: v for k, v in parsed["config"].items() if not k.startswith("_")}
    proc = LlamaTensorProcessor(config=config)
    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        wts = dequantize(t.data, t.tensor_type)
        wts = proc.process(weights=wts, name=t.name).weights.astype(np.float64).reshape(-1)
        idx = np.arange(wts.size)
        tensors[t.name] = {
            "shape": [int(s) for s in reversed(t.shape.tolist())],
            "sum": float(wts.sum()),
            "wsum": float((wts * ((idx % 97) + 1)).sum()),
            "first": float(wts[0]),
            "last": float(wts[-1]),
        }
    d = tempfile.mkdtemp()
    shutil.copy(path, os.path.join(d, "m.gguf"))
    tok = AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")
    tok_json = tok.backend_tokenizer.to_str(pretty=True)
    shutil.rmtree(d)
    return config, tensors, tok_json


def main():
    os.makedirs(GOLD, exist_ok=True)
    os.makedirs(CORPUS, exist_ok=True)
    for stem, tok in [("small", "gpt2"), ("spm", "llama")]:
        path = os.path.join(GOLD, f"{stem}.gguf")
        write_model(path, tok)
        config, tensors, tok_json = transformers_view(path)
        with open(os.path.join(GOLD, f"{stem}.tokenizer.json"), "w") as f:
            f.write(tok_json)
        if stem == "small":
            with open(os.path.join(GOLD, "small.expected.json"), "w") as f:
                json.dump({"config": config, "tensors": tensors}, f, indent=1, sort_keys=True)
        print(path, os.path.getsize(path), "bytes", file=sys.stderr)

    # Fuzz seeds: small valid files (metadata only, and a few tiny tensors of several types).
    for i, types in enumerate([[], [T.F32], [T.Q8_0, T.Q4_K], [T.F16, T.BF16, T.Q6_K]]):
        p = os.path.join(CORPUS, f"seed{i}.gguf")
        w = gguf.GGUFWriter(p, "llama")
        w.add_custom_alignment(32 if i % 2 == 0 else 64)
        w.add_block_count(1)
        w.add_embedding_length(32)
        w.add_head_count(2)
        w.add_head_count_kv(1)
        w.add_feed_forward_length(64)
        w.add_token_list(["a", "b", "ab", "<s>"])
        w.add_token_types([1, 1, 1, 3])
        w.add_tokenizer_model("gpt2" if i < 3 else "llama")
        if i < 3:
            w.add_token_merges(["a b"])
        else:
            w.add_token_scores([-1.0, -2.0, -0.5, 0.0])
        add_all_value_types(w, nested=True) if i == 1 else None
        rng = np.random.default_rng(i)
        names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight"]
        for name, t in zip(names, types):
            block = gguf.GGML_QUANT_SIZES[t][0]
            x = rng.standard_normal((2, max(block, 32))).astype(np.float32)
            if t == T.F32:
                w.add_tensor(name, x)
            elif t == T.F16:
                w.add_tensor(name, x.astype(np.float16))
            elif t in (T.Q4_K, T.Q6_K):
                raw = rng.integers(0, 256, size=(2, gguf.GGML_QUANT_SIZES[t][1]), dtype=np.uint8)
                w.add_tensor(name, raw, raw_dtype=t)
            else:
                w.add_tensor(name, quantize(x, t), raw_dtype=t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        print(p, os.path.getsize(p), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
