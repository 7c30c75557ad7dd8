#include "model/gguf_export.h"

#include <algorithm>
#include <map>

#include "core/dtype.h"
#include "core/error.h"
#include "io/gguf_model.h"
#include "io/json.h"

namespace oomless {

GgmlType parse_gguf_type(const std::string& s) {
  if (s == "f32") return GgmlType::F32;
  if (s == "f16") return GgmlType::F16;
  if (s == "bf16") return GgmlType::BF16;
  if (s == "q8_0") return GgmlType::Q8_0;
  if (s == "q4_k") return GgmlType::Q4_K;
  fail("[convert] --type ", s, " is not supported for GGUF; use f32, f16, bf16, q8_0 or q4_k");
}

namespace {

using KV = std::vector<std::pair<std::string, GgufValue>>;

// tokenizer.ggml.* from the tokenizer.json of a byte-level BPE tokenizer.
void tokenizer_metadata(KV& kv, const ModelSource& src) {
  const json::Value t = json::parse(src.tokenizer_json, "tokenizer.json");
  const json::Value& model = t.at("model");
  OOM_CHECK(model.at("type").as_string() == "BPE", "[convert] the tokenizer is ", model.at("type").as_string(),
            "; a GGUF is written for byte-level BPE tokenizers only");
  const std::string pre = json::dump(t.at("pre_tokenizer"));
  OOM_CHECK(pre.find("ByteLevel") != std::string::npos, "[convert] the tokenizer is not byte-level BPE (its "
            "pre-tokenizer has no ByteLevel step, e.g. a sentencepiece/Metaspace one); a GGUF is written for "
            "byte-level BPE tokenizers only");
  const int64_t V = src.cfg.V;
  std::vector<std::string> tokens(static_cast<size_t>(V));
  std::vector<int64_t> types(static_cast<size_t>(V), 0);
  for (const auto& [piece, id] : model.at("vocab").as_object()) {
    const int64_t i = id.as_int();
    OOM_CHECK(i >= 0 && i < V, "[convert] token id ", i, " is outside the model's vocabulary of ", V);
    tokens[static_cast<size_t>(i)] = piece, types[static_cast<size_t>(i)] = 1;  // normal
  }
  if (t.find("added_tokens") && t.at("added_tokens").is_array())
    for (const json::Value& a : t.at("added_tokens").as_array()) {
      const int64_t i = a.at("id").as_int();
      OOM_CHECK(i >= 0 && i < V, "[convert] added token id ", i, " is outside the model's vocabulary of ", V);
      tokens[static_cast<size_t>(i)] = a.at("content").as_string();
      types[static_cast<size_t>(i)] = a.find("special") && a.at("special").as_bool() ? 3 : 4;  // control, user-defined
    }
  for (int64_t i = 0; i < V; ++i)
    if (types[static_cast<size_t>(i)] == 0) {  // rows past the tokenizer's vocabulary (padded embeddings)
      tokens[static_cast<size_t>(i)] = "[PAD" + std::to_string(i) + "]";
      types[static_cast<size_t>(i)] = 5;  // unused
    }
  std::vector<std::string> merges;
  for (const json::Value& m : model.at("merges").as_array())
    merges.push_back(m.is_string() ? m.as_string() : m[0].as_string() + " " + m[1].as_string());
  // llama.cpp picks its pre-tokenizer regex by name: the Llama 3 and Qwen2 splits, else GPT-2's.
  std::string pre_name = "gpt2";
  if (pre.find("\\\\p{N}{1,3}") != std::string::npos) pre_name = "llama-bpe";
  else if (pre.find("Split") != std::string::npos && pre.find("\\\\p{N}|") != std::string::npos) pre_name = "qwen2";
  kv.push_back({"tokenizer.ggml.model", gguf_str("gpt2")});
  kv.push_back({"tokenizer.ggml.pre", gguf_str(pre_name)});
  kv.push_back({"tokenizer.ggml.tokens", gguf_str_array(std::move(tokens))});
  kv.push_back({"tokenizer.ggml.token_type", gguf_i32_array(std::move(types))});
  kv.push_back({"tokenizer.ggml.merges", gguf_str_array(std::move(merges))});
  if (src.cfg.bos_id) kv.push_back({"tokenizer.ggml.bos_token_id", gguf_u32(static_cast<uint32_t>(*src.cfg.bos_id))});
  if (src.cfg.eos_id) kv.push_back({"tokenizer.ggml.eos_token_id", gguf_u32(static_cast<uint32_t>(*src.cfg.eos_id))});
  // Whether encoding adds BOS: what the tokenizer's post-processor does.
  bool add_bos = false;
  if (src.tokenizer && src.cfg.bos_id) {
    const std::vector<int32_t> ids = src.tokenizer->encode("a", true);
    add_bos = !ids.empty() && ids[0] == *src.cfg.bos_id;
  }
  kv.push_back({"tokenizer.ggml.add_bos_token", gguf_bool(add_bos)});
  const json::Value& tc = src.tokenizer_config;
  if (tc.is_object() && tc.find("chat_template") && tc.at("chat_template").is_string())
    kv.push_back({"tokenizer.chat_template", gguf_str(tc.at("chat_template").as_string())});
}

}  // namespace

std::vector<std::string> save_gguf(Ops& ops, const std::string& path, const ModelSource& src, const ParamSet& params,
                                   GgmlType type) {
  const ModelConfig& c = src.cfg;
  const std::string arch = c.arch == Arch::qwen2 ? "qwen2" : c.arch == Arch::qwen3 ? "qwen3" : "llama";
  OOM_CHECK(c.rope.scaling == RopeScaling::none || c.rope.scaling == RopeScaling::linear || c.rope.scaling == RopeScaling::yarn,
            "[convert] the model's RoPE scaling (llama3) is not written to GGUF metadata (llama.cpp stores it as a "
            "rope_freqs tensor); convert a model without it");
  OOM_CHECK(!src.tokenizer_json.empty(), "[convert] the model has no tokenizer.json; a GGUF needs the tokenizer");
  std::vector<std::string> notes;
  KV kv;
  const std::string p = arch + ".";
  kv.push_back({"general.architecture", gguf_str(arch)});
  kv.push_back({"general.name", gguf_str(c.arch == Arch::mistral ? "mistral" : src.spec)});
  kv.push_back({"general.alignment", gguf_u32(32)});
  const uint32_t ftype = type == GgmlType::F32 ? 0 : type == GgmlType::F16 ? 1 : type == GgmlType::Q8_0 ? 7
                        : type == GgmlType::Q4_K ? 15 : 32;  // llama.cpp's LLAMA_FTYPE_* (Q4_K_M: 15)
  kv.push_back({"general.file_type", gguf_u32(ftype)});
  kv.push_back({p + "block_count", gguf_u32(static_cast<uint32_t>(c.L))});
  kv.push_back({p + "context_length", gguf_u32(static_cast<uint32_t>(c.max_position))});
  kv.push_back({p + "embedding_length", gguf_u32(static_cast<uint32_t>(c.E))});
  kv.push_back({p + "feed_forward_length", gguf_u32(static_cast<uint32_t>(c.F))});
  kv.push_back({p + "attention.head_count", gguf_u32(static_cast<uint32_t>(c.H))});
  kv.push_back({p + "attention.head_count_kv", gguf_u32(static_cast<uint32_t>(c.Hkv))});
  kv.push_back({p + "attention.layer_norm_rms_epsilon", gguf_f32(static_cast<float>(c.rms_eps))});
  kv.push_back({p + "rope.freq_base", gguf_f32(static_cast<float>(c.rope.theta))});
  kv.push_back({p + "rope.dimension_count", gguf_u32(static_cast<uint32_t>(c.D))});
  if (c.D * c.H != c.E) {
    kv.push_back({p + "attention.key_length", gguf_u32(static_cast<uint32_t>(c.D))});
    kv.push_back({p + "attention.value_length", gguf_u32(static_cast<uint32_t>(c.D))});
  }
  kv.push_back({p + "vocab_size", gguf_u32(static_cast<uint32_t>(c.V))});
  if (c.rope.scaling != RopeScaling::none) {
    kv.push_back({p + "rope.scaling.type", gguf_str(c.rope.scaling == RopeScaling::linear ? "linear" : "yarn")});
    kv.push_back({p + "rope.scaling.factor", gguf_f32(static_cast<float>(c.rope.factor))});
    kv.push_back({p + "rope.scaling.original_context_length",
                  gguf_u32(static_cast<uint32_t>(c.rope.original_max_position))});
  }
  tokenizer_metadata(kv, src);

  std::vector<GgufWriteTensor> ts;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const ParamSpec& sp = params.specs()[i];
    const Tensor t = params.tensors()[i];
    GgufWriteTensor w;
    w.name = gguf_tensor_name(sp.name);
    w.ne.assign(sp.shape.rbegin(), sp.shape.rend());
    const int64_t cols = w.ne[0], rows = t.numel() / cols;
    // Matrices in the asked type; norms and biases (1-D) in F32 as llama.cpp keeps them.
    w.type = sp.shape.size() == 1 ? GgmlType::F32 : type;
    if (w.type == GgmlType::Q4_K && cols % 256 != 0) {
      w.type = cols % 32 == 0 ? GgmlType::Q8_0 : GgmlType::F16;
      notes.push_back(w.name + ": " + std::to_string(cols) + " columns are not a multiple of Q4_K's 256, written as " +
                      (w.type == GgmlType::Q8_0 ? "Q8_0" : "F16"));
    }
    if (w.type == GgmlType::Q8_0 && cols % 32 != 0) {
      w.type = GgmlType::F16;
      notes.push_back(w.name + ": " + std::to_string(cols) + " columns are not a multiple of 32, written as F16");
    }
    // llama.cpp's llama architecture interleaves each head's rows of W_q / W_k for its RoPE:
    // GGUF row h*D + 2*j + s = HF row h*D + s*(D/2) + j.
    const bool q = w.name.find(".attn_q.") != std::string::npos, k = w.name.find(".attn_k.") != std::string::npos;
    const int64_t heads = arch == "llama" && (q || k) ? (q ? c.H : c.Hkv) : 0;
    const GgmlType wt = w.type;
    w.fill = [&ops, t, rows, cols, heads, wt](uint8_t* out) {  // (called by write_gguf below)
      std::vector<char> raw(static_cast<size_t>(t.nbytes()));
      ops.download(raw.data(), t);
      std::vector<float> f(static_cast<size_t>(rows * cols));
      convert(f.data(), DType::f32, raw.data(), t.dtype, rows * cols);
      if (heads > 0) {
        std::vector<float> hf = f;
        const int64_t D = rows / heads, half = D / 2;
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t j = 0; j < half; ++j)
            for (int64_t s = 0; s < 2; ++s)
              std::copy_n(hf.data() + (h * D + s * half + j) * cols, cols, f.data() + (h * D + 2 * j + s) * cols);
      }
      const int64_t n = rows * cols;
      if (wt == GgmlType::F32) std::memcpy(out, f.data(), static_cast<size_t>(n) * 4);
      else if (wt == GgmlType::F16) convert(out, DType::f16, f.data(), DType::f32, n);
      else if (wt == GgmlType::BF16) convert(out, DType::bf16, f.data(), DType::f32, n);
      else if (wt == GgmlType::Q8_0) quantize_q8_0(f.data(), n, out);
      else quantize_q4_k(f.data(), n, out);
    };
    ts.push_back(std::move(w));
  }
  write_gguf(path, kv, ts);
  return notes;
}

}  // namespace oomless
