// GGUF -> Hugging Face: config.json and tensor names/shapes, following what transformers does when it
// loads a GGUF (integrations/ggml.py, modeling_gguf_pytorch_utils.py). The tokenizer lives in
// gguf_tokenizer.cpp.
#include <charconv>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "io/gguf_model.h"

namespace oomless {

namespace {

constexpr const char* kSupported = "llama, mistral, qwen2, qwen3";

struct Arch {
  std::string gguf;        // key prefix in the file ("llama")
  std::string model_type;  // HF model_type ("mistral" for a llama file named "mistral")
  const char* hf_class;
};

Arch arch_of(const GgufFile& f) {
  const std::string a = f.get_string("general.architecture");
  // transformers treats a "llama" file whose general.name is exactly "mistral" as Mistral.
  const GgufValue* name = f.find("general.name");
  const bool named_mistral = name && name->type == GgufValueType::string && name->s == "mistral";
  if (a == "llama") {
    if (named_mistral) return {a, "mistral", "MistralForCausalLM"};
    return {a, "llama", "LlamaForCausalLM"};
  }
  if (a == "mistral") return {a, "mistral", "MistralForCausalLM"};
  if (a == "qwen2") return {a, "qwen2", "Qwen2ForCausalLM"};
  if (a == "qwen3") return {a, "qwen3", "Qwen3ForCausalLM"};
  fail("[gguf] ", f.path(), ": architecture \"", a, "\" is not supported (supported: ", kSupported,
       "); use a model of a supported architecture");
}

// A head count stored either as one integer or as one integer per layer (all equal for the models we
// read).
int64_t head_count(const GgufFile& f, const std::string& key) {
  const GgufValue* v = f.find(key);
  if (v && v->is_array() && !v->ints.empty()) {
    for (int64_t h : v->ints)
      if (h != v->ints[0])
        fail("[gguf] ", f.path(), ": \"", key, "\" differs between layers; per-layer head counts are not supported");
    return v->ints[0];
  }
  return f.get_int(key);
}

int64_t positive(const GgufFile& f, const std::string& key, int64_t v) {
  if (v <= 0 || v > (int64_t{1} << 40)) fail("[gguf] ", f.path(), ": \"", key, "\" = ", v, " is not a sane size");
  return v;
}

struct Dims {
  int64_t L, E, F, H, Hkv;
};

Dims dims_of(const GgufFile& f, const Arch& a) {
  Dims d{};
  d.L = positive(f, a.gguf + ".block_count", f.get_int(a.gguf + ".block_count"));
  d.E = positive(f, a.gguf + ".embedding_length", f.get_int(a.gguf + ".embedding_length"));
  d.H = positive(f, a.gguf + ".attention.head_count", head_count(f, a.gguf + ".attention.head_count"));
  // transformers' configs default the kv heads to the query heads.
  const std::string kv = a.gguf + ".attention.head_count_kv";
  d.Hkv = f.has(kv) ? positive(f, kv, head_count(f, kv)) : d.H;
  const std::string ff = a.gguf + ".feed_forward_length";
  d.F = f.has(ff) ? positive(f, ff, head_count(f, ff)) : 0;
  return d;
}

}  // namespace

json::Value gguf_config_json(const GgufFile& f) {
  const Arch a = arch_of(f);
  const Dims d = dims_of(f, a);
  const std::string p = a.gguf + ".";
  json::Value c = json::Value::object();
  c.set("architectures", json::Value::array({json::Value::string(a.hf_class)}));
  c.set("model_type", json::Value::string(a.model_type));
  c.set("hidden_size", json::Value::integer(d.E));
  if (d.F) c.set("intermediate_size", json::Value::integer(d.F));
  c.set("num_hidden_layers", json::Value::integer(d.L));
  c.set("num_attention_heads", json::Value::integer(d.H));
  c.set("num_key_value_heads", json::Value::integer(d.Hkv));
  // transformers reads head_dim from rope.dimension_count for llama/mistral only. Qwen3's head_dim is
  // often not E/H; llama.cpp then writes attention.key_length, which we read for every architecture.
  if ((a.gguf == "llama" || a.gguf == "mistral") && f.has(p + "rope.dimension_count"))
    c.set("head_dim", json::Value::integer(positive(f, p + "rope.dimension_count", f.get_int(p + "rope.dimension_count"))));
  if (f.has(p + "attention.key_length"))
    c.set("head_dim", json::Value::integer(positive(f, p + "attention.key_length", f.get_int(p + "attention.key_length"))));
  if (f.has(p + "attention.layer_norm_rms_epsilon"))
    c.set("rms_norm_eps", json::Value::number(f.get_float(p + "attention.layer_norm_rms_epsilon")));
  if (f.has(p + "rope.freq_base")) c.set("rope_theta", json::Value::number(f.get_float(p + "rope.freq_base")));
  if (f.has(p + "context_length"))
    c.set("max_position_embeddings", json::Value::integer(f.get_int(p + "context_length")));
  if (f.has(p + "vocab_size")) {
    c.set("vocab_size", json::Value::integer(f.get_int(p + "vocab_size")));
  } else if (f.has("tokenizer.ggml.tokens")) {
    c.set("vocab_size", json::Value::integer(static_cast<int64_t>(f.get_string_array("tokenizer.ggml.tokens").size())));
  }
  c.set("tie_word_embeddings", json::Value::boolean(f.tensor("output.weight") == nullptr));
  const GgufTokenizerConfig tc = gguf_tokenizer_config(f);
  if (tc.bos) c.set("bos_token_id", json::Value::integer(*tc.bos));
  if (tc.eos) c.set("eos_token_id", json::Value::integer(*tc.eos));
  if (tc.pad) c.set("pad_token_id", json::Value::integer(*tc.pad));
  if (tc.unk) c.set("unk_token_id", json::Value::integer(*tc.unk));
  // rope scaling as llama.cpp writes it (linear / yarn). Llama-3-style scaling is stored as a
  // rope_freqs tensor instead and cannot be recovered from metadata.
  if (f.has(p + "rope.scaling.type")) {
    const std::string type = f.get_string(p + "rope.scaling.type");
    if (type != "none") {
      json::Value rs = json::Value::object();
      rs.set("rope_type", json::Value::string(type));
      if (f.has(p + "rope.scaling.factor"))
        rs.set("factor", json::Value::number(f.get_float(p + "rope.scaling.factor")));
      if (f.has(p + "rope.scaling.original_context_length"))
        rs.set("original_max_position_embeddings",
               json::Value::integer(f.get_int(p + "rope.scaling.original_context_length")));
      c.set("rope_scaling", rs);
    }
  }
  return c;
}

namespace {

// GGUF per-layer tensor names (after "blk.N.") -> HF names (after "model.layers.N.").
struct LayerName {
  const char* gguf;
  const char* hf;
};
constexpr LayerName kLayerNames[] = {
    {"attn_q", "self_attn.q_proj"},        {"attn_k", "self_attn.k_proj"},
    {"attn_v", "self_attn.v_proj"},        {"attn_output", "self_attn.o_proj"},
    {"attn_q_norm", "self_attn.q_norm"},   {"attn_k_norm", "self_attn.k_norm"},
    {"ffn_gate", "mlp.gate_proj"},         {"ffn_up", "mlp.up_proj"},
    {"ffn_down", "mlp.down_proj"},         {"attn_norm", "input_layernorm"},
    {"ffn_norm", "post_attention_layernorm"},
};

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

}  // namespace

std::vector<GgufHfTensor> gguf_hf_tensors(const GgufFile& f) {
  const Arch a = arch_of(f);
  const Dims d = dims_of(f, a);
  // transformers undoes llama.cpp's Q/K interleave only for files whose architecture is "llama"
  // (convert_hf_to_gguf.py permutes exactly those).
  const bool permuted = a.gguf == "llama";
  std::vector<GgufHfTensor> out;
  for (const GgufTensor& t : f.tensors()) {
    GgufHfTensor h;
    h.src = &t;
    h.shape.assign(t.ne.rbegin(), t.ne.rend());
    const std::string& n = t.name;
    if (n == "rope_freqs.weight") continue;  // transformers computes RoPE frequencies itself
    if (n == "token_embd.weight") {
      h.hf_name = "model.embed_tokens.weight";
    } else if (n == "output_norm.weight") {
      h.hf_name = "model.norm.weight";
    } else if (n == "output.weight") {
      h.hf_name = "lm_head.weight";
    } else if (starts_with(n, "blk.")) {
      const char* begin = n.data() + 4;
      const char* end = n.data() + n.size();
      int64_t layer = -1;
      auto [ptr, ec] = std::from_chars(begin, end, layer);
      if (ec != std::errc() || ptr == begin || ptr == end || *ptr != '.' || layer < 0 || layer >= d.L)
        fail("[gguf] ", f.path(), ": tensor \"", n, "\" does not name a layer in 0..", d.L - 1);
      const std::string rest(ptr + 1, end);
      const size_t dot = rest.rfind('.');
      const std::string base = rest.substr(0, dot);
      const std::string suffix = dot == std::string::npos ? "" : rest.substr(dot);
      const char* hf = nullptr;
      for (const LayerName& m : kLayerNames)
        if (base == m.gguf) hf = m.hf;
      if (!hf || (suffix != ".weight" && suffix != ".bias"))
        fail("[gguf] ", f.path(), ": tensor \"", n, "\" has no Hugging Face counterpart for ", a.model_type,
             "; the file holds parts this architecture does not have");
      h.hf_name = "model.layers." + std::to_string(layer) + "." + hf + suffix;
      if (permuted && base == "attn_q") h.unpermute_heads = static_cast<int>(d.H);
      if (permuted && base == "attn_k") h.unpermute_heads = static_cast<int>(d.Hkv);
    } else {
      fail("[gguf] ", f.path(), ": tensor \"", n, "\" has no Hugging Face counterpart for ", a.model_type);
    }
    if (h.unpermute_heads) {
      const int64_t rows = h.shape.empty() ? 1 : h.shape[0];
      if (rows % (2 * int64_t{h.unpermute_heads}) != 0)
        fail("[gguf] ", f.path(), ": tensor \"", n, "\" has ", rows, " rows, not a multiple of 2 x ",
             h.unpermute_heads, " heads; its head counts do not match its shape");
    }
    out.push_back(std::move(h));
  }
  return out;
}

// llama.cpp stores each head's rows of W_q / W_k interleaved for its RoPE (pairs of adjacent dimensions):
//   GGUF row  h*D + 2*i + s   holds   HF row  h*D + s*(D/2) + i     (s in {0,1}, i < D/2)
// where HF's layout is rotate_half's (the first half of a head, then the second). This is
// transformers' reverse_permute: reshape(heads, D/2, 2, cols).swapaxes(1, 2).
void gguf_read_f32(const GgufHfTensor& t, float* out) {
  OOM_CHECK(t.src, "[gguf] gguf_read_f32: no source tensor for ", t.hf_name);
  const int64_t n = t.src->numel();
  // An empty tensor (a zero dimension) has nothing to read, however many rows its shape names: the loop
  // below would walk all of them, 2^60 in a crafted file.
  if (n == 0) return;
  if (t.unpermute_heads == 0) {
    dequantize(t.src->type, t.src->data, n, out);
    return;
  }
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const int64_t cols = rows ? n / rows : 0;
  const int64_t D = rows / t.unpermute_heads;
  OOM_CHECK(D % 2 == 0 && D * t.unpermute_heads == rows, "[gguf] gguf_read_f32: ", t.hf_name, " has ", rows,
            " rows, not a multiple of 2 x ", t.unpermute_heads, " heads");
  std::vector<float> tmp(static_cast<size_t>(n));
  dequantize(t.src->type, t.src->data, n, tmp.data());
  for (int64_t h = 0; h < t.unpermute_heads; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t i = 0; i < D / 2; ++i)
        std::memcpy(out + (h * D + s * (D / 2) + i) * cols, tmp.data() + (h * D + 2 * i + s) * cols,
                    static_cast<size_t>(cols) * sizeof(float));
}

GgufTokenizerConfig gguf_tokenizer_config(const GgufFile& f) {
  GgufTokenizerConfig c;
  const GgufValue* tokens = f.find("tokenizer.ggml.tokens");
  const size_t vocab = tokens && tokens->is_array() ? tokens->strings.size() : 0;
  auto id = [&](const char* key) -> std::optional<int32_t> {
    if (!f.has(key)) return std::nullopt;
    const int64_t v = f.get_int(key);
    if (v < 0 || static_cast<uint64_t>(v) >= vocab)
      fail("[gguf] ", f.path(), ": \"", key, "\" = ", v, " is not a token id (the vocabulary has ", vocab,
           " tokens)");
    return static_cast<int32_t>(v);
  };
  c.bos = id("tokenizer.ggml.bos_token_id");
  c.eos = id("tokenizer.ggml.eos_token_id");
  c.pad = id("tokenizer.ggml.padding_token_id");
  c.unk = id("tokenizer.ggml.unknown_token_id");
  // Older sentencepiece files have no flag, and llama.cpp adds BOS for them.
  const GgufValue* model = f.find("tokenizer.ggml.model");
  const bool spm = model && model->type == GgufValueType::string && model->s == "llama";
  c.add_bos = f.has("tokenizer.ggml.add_bos_token") ? f.get_bool("tokenizer.ggml.add_bos_token") : spm;
  c.add_eos = f.has("tokenizer.ggml.add_eos_token") ? f.get_bool("tokenizer.ggml.add_eos_token") : false;
  if (f.has("tokenizer.chat_template")) c.chat_template = f.get_string("tokenizer.chat_template");
  return c;
}

std::string gguf_tensor_name(const std::string& hf) {
  if (hf == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf == "model.norm.weight") return "output_norm.weight";
  if (hf == "lm_head.weight") return "output.weight";
  const std::string pre = "model.layers.";
  if (hf.compare(0, pre.size(), pre) == 0) {
    const size_t dot = hf.find('.', pre.size());
    const std::string layer = hf.substr(pre.size(), dot - pre.size());
    const std::string rest = hf.substr(dot + 1);
    const size_t last = rest.rfind('.');
    const std::string base = rest.substr(0, last), suffix = rest.substr(last);
    for (const LayerName& m : kLayerNames)
      if (base == m.hf) return "blk." + layer + "." + m.gguf + suffix;
  }
  fail("[gguf] tensor ", hf, " has no GGUF name");
}

}  // namespace oomless
