#include "model/config.h"

#include <cmath>
#include <cstdlib>
#include <limits>

#include "core/error.h"

namespace oomless {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::llama: return "llama";
    case Arch::qwen2: return "qwen2";
    case Arch::qwen3: return "qwen3";
    case Arch::mistral: return "mistral";
  }
  return "?";
}

const char* arch_hf_class(Arch a) {
  switch (a) {
    case Arch::llama: return "LlamaForCausalLM";
    case Arch::qwen2: return "Qwen2ForCausalLM";
    case Arch::qwen3: return "Qwen3ForCausalLM";
    case Arch::mistral: return "MistralForCausalLM";
  }
  return "?";
}

namespace {

constexpr const char* kSupported =
    "supported: LlamaForCausalLM (also SmolLM, TinyLlama), Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM";

// transformers' defaults for keys a config.json may leave out.
struct Defaults {
  int64_t V, E, F, L, H;
  int64_t Hkv;  // 0: same as H
  int64_t max_pos;
  double eps;
  int64_t sliding;  // Mistral's default window
};

Defaults defaults_for(Arch a) {
  switch (a) {
    case Arch::llama: return {32000, 4096, 11008, 32, 32, 0, 2048, 1e-6, 0};
    case Arch::qwen2: return {151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, 0};
    case Arch::qwen3: return {151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, 0};
    case Arch::mistral: return {32000, 4096, 14336, 32, 32, 8, 4096 * 32, 1e-6, 4096};
  }
  return {};
}

Arch arch_from_json(const json::Value& cfg, std::string_view source) {
  std::string what;
  if (const json::Value* a = cfg.find("architectures"); a && a->is_array() && a->size() > 0 && (*a)[0].is_string())
    what = (*a)[0].as_string();
  if (what == "LlamaForCausalLM") return Arch::llama;
  if (what == "Qwen2ForCausalLM") return Arch::qwen2;
  if (what == "Qwen3ForCausalLM") return Arch::qwen3;
  if (what == "MistralForCausalLM") return Arch::mistral;
  if (what.empty()) {
    if (const json::Value* t = cfg.find("model_type"); t && t->is_string()) {
      const std::string& mt = t->as_string();
      if (mt == "llama") return Arch::llama;
      if (mt == "qwen2") return Arch::qwen2;
      if (mt == "qwen3") return Arch::qwen3;
      if (mt == "mistral") return Arch::mistral;
      what = "model_type " + mt;
    } else {
      fail("[config] ", source, ": neither \"architectures\" nor \"model_type\" says which model this is; ", kSupported);
    }
  }
  fail("[config] ", source, ": unsupported architecture '", what, "'; ", kSupported);
}

int64_t get_int(const json::Value& cfg, const char* key, int64_t dflt) {
  const json::Value* v = cfg.find(key);
  if (!v || v->is_null()) return dflt;
  return v->as_int(key);
}

double get_num(const json::Value& cfg, const char* key, double dflt) {
  const json::Value* v = cfg.find(key);
  if (!v || v->is_null()) return dflt;
  return v->as_number(key);
}

bool get_bool(const json::Value& cfg, const char* key, bool dflt) {
  const json::Value* v = cfg.find(key);
  if (!v || v->is_null()) return dflt;
  return v->as_bool(key);
}

std::optional<int32_t> get_token_id(const json::Value& cfg, const char* key) {
  const json::Value* v = cfg.find(key);
  if (!v || v->is_null()) return std::nullopt;
  // Some configs list several end tokens; the first is the one generation stops at by default.
  if (v->is_array()) return v->size() ? std::optional<int32_t>(static_cast<int32_t>((*v)[0].as_int(key))) : std::nullopt;
  return static_cast<int32_t>(v->as_int(key));
}

// One rope_scaling object (transformers' rope_type default, linear, llama3 or yarn) into c.rope; keys it
// leaves out take transformers' defaults (original_max_position_embeddings: max_position_embeddings).
void read_rope_scaling(const json::Value& rs, ModelConfig& c, std::string_view source) {
  OOM_CHECK(rs.is_object(), "[config] ", source, ": rope_scaling must be an object or null");
  std::string type = "default";
  if (const json::Value* t = rs.find("rope_type")) type = t->as_string("rope_type");
  else if (const json::Value* t2 = rs.find("type")) type = t2->as_string("rope_scaling.type");
  RopeConfig& r = c.rope;
  const double theta = r.theta;
  r = RopeConfig{};
  r.theta = theta;
  if (type == "default") return;
  // A whole number of positions, an int32 as max_position_embeddings is (and as GGUF stores it).
  const int64_t original = get_int(rs, "original_max_position_embeddings", c.max_position);
  OOM_CHECK(original > 0 && original < (int64_t{1} << 31), "[config] ", source,
            ": rope scaling needs original_max_position_embeddings between 1 and 2^31-1 (found ", original, ")");
  r.original_max_position = static_cast<double>(original);
  if (type == "linear") {
    r.scaling = RopeScaling::linear;
    r.factor = get_num(rs, "factor", 1.0);
  } else if (type == "llama3") {
    r.scaling = RopeScaling::llama3;
    r.factor = get_num(rs, "factor", 8.0);
    r.low_freq_factor = get_num(rs, "low_freq_factor", 1.0);
    r.high_freq_factor = get_num(rs, "high_freq_factor", 4.0);
    OOM_CHECK(r.high_freq_factor > r.low_freq_factor, "[config] ", source,
              ": llama3 rope scaling needs high_freq_factor > low_freq_factor");
  } else if (type == "yarn") {
    r.scaling = RopeScaling::yarn;
    // DeepSeek-style configs leave factor out: the ratio of the two context lengths.
    r.factor = get_num(rs, "factor", static_cast<double>(c.max_position) / r.original_max_position);
    // transformers: `or` defaults, so 0 / null mean the default too.
    r.beta_fast = get_num(rs, "beta_fast", 0.0);
    r.beta_slow = get_num(rs, "beta_slow", 0.0);
    if (r.beta_fast == 0) r.beta_fast = 32.0;
    if (r.beta_slow == 0) r.beta_slow = 1.0;
    r.truncate = get_bool(rs, "truncate", true);
    auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    const double m = get_num(rs, "mscale", 0.0), m_all = get_num(rs, "mscale_all_dim", 0.0);
    r.attention_factor = get_num(rs, "attention_factor", m != 0 && m_all != 0
                                                             ? mscale(r.factor, m) / mscale(r.factor, m_all)
                                                             : mscale(r.factor, 1.0));
    OOM_CHECK(r.beta_fast > 0 && r.beta_slow > 0 && r.attention_factor > 0 && std::isfinite(r.attention_factor),
              "[config] ", source, ": yarn rope scaling needs beta_fast, beta_slow and attention_factor > 0");
  } else {
    fail("[config] ", source, ": rope scaling type '", type,
         "' is not supported; supported: none/default, linear, llama3 and yarn");
  }
  OOM_CHECK(r.factor > 0 && std::isfinite(r.factor), "[config] ", source, ": rope scaling needs factor > 0, got ",
            r.factor);
}

// rope_scaling (transformers 4.x) or rope_parameters (5.x).
void read_rope(const json::Value& cfg, ModelConfig& c, std::string_view source) {
  c.rope.theta = get_num(cfg, "rope_theta", 10000.0);
  const json::Value* rs = cfg.find("rope_scaling");
  const json::Value* rp = cfg.find("rope_parameters");
  if (rp && rp->is_object()) {
    if (const json::Value* t = rp->find("rope_theta")) c.rope.theta = t->as_number("rope_parameters.rope_theta");
    if (!rs || rs->is_null()) rs = rp;
  }
  if (!rs || rs->is_null()) return;
  read_rope_scaling(*rs, c, source);
}

}  // namespace

int64_t ModelConfig::param_count() const {
  int64_t n = 0;
  for (const ParamSpec& p : param_specs(*this)) {
    int64_t k = 1;
    for (int64_t d : p.shape) k *= d;
    n += k;
  }
  return n;
}

void ModelConfig::validate(std::string_view source) const {
  OOM_CHECK(L > 0 && E > 0 && F > 0 && H > 0 && Hkv > 0 && D > 0 && V > 0, "[config] ", source,
            ": num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, "
            "head_dim and vocab_size must all be positive (found L=", L, " E=", E, " F=", F, " H=", H, " Hkv=", Hkv,
            " D=", D, " V=", V, ")");
  // The deepest published decoders have a few hundred layers; a per-layer list of a larger count is a typo's
  // gigabytes (every layer's tensors are listed when the model is built).
  OOM_CHECK(L <= kMaxLayers, "[config] ", source, ": num_hidden_layers ", L, " is more than ", kMaxLayers,
            " layers; is the config's value a typo?");
  OOM_CHECK(H % Hkv == 0, "[config] ", source, ": num_attention_heads (", H,
            ") must be a multiple of num_key_value_heads (", Hkv, ")");
  OOM_CHECK(D % 2 == 0, "[config] ", source, ": head_dim must be even for rotary embeddings (found ", D, ")");
  OOM_CHECK(V < (int64_t{1} << 31), "[config] ", source, ": vocab_size ", V, " does not fit 32-bit token ids");
  OOM_CHECK(max_position > 0 && max_position < (int64_t{1} << 31), "[config] ", source,
            ": max_position_embeddings must be between 1 and 2^31-1 (found ", max_position, ")");
  OOM_CHECK(rms_eps > 0 && std::isfinite(rms_eps), "[config] ", source, ": rms_norm_eps must be positive");
  OOM_CHECK(rope.theta > 0 && std::isfinite(rope.theta), "[config] ", source, ": rope_theta must be positive");
}

void ModelConfig::check_sequence(int64_t T) const {
  OOM_CHECK(sliding_window == 0 || T <= sliding_window, "[config] sequence length ", T,
            " exceeds the model's sliding_window ", sliding_window,
            "; sliding-window attention is not supported: use --seq <= ", sliding_window);
}

ModelConfig ModelConfig::from_json(const json::Value& cfg, std::string_view source) {
  OOM_CHECK(cfg.is_object(), "[config] ", source, ": config.json must be a JSON object");
  ModelConfig c;
  c.arch = arch_from_json(cfg, source);
  const Defaults d = defaults_for(c.arch);

  const json::Value* act = cfg.find("hidden_act");
  if (!act || act->is_null()) act = cfg.find("hidden_activation");
  if (act && !act->is_null()) {
    const std::string& a = act->as_string("hidden_act");
    OOM_CHECK(a == "silu" || a == "swish", "[config] ", source, ": hidden_act '", a,
              "' is not supported; supported: silu (SwiGLU MLP)");
  }
  OOM_CHECK(!get_bool(cfg, "mlp_bias", false), "[config] ", source,
            ": mlp_bias true is not supported; supported: MLP projections without bias");

  c.V = get_int(cfg, "vocab_size", d.V);
  c.E = get_int(cfg, "hidden_size", d.E);
  c.F = get_int(cfg, "intermediate_size", d.F);
  c.L = get_int(cfg, "num_hidden_layers", d.L);
  c.H = get_int(cfg, "num_attention_heads", d.H);
  c.Hkv = get_int(cfg, "num_key_value_heads", d.Hkv ? d.Hkv : c.H);
  c.D = get_int(cfg, "head_dim", c.H > 0 ? c.E / c.H : 0);
  if (c.arch == Arch::qwen3) c.D = get_int(cfg, "head_dim", 128);
  c.rms_eps = get_num(cfg, "rms_norm_eps", d.eps);
  c.max_position = get_int(cfg, "max_position_embeddings", d.max_pos);
  c.tied = get_bool(cfg, "tie_word_embeddings", false);  // false for all four architectures
  read_rope(cfg, c, source);

  const bool attention_bias = get_bool(cfg, "attention_bias", false);
  switch (c.arch) {
    case Arch::llama:
      c.qkv_bias = c.o_bias = attention_bias;
      break;
    case Arch::qwen2:
      c.qkv_bias = true;  // built into Qwen2Attention, no config key
      break;
    case Arch::qwen3:
      c.qkv_bias = c.o_bias = attention_bias;
      c.qk_norm = true;
      break;
    case Arch::mistral:
      break;
  }

  // Sliding windows: Mistral's applies whenever set; Qwen2/3 only with use_sliding_window.
  if (c.arch == Arch::mistral) {
    const json::Value* sw = cfg.find("sliding_window");
    c.sliding_window = !sw ? d.sliding : sw->is_null() ? 0 : sw->as_int("sliding_window");
  } else if ((c.arch == Arch::qwen2 || c.arch == Arch::qwen3) && get_bool(cfg, "use_sliding_window", false)) {
    c.sliding_window = get_int(cfg, "sliding_window", 4096);
  }
  OOM_CHECK(c.sliding_window >= 0, "[config] ", source, ": sliding_window must be >= 0 or null");

  c.bos_id = get_token_id(cfg, "bos_token_id");
  c.eos_id = get_token_id(cfg, "eos_token_id");
  c.validate(source);
  return c;
}

void apply_rope_scaling(ModelConfig& c, std::string_view spec, std::string_view source) {
  if (spec == "none" || spec == "default") {
    c.rope = RopeConfig{c.rope.theta};
    return;
  }
  if (!spec.empty() && spec.front() == '{') {
    const json::Value rs = json::parse(spec, source);
    // A key given here that no rope type reads would be dropped without a word: refuse it.
    static const char* kKeys[] = {"rope_type", "type", "factor", "original_max_position_embeddings", "low_freq_factor",
                                  "high_freq_factor", "beta_fast", "beta_slow", "truncate", "mscale",
                                  "mscale_all_dim", "attention_factor"};
    if (rs.is_object())
      for (const auto& [k, v] : rs.as_object()) {
        bool known = false;
        for (const char* x : kKeys) known |= k == x;
        OOM_CHECK(known, "[config] ", source, ": rope scaling key \"", k, "\" is not read by any rope type; the keys are "
                  "rope_type, factor, original_max_position_embeddings, low_freq_factor, high_freq_factor (llama3), "
                  "beta_fast, beta_slow, truncate, mscale, mscale_all_dim, attention_factor (yarn)");
      }
    read_rope_scaling(rs, c, source);
    return;
  }
  const size_t colon = spec.find(':');
  const std::string_view type = spec.substr(0, colon);
  const std::string num = colon == std::string_view::npos ? std::string() : std::string(spec.substr(colon + 1));
  char* end = nullptr;
  const double factor = num.empty() ? 0.0 : std::strtod(num.c_str(), &end);
  OOM_CHECK((type == "linear" || type == "llama3" || type == "yarn") && !num.empty() && end && *end == '\0' &&
                factor >= 1 && std::isfinite(factor),
            "[config] ", source, ": rope scaling '", spec, "' is not TYPE:FACTOR with TYPE linear, llama3 or yarn and "
            "FACTOR >= 1 (e.g. yarn:4), none, or a rope_scaling JSON object");
  // The model's context so far is the original one; the scaled model covers FACTOR times more, and a position
  // is an int32 (config.json's max_position_embeddings too).
  const double scaled = static_cast<double>(c.max_position) * factor;
  OOM_CHECK(scaled <= static_cast<double>(std::numeric_limits<int32_t>::max()), "[config] ", source, ": rope scaling '",
            spec, "' would give ", scaled, " positions (", c.max_position, " x ", factor,
            "), more than a position can number (2^31 - 1): give a smaller FACTOR");
  json::Value rs = json::Value::object();
  rs.set("rope_type", json::Value::string(std::string(type)));
  rs.set("factor", json::Value::number(factor));
  rs.set("original_max_position_embeddings", json::Value::integer(c.max_position));
  read_rope_scaling(rs, c, source);
  c.max_position = static_cast<int64_t>(std::llround(static_cast<double>(c.max_position) * factor));
}

ModelConfig ModelConfig::from_file(const std::string& path) { return from_json(json::parse_file(path), path); }

json::Value ModelConfig::to_json() const {
  using json::Value;
  Value o = Value::object();
  o.set("architectures", Value::array({Value::string(arch_hf_class(arch))}));
  o.set("model_type", Value::string(arch_name(arch)));
  o.set("vocab_size", Value::integer(V));
  o.set("hidden_size", Value::integer(E));
  o.set("intermediate_size", Value::integer(F));
  o.set("num_hidden_layers", Value::integer(L));
  o.set("num_attention_heads", Value::integer(H));
  o.set("num_key_value_heads", Value::integer(Hkv));
  o.set("head_dim", Value::integer(D));
  o.set("hidden_act", Value::string("silu"));
  o.set("max_position_embeddings", Value::integer(max_position));
  o.set("rms_norm_eps", Value::number(rms_eps));
  o.set("rope_theta", Value::number(rope.theta));
  if (rope.scaling != RopeScaling::none) {
    Value rs = Value::object();
    rs.set("rope_type", Value::string(rope_scaling_name(rope.scaling)));
    rs.set("factor", Value::number(rope.factor));
    if (rope.scaling == RopeScaling::llama3) {
      rs.set("low_freq_factor", Value::number(rope.low_freq_factor));
      rs.set("high_freq_factor", Value::number(rope.high_freq_factor));
    }
    if (rope.scaling == RopeScaling::yarn) {
      rs.set("beta_fast", Value::number(rope.beta_fast));
      rs.set("beta_slow", Value::number(rope.beta_slow));
      rs.set("truncate", Value::boolean(rope.truncate));
      rs.set("attention_factor", Value::number(rope.attention_factor));
    }
    if (rope.scaling != RopeScaling::linear)
      rs.set("original_max_position_embeddings", Value::integer(static_cast<int64_t>(rope.original_max_position)));
    o.set("rope_scaling", std::move(rs));
  } else {
    o.set("rope_scaling", Value());
  }
  o.set("tie_word_embeddings", Value::boolean(tied));
  if (arch == Arch::llama || arch == Arch::qwen3) o.set("attention_bias", Value::boolean(o_bias));
  if (arch == Arch::llama) o.set("mlp_bias", Value::boolean(false));
  if (arch == Arch::mistral) o.set("sliding_window", sliding_window ? Value::integer(sliding_window) : Value());
  if (arch == Arch::qwen2 || arch == Arch::qwen3) o.set("use_sliding_window", Value::boolean(false));
  o.set("bos_token_id", bos_id ? Value::integer(*bos_id) : Value());
  o.set("eos_token_id", eos_id ? Value::integer(*eos_id) : Value());
  o.set("torch_dtype", Value::string("float32"));
  return o;
}

ModelConfig preset_config(std::string_view name) {
  ModelConfig c;
  c.arch = Arch::llama;
  c.tied = true;
  c.rms_eps = 1e-5;
  c.rope.theta = 10000.0;
  if (name == "micro") {
    c.L = 2, c.E = 64, c.F = 128, c.H = 4, c.Hkv = 2, c.D = 16, c.V = 8192;
    c.max_position = 1 << 20;
    c.eos_id = 0;
  } else if (name == "tiny") {
    c.L = 6, c.E = 384, c.F = 1024, c.H = 6, c.Hkv = 2, c.D = 64, c.V = 8192;
    c.max_position = 1 << 20;
    c.eos_id = 0;
  } else if (name == "smollm2-135m") {
    // SmolLM2-135M as its GGUF describes it (llama, 30 layers, GQA 9/3, tied, theta 1e5).
    c.L = 30, c.E = 576, c.F = 1536, c.H = 9, c.Hkv = 3, c.D = 64, c.V = 49152;
    c.rope.theta = 100000.0;
    c.max_position = 8192;
    c.bos_id = 1, c.eos_id = 2;
  } else {
    std::string known;
    for (const std::string& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    fail("[config] unknown preset '", name, "'; known presets: ", known);
  }
  c.validate(std::string("preset:") + std::string(name));
  return c;
}

std::vector<std::string> preset_names() { return {"micro", "tiny", "smollm2-135m"}; }


}  // namespace oomless
