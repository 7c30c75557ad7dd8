// From a GGUF to what a Hugging Face checkpoint would hold: config.json, tensor names and shapes (with
// llama.cpp's Q/K row permutation undone), and tokenizer.json. Each follows what transformers builds when
// it loads a GGUF (`from_pretrained(..., gguf_file=...)`), so the rest of oomless sees one model format.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "io/json.h"

namespace oomless {

// Architectures read: llama (also SmolLM, Mistral-as-llama), mistral, qwen2, qwen3. Others throw an error
// naming the architecture and this list.
json::Value gguf_config_json(const GgufFile& f);

struct GgufHfTensor {
  std::string hf_name;        // e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape; // HF (PyTorch) shape: the GGUF ne reversed
  const GgufTensor* src = nullptr;
  // Heads whose rows llama.cpp interleaved for its RoPE layout (attn_q: H, attn_k: Hkv); 0 = as stored.
  int unpermute_heads = 0;
};
// Every model tensor of a supported architecture, in file order. Tensors with no HF counterpart
// (e.g. rope_freqs.weight, which transformers recomputes) are left out; unknown names throw.
std::vector<GgufHfTensor> gguf_hf_tensors(const GgufFile& f);
// The GGUF name of a Hugging Face tensor name (the inverse of the mapping above), for the writer.
std::string gguf_tensor_name(const std::string& hf_name);
// Dequantises t into out (numel of t.shape floats, HF layout), undoing the row permutation.
void gguf_read_f32(const GgufHfTensor& t, float* out);

// tokenizer.json (HF tokenizers schema) built from tokenizer.ggml.*: model "gpt2" (byte-level BPE) and
// "llama" (sentencepiece-style BPE with byte fallback).
json::Value gguf_tokenizer_json(const GgufFile& f);

struct GgufTokenizerConfig {
  std::optional<int32_t> bos, eos, pad, unk;
  bool add_bos = false, add_eos = false;
  std::string chat_template;  // empty when the file has none
};
GgufTokenizerConfig gguf_tokenizer_config(const GgufFile& f);

}  // namespace oomless
