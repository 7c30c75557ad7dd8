#include "io/peft.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"

namespace oomless {

namespace {

constexpr const char* kKeyPrefix = "base_model.model.";

// ---------------------------------------------------------------- regexes (Python re semantics via PCRE2)

// One compiled pattern. Python 3 str patterns are Unicode-aware (\d, \w), hence UTF + UCP. Matching is
// bounded (match and depth limits) so that a pathological pattern is an error rather than a hang.
class Regex {
 public:
  Regex(const std::string& pattern, std::string_view what, std::string_view source) : what_(what), source_(source) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (!code) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof buf);
      fail("[adapter] ", source, ": ", what, " ", json::quote(pattern), " is not a valid regex (offset ", offset,
           ": ", reinterpret_cast<const char*>(buf), ")");
    }
    code_.reset(code);
  }

  // full: Python's re.fullmatch; otherwise re.match (anchored at the start only). `group`, when given,
  // receives that named group's text.
  bool match(std::string_view subject, bool full, const char* group = nullptr, std::string* out = nullptr) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr), &pcre2_match_data_free);
    std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> ctx(pcre2_match_context_create(nullptr),
                                                                                   &pcre2_match_context_free);
    OOM_CHECK(md && ctx, "[adapter] out of memory matching a regex");
    pcre2_set_match_limit(ctx.get(), 1000000);
    pcre2_set_depth_limit(ctx.get(), 10000);
    const uint32_t opts = PCRE2_ANCHORED | (full ? PCRE2_ENDANCHORED : 0);
    const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), 0, opts,
                               md.get(), ctx.get());
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0)
      fail("[adapter] ", source_, ": ", what_, " is too costly to match against ", json::quote(subject),
           " (PCRE2 error ", rc, "); simplify the pattern");
    if (group && out) {
      PCRE2_SIZE len = 0;
      PCRE2_UCHAR* text = nullptr;
      if (pcre2_substring_get_byname(md.get(), reinterpret_cast<PCRE2_SPTR>(group), &text, &len) != 0) return true;
      out->assign(reinterpret_cast<const char*>(text), len);
      pcre2_substring_free(text);
    }
    return true;
  }

 private:
  struct Free {
    void operator()(pcre2_code* c) const { pcre2_code_free(c); }
  };
  std::unique_ptr<pcre2_code, Free> code_;
  std::string what_;
  std::string source_;
};

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// PEFT's list matching: the entry is the module's name or a dotted suffix of it.
bool name_matches(std::string_view name, std::string_view entry) {
  return name == entry || (name.size() > entry.size() && ends_with(name, entry) &&
                           name[name.size() - entry.size() - 1] == '.');
}

// The patterns PEFT builds around user strings (peft/tuners/tuners_utils.py, peft/utils/other.py).
std::string pattern_key_regex(const std::string& key) { return "(.*\\.)?(" + key + ")$"; }
std::string saved_exclusion_regex(const std::string& m) { return "(^|.*\\.)" + m + "($|\\..*)"; }
std::string layer_index_regex(const std::optional<std::string>& layers_pattern) {
  if (!layers_pattern || layers_pattern->empty()) return ".*?\\.[^.]*\\.(?P<idx>\\d+)\\.";
  return "(?:^|.*?\\.)" + *layers_pattern + "\\.(?P<idx>\\d+)\\.";
}

// ---------------------------------------------------------------- reading the config

std::string shown(const json::Value& v) {
  std::string s = json::dump(v);
  if (s.size() > 200) s = s.substr(0, 200) + "...";
  return s;
}

// A field PEFT reads and oomless cannot honour with this value.
[[noreturn]] void unsupported(std::string_view source, std::string_view field, const json::Value& v,
                              std::string_view supported) {
  fail("[adapter] ", source, ": ", field, " = ", shown(v), " is not supported (supported: ", supported, ")");
}

// A value that is "off" in every PEFT field that has one: a newer PEFT's unknown field with such a value
// cannot change what the adapter computes.
bool inert(const json::Value& v) {
  switch (v.kind()) {
    case json::Value::Kind::null: return true;
    case json::Value::Kind::boolean: return !v.as_bool();
    case json::Value::Kind::number: return v.as_number() == 0;
    case json::Value::Kind::string: return v.as_string().empty();
    case json::Value::Kind::array:
    case json::Value::Kind::object: return v.size() == 0;
  }
  return false;
}

// Python's str.lower() on ASCII letters (PEFT lowers "all-linear" and "gaussian" before comparing).
std::string ascii_lower(std::string s) {
  for (char& ch : s)
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  return s;
}

bool is_int(const json::Value& v) {
  if (v.is_integer()) return true;
  if (!v.is_number()) return false;
  const double d = v.as_number();
  return std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.007199254740992e15;
}

// A number written as PEFT writes it: integral values as integers (lora_alpha is an int field).
json::Value number_value(double d) {
  if (d == std::floor(d) && std::abs(d) < 9.007199254740992e15) return json::Value::integer(static_cast<int64_t>(d));
  return json::Value::number(d);
}

ModuleSelector read_selector(const json::Value& v, std::string_view field, std::string_view source,
                             bool allow_all_linear) {
  ModuleSelector s;
  if (v.is_null()) return s;
  if (v.is_string()) {
    s.text = v.as_string();
    s.kind = allow_all_linear && ascii_lower(s.text) == "all-linear" ? ModuleSelector::Kind::all_linear
                                                                     : ModuleSelector::Kind::regex;
    if (s.kind == ModuleSelector::Kind::regex) Regex(s.text, std::string(field) + " regex", source);
    return s;
  }
  if (v.is_array()) {
    s.kind = ModuleSelector::Kind::names;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string() || v[i].as_string().empty())
        unsupported(source, field, v, "null, a list of module names, or a regex string");
      s.names.push_back(v[i].as_string());
    }
    return s;
  }
  unsupported(source, field, v, "null, a list of module names, or a regex string");
}

std::vector<std::string> read_string_list(const json::Value& v, std::string_view field, std::string_view source) {
  std::vector<std::string> out;
  if (v.is_string()) return {v.as_string()};
  if (!v.is_array()) unsupported(source, field, v, "null, a string or a list of strings");
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) unsupported(source, field, v, "null, a string or a list of strings");
    out.push_back(v[i].as_string());
  }
  return out;
}

// Fields that must hold their "off" value; `supported` says which.
struct OffField {
  const char* name;
  const char* supported;
  const char* feature;  // for the message
};
constexpr OffField kOffFields[] = {
    {"alora_invocation_tokens", "null", "activated LoRA"},
    {"arrow_config", "null", "Arrow routing"},
    {"kasa_config", "null", "KaSA"},
    {"layer_replication", "null", "layer replication"},
    {"lora_bias", "false", "a bias on lora_B"},
    {"megatron_config", "null", "Megatron parallel layers"},
    {"monteclora_config", "null", "MonteCLoRA"},
    {"trainable_token_indices", "null", "trainable tokens"},
    {"use_bdlora", "null", "block-diagonal LoRA"},
    {"use_qalora", "false", "QA-LoRA"},
    {"velora_config", "null", "VeLoRA"},
    {"fan_in_fan_out", "false", "Conv1D (fan_in, fan_out) weights"},
};

// Fields read below, and ones accepted whatever they hold because they change nothing here.
constexpr const char* kKnownFields[] = {
    "peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "bias",
    "use_rslora", "use_dora", "modules_to_save", "init_lora_weights", "layers_to_transform", "layers_pattern",
    "rank_pattern", "alpha_pattern", "ensure_weight_tying", "base_model_name_or_path", "revision", "peft_version",
    "inference_mode", "auto_mapping", "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "target_parameters", "runtime_config"};

}  // namespace

// ---------------------------------------------------------------- names

const char* linear_module_name(LinearModule m) {
  switch (m) {
    case LinearModule::q_proj: return "q_proj";
    case LinearModule::k_proj: return "k_proj";
    case LinearModule::v_proj: return "v_proj";
    case LinearModule::o_proj: return "o_proj";
    case LinearModule::gate_proj: return "gate_proj";
    case LinearModule::up_proj: return "up_proj";
    case LinearModule::down_proj: return "down_proj";
  }
  return "?";
}

const char* linear_module_path(LinearModule m) {
  switch (m) {
    case LinearModule::q_proj: return "self_attn.q_proj";
    case LinearModule::k_proj: return "self_attn.k_proj";
    case LinearModule::v_proj: return "self_attn.v_proj";
    case LinearModule::o_proj: return "self_attn.o_proj";
    case LinearModule::gate_proj: return "mlp.gate_proj";
    case LinearModule::up_proj: return "mlp.up_proj";
    case LinearModule::down_proj: return "mlp.down_proj";
  }
  return "?";
}

std::optional<LinearModule> linear_module_from_name(std::string_view name) {
  for (LinearModule m : kLinearModules)
    if (name == linear_module_name(m)) return m;
  return std::nullopt;
}

std::string linear_module_full_name(int64_t layer, LinearModule m) {
  return "model.layers." + std::to_string(layer) + "." + linear_module_path(m);
}

const char* saved_module_full_name(SavedModule m) {
  return m == SavedModule::embed_tokens ? "model.embed_tokens" : "lm_head";
}

std::vector<std::string> hf_module_names(const ModelConfig& c) {
  std::vector<std::string> n = {"model", "model.embed_tokens", "model.layers"};
  for (int64_t l = 0; l < c.L; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    n.push_back(p);
    n.push_back(p + ".self_attn");
    for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"}) n.push_back(p + ".self_attn." + m);
    if (c.qk_norm) {
      n.push_back(p + ".self_attn.q_norm");
      n.push_back(p + ".self_attn.k_norm");
    }
    n.push_back(p + ".mlp");
    for (const char* m : {"gate_proj", "up_proj", "down_proj", "act_fn"}) n.push_back(p + ".mlp." + m);
    n.push_back(p + ".input_layernorm");
    n.push_back(p + ".post_attention_layernorm");
  }
  for (const char* m : {"model.norm", "model.rotary_emb", "lm_head"}) n.push_back(m);
  return n;
}

// ---------------------------------------------------------------- AdapterConfig

double AdapterConfig::scale(int64_t rank, double alpha) const {
  OOM_CHECK(rank > 0, "[adapter] scale: r must be positive, got ", rank);
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

AdapterConfig AdapterConfig::from_file(const std::string& path) {
  const bool is_json = ends_with(path, ".json");
  const std::string file = is_json ? path : path + (ends_with(path, "/") ? "" : "/") + "adapter_config.json";
  return from_json(json::parse_file(file), file);
}

AdapterConfig AdapterConfig::from_json(const json::Value& v, std::string_view source) {
  using json::Value;
  OOM_CHECK(v.is_object(), "[adapter] ", source, ": adapter_config.json must be a JSON object, found ",
            Value::kind_name(v.kind()));
  AdapterConfig a;
  const Value null_value;
  auto get = [&](const char* key) -> const Value& {
    const Value* p = v.find(key);
    return p ? *p : null_value;
  };
  auto get_bool = [&](const char* key, bool dflt) {
    const Value& x = get(key);
    if (x.is_null()) return dflt;
    if (!x.is_bool()) unsupported(source, key, x, "true or false");
    return x.as_bool();
  };
  auto get_opt_string = [&](const char* key) -> std::optional<std::string> {
    const Value& x = get(key);
    if (x.is_null()) return std::nullopt;
    if (!x.is_string()) unsupported(source, key, x, "null or a string");
    return x.as_string();
  };

  const Value* pt = v.find("peft_type");
  OOM_CHECK(pt, "[adapter] ", source, ": no peft_type; PEFT writes \"peft_type\": \"LORA\" for a LoRA adapter");
  if (!pt->is_string() || pt->as_string() != "LORA") unsupported(source, "peft_type", *pt, "\"LORA\"");
  if (const Value& t = get("task_type"); !t.is_null() && !(t.is_string() && t.as_string() == "CAUSAL_LM"))
    unsupported(source, "task_type", t, "\"CAUSAL_LM\" or null");

  if (const Value& r = get("r"); !r.is_null()) {
    if (!is_int(r) || r.as_int() <= 0) unsupported(source, "r", r, "a positive integer");
    a.r = r.as_int();
  }
  if (const Value& x = get("lora_alpha"); !x.is_null()) {
    if (!x.is_number() || !std::isfinite(x.as_number())) unsupported(source, "lora_alpha", x, "a finite number");
    a.lora_alpha = x.as_number();
  }
  if (const Value& x = get("lora_dropout"); !x.is_null()) {
    if (!x.is_number() || !(x.as_number() >= 0 && x.as_number() < 1))
      unsupported(source, "lora_dropout", x, "a probability p, 0 <= p < 1");
    a.lora_dropout = x.as_number();
  }
  a.target_modules = read_selector(get("target_modules"), "target_modules", source, true);
  a.exclude_modules = read_selector(get("exclude_modules"), "exclude_modules", source, false);
  if (const Value& b = get("bias"); !b.is_null() && !(b.is_string() && b.as_string() == "none"))
    unsupported(source, "bias", b, "\"none\" (biases of the base model stay frozen)");
  a.use_rslora = get_bool("use_rslora", false);
  a.use_dora = get_bool("use_dora", false);
  a.ensure_weight_tying = get_bool("ensure_weight_tying", false);

  if (const Value& m = get("modules_to_save"); !m.is_null()) {
    if (!m.is_array()) unsupported(source, "modules_to_save", m, "null or a list of module names");
    a.modules_to_save.emplace();
    for (size_t i = 0; i < m.size(); ++i) {
      if (!m[i].is_string() || m[i].as_string().empty())
        unsupported(source, "modules_to_save", m, "null or a list of module names");
      a.modules_to_save->push_back(m[i].as_string());
      Regex(saved_exclusion_regex(m[i].as_string()), "modules_to_save entry", source);
    }
  }

  constexpr const char* kInits = "true, false or \"gaussian\"";
  if (const Value& x = get("init_lora_weights"); !x.is_null()) {
    if (x.is_bool()) a.init = x.as_bool() ? LoraInit::kaiming : LoraInit::random;
    else if (x.is_string() && ascii_lower(x.as_string()) == "gaussian") a.init = LoraInit::gaussian;
    else unsupported(source, "init_lora_weights", x, kInits);
  }

  if (const Value& x = get("layers_to_transform"); !x.is_null()) {
    std::vector<int64_t> layers;
    if (is_int(x)) {
      layers.push_back(x.as_int());
    } else if (x.is_array()) {
      for (size_t i = 0; i < x.size(); ++i) {
        if (!is_int(x[i])) unsupported(source, "layers_to_transform", x, "null, a layer index or a list of them");
        layers.push_back(x[i].as_int());
      }
    } else {
      unsupported(source, "layers_to_transform", x, "null, a layer index or a list of them");
    }
    for (int64_t l : layers)
      if (l < 0) unsupported(source, "layers_to_transform", x, "layer indices >= 0");
    a.layers_to_transform = std::move(layers);
  }
  if (const Value& x = get("layers_pattern"); !x.is_null()) {
    a.layers_pattern = read_string_list(x, "layers_pattern", source);
    for (const std::string& p : *a.layers_pattern) Regex(layer_index_regex(p), "layers_pattern", source);
  }
  auto read_pattern = [&](const char* key, bool integer) {
    std::vector<std::pair<std::string, double>> out;
    const Value& x = get(key);
    if (x.is_null()) return out;
    const char* what = integer ? "an object of regex -> positive integer" : "an object of regex -> number";
    if (!x.is_object()) unsupported(source, key, x, what);
    for (const auto& [k, val] : x.as_object()) {
      const bool ok = integer ? is_int(val) && val.as_int() > 0 : val.is_number() && std::isfinite(val.as_number());
      if (!ok) unsupported(source, std::string(key) + "[" + json::quote(k) + "]", val, what);
      Regex(pattern_key_regex(k), std::string(key) + " key " + json::quote(k), source);
      out.emplace_back(k, val.as_number());
    }
    return out;
  };
  for (const auto& [k, r] : read_pattern("rank_pattern", true)) a.rank_pattern.emplace_back(k, static_cast<int64_t>(r));
  a.alpha_pattern = read_pattern("alpha_pattern", false);

  // PEFT's own consistency checks (LoraConfig.__post_init__).
  const bool regex_target = a.target_modules.kind == ModuleSelector::Kind::regex ||
                            a.target_modules.kind == ModuleSelector::Kind::all_linear;
  OOM_CHECK(!(regex_target && a.layers_to_transform), "[adapter] ", source,
            ": layers_to_transform cannot be used when target_modules is a string (", json::quote(a.target_modules.text),
            "); PEFT refuses this too: list the modules instead");
  OOM_CHECK(!(regex_target && a.layers_pattern), "[adapter] ", source,
            ": layers_pattern cannot be used when target_modules is a string; PEFT refuses this too");
  OOM_CHECK(!(a.layers_pattern && !a.layers_pattern->empty() && !a.layers_to_transform), "[adapter] ", source,
            ": layers_pattern needs layers_to_transform; PEFT refuses this too");

  a.base_model_name_or_path = get_opt_string("base_model_name_or_path");
  a.revision = get_opt_string("revision");
  if (auto pv = get_opt_string("peft_version")) a.peft_version = *pv;
  get_bool("inference_mode", false);  // type check only; PEFT sets it on load
  get_opt_string("megatron_core");
  if (const Value& x = get("qalora_group_size"); !x.is_null() && !is_int(x))
    unsupported(source, "qalora_group_size", x, "an integer (unused: use_qalora must be false)");
  if (const Value& x = get("auto_mapping"); !x.is_null() && !x.is_object())
    unsupported(source, "auto_mapping", x, "null or an object");

  for (const OffField& f : kOffFields) {
    const Value& x = get(f.name);
    if (!x.is_null() && !(std::string_view(f.supported) == "false" && x.is_bool() && !x.as_bool()))
      fail("[adapter] ", source, ": ", f.name, " = ", shown(x), " is not supported (supported: ", f.supported,
           "; oomless does not implement ", f.feature, ")");
  }
  if (const Value& x = get("target_parameters"); !inert(x))
    fail("[adapter] ", source, ": target_parameters = ", shown(x),
         " is not supported (supported: null or []; oomless adapts linear modules, not bare parameters)");
  // Initialisation schemes' own configs: PEFT ignores them (with a warning) unless init_lora_weights names
  // the scheme, and none of those schemes is accepted above.
  for (const char* key : {"loftq_config", "eva_config", "corda_config", "lora_ga_config"})
    if (const Value& x = get(key); !inert(x))
      a.warnings.push_back(std::string(source) + ": " + key + " is ignored: init_lora_weights does not select it");
  if (!get("runtime_config").is_null())
    a.warnings.push_back(std::string(source) + ": runtime_config is ignored (PEFT drops it on load too)");

  for (const auto& [key, x] : v.as_object()) {
    bool known = false;
    for (const char* k : kKnownFields) known = known || key == k;
    for (const OffField& f : kOffFields) known = known || key == f.name;
    if (known) continue;
    if (!inert(x))
      fail("[adapter] ", source, ": unknown field ", json::quote(key), " = ", shown(x),
           " (not a PEFT 0.21.2 LoraConfig field; a newer PEFT's feature oomless does not implement?). "
           "Only null, false, 0, \"\", [] or {} are accepted in unknown fields");
    a.warnings.push_back(std::string(source) + ": unknown field " + json::quote(key) + " = " + shown(x) +
                         " ignored (not a PEFT 0.21.2 field)");
  }
  return a;
}

json::Value AdapterConfig::to_json() const {
  using json::Value;
  std::map<std::string, Value> f;  // sorted, as json.dumps(sort_keys=True)
  auto selector = [](const ModuleSelector& s) {
    switch (s.kind) {
      case ModuleSelector::Kind::none: return Value();
      case ModuleSelector::Kind::all_linear:
      case ModuleSelector::Kind::regex: return Value::string(s.text);
      case ModuleSelector::Kind::names: {
        Value a = Value::array();
        for (const std::string& n : s.names) a.push_back(Value::string(n));
        return a;
      }
    }
    return Value();
  };
  auto opt_string = [](const std::optional<std::string>& s) { return s ? Value::string(*s) : Value(); };
  for (const OffField& o : kOffFields)
    f[o.name] = std::string_view(o.supported) == "false" ? Value::boolean(false) : Value();
  f["alpha_pattern"] = Value::object();
  for (const auto& [k, val] : alpha_pattern) f["alpha_pattern"].set(k, number_value(val));
  f["rank_pattern"] = Value::object();
  for (const auto& [k, val] : rank_pattern) f["rank_pattern"].set(k, Value::integer(val));
  // json.dumps(sort_keys=True) sorts nested objects too.
  for (const char* key : {"alpha_pattern", "rank_pattern"}) {
    json::Value::Object o = f[key].as_object();
    std::sort(o.begin(), o.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    f[key] = Value::object(std::move(o));
  }
  f["auto_mapping"] = Value();
  f["base_model_name_or_path"] = opt_string(base_model_name_or_path);
  f["bias"] = Value::string("none");
  f["corda_config"] = Value();
  f["ensure_weight_tying"] = Value::boolean(ensure_weight_tying);
  f["eva_config"] = Value();
  f["exclude_modules"] = selector(exclude_modules);
  f["inference_mode"] = Value::boolean(true);  // save_pretrained sets it
  f["init_lora_weights"] = init == LoraInit::gaussian ? Value::string("gaussian") : Value::boolean(init == LoraInit::kaiming);
  if (layers_pattern) {
    Value a = Value::array();
    for (const std::string& p : *layers_pattern) a.push_back(Value::string(p));
    f["layers_pattern"] = a;
  } else {
    f["layers_pattern"] = Value();
  }
  if (layers_to_transform) {
    Value a = Value::array();
    for (int64_t l : *layers_to_transform) a.push_back(Value::integer(l));
    f["layers_to_transform"] = a;
  } else {
    f["layers_to_transform"] = Value();
  }
  f["loftq_config"] = Value::object();
  f["lora_alpha"] = number_value(lora_alpha);
  f["lora_dropout"] = Value::number(lora_dropout);
  f["lora_ga_config"] = Value();
  f["megatron_core"] = Value::string("megatron.core");
  if (modules_to_save) {
    Value a = Value::array();
    for (const std::string& m : *modules_to_save) a.push_back(Value::string(m));
    f["modules_to_save"] = a;
  } else {
    f["modules_to_save"] = Value();
  }
  f["peft_type"] = Value::string("LORA");
  f["peft_version"] = Value::string("0.21.2");
  f["qalora_group_size"] = Value::integer(16);
  f["r"] = Value::integer(r);
  f["revision"] = opt_string(revision);
  f["target_modules"] = selector(target_modules);
  f["target_parameters"] = Value();
  f["task_type"] = Value::string("CAUSAL_LM");
  f["use_dora"] = Value::boolean(use_dora);
  f["use_rslora"] = Value::boolean(use_rslora);
  Value out = Value::object();
  for (auto& [k, val] : f) out.set(k, std::move(val));
  return out;
}

std::string AdapterConfig::to_text() const { return json::dump(to_json(), 2); }

AdapterConfig AdapterConfig::with_all_linear_expanded(const ModelConfig& c) const {
  AdapterConfig out = *this;
  if (target_modules.kind != ModuleSelector::Kind::all_linear) return out;
  // _maybe_include_all_linear_layers: every nn.Linear but the output embedding.
  std::vector<std::string> linear;
  for (int64_t l = 0; l < c.L; ++l)
    for (LinearModule m : kLinearModules) linear.push_back(linear_module_full_name(l, m));
  std::set<std::string> result(linear.begin(), linear.end());
  // From 20 targets on, BaseTuner.inject_adapter condenses the list to the shortest suffixes that no other
  // module has (_find_minimal_target_modules), taking the targets in order of their suffix lists.
  if (linear.size() >= 20) {
    auto suffixes = [](const std::string& s) {
      std::vector<std::string> out;  // shortest first
      for (size_t i = s.size(); i-- > 0;)
        if (s[i] == '.') out.push_back(s.substr(i + 1));
      out.push_back(s);
      return out;
    };
    std::set<std::string> other;
    std::vector<std::string> all = hf_module_names(c);
    all.insert(all.begin(), "");
    for (const std::string& n : all) {
      if (result.count(n)) continue;
      bool under_target = false;
      for (const std::string& t : linear) under_target = under_target || ends_with(n, "." + t);
      if (under_target) continue;
      for (const std::string& s : suffixes(n)) other.insert(s);
    }
    std::vector<std::pair<std::string, std::vector<std::string>>> items;
    for (const std::string& t : result) items.emplace_back(t, suffixes(t));
    std::sort(items.begin(), items.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
    std::set<std::string> required;
    for (const auto& [item, sufs] : items) {
      for (const std::string& s : sufs) {
        if (required.count(s) || other.count(s)) continue;
        bool covered = false;
        for (const std::string& q : required) covered = covered || ends_with(item, "." + q);
        if (!covered) {
          required.insert(s);
          break;
        }
      }
    }
    if (!required.empty() && required.size() < result.size()) result = required;
  }
  out.target_modules.kind = ModuleSelector::Kind::names;
  out.target_modules.names.assign(result.begin(), result.end());
  out.target_modules.text.clear();
  return out;
}

// ---------------------------------------------------------------- resolving against a model

namespace {

std::string linear_modules_listing(const ModelConfig& c) {
  const std::string layers = c.L == 1 ? "0" : "{0.." + std::to_string(c.L - 1) + "}";
  return "the model's linear modules are model.layers." + layers +
         ".self_attn.{q,k,v,o}_proj, model.layers." + layers +
         ".mlp.{gate,up,down}_proj (targets: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
         "\"all-linear\", full names or a regex) and lm_head (not a LoRA target here; train it with "
         "modules_to_save)";
}

// (layer, module) of one of the seven projections' names, else nullopt.
std::optional<std::pair<int64_t, LinearModule>> projection_of(std::string_view name, int64_t L) {
  constexpr std::string_view pre = "model.layers.";
  if (name.substr(0, pre.size()) != pre) return std::nullopt;
  std::string_view rest = name.substr(pre.size());
  const size_t dot = rest.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  int64_t layer = -1;
  const auto [p, ec] = std::from_chars(rest.data(), rest.data() + dot, layer);
  if (ec != std::errc() || p != rest.data() + dot || layer < 0 || layer >= L) return std::nullopt;
  for (LinearModule m : kLinearModules)
    if (rest.substr(dot + 1) == linear_module_path(m)) return std::make_pair(layer, m);
  return std::nullopt;
}

}  // namespace

AdapterLayout resolve_adapter(const AdapterConfig& a, const ModelConfig& c, std::string_view source) {
  AdapterLayout out;
  out.dora = a.use_dora;
  out.tied = c.tied;
  out.V = c.V;
  out.E = c.E;
  const std::vector<std::string> names = hf_module_names(c);
  std::map<std::string, std::pair<int64_t, int64_t>> shapes;  // module -> (out, in), from param_specs
  for (const ParamSpec& p : param_specs(c))
    if (p.shape.size() == 2 && ends_with(p.name, ".weight"))
      shapes[p.name.substr(0, p.name.size() - 7)] = {p.shape[0], p.shape[1]};

  // modules_to_save (other.py _set_trainable: a plain suffix match).
  std::vector<Regex> saved_exclusions;
  if (a.modules_to_save) {
    for (const std::string& m : *a.modules_to_save) {
      saved_exclusions.emplace_back(saved_exclusion_regex(m), "modules_to_save entry", source);
      std::vector<std::string> hit;
      for (const std::string& n : names)
        if (ends_with(n, m)) hit.push_back(n);
      OOM_CHECK(!hit.empty(), "[adapter] ", source, ": modules_to_save entry ", json::quote(m),
                " matches no module of the model (supported: embed_tokens, lm_head)");
      for (const std::string& n : hit) {
        if (n == "model.embed_tokens") out.train_embed_tokens = true;
        else if (n == "lm_head") out.train_lm_head = true;
        else
          fail("[adapter] ", source, ": modules_to_save entry ", json::quote(m), " selects ", n,
               ", which oomless cannot train in full (supported: embed_tokens, lm_head)");
      }
    }
  }
  if (c.tied && (out.train_embed_tokens || out.train_lm_head)) {
    OOM_CHECK(a.ensure_weight_tying, "[adapter] ", source, ": modules_to_save on a model with tied embeddings needs "
              "ensure_weight_tying = true (with false PEFT trains a separate copy of ",
              out.train_embed_tokens ? "embed_tokens" : "lm_head",
              " and leaves the other use frozen, untying the model; oomless keeps them tied)");
    out.train_embed_tokens = out.train_lm_head = true;
  }

  // target_modules / exclude_modules / layers_to_transform (tuners_utils.py check_target_module_exists).
  ModuleSelector target = a.target_modules;
  if (target.kind == ModuleSelector::Kind::none) {
    target.kind = ModuleSelector::Kind::names;  // PEFT's default for llama, mistral, qwen2, qwen3
    target.names = {"q_proj", "v_proj"};
  }
  std::optional<Regex> target_regex, exclude_regex;
  if (target.kind == ModuleSelector::Kind::regex) target_regex.emplace(target.text, "target_modules regex", source);
  if (a.exclude_modules.kind == ModuleSelector::Kind::regex)
    exclude_regex.emplace(a.exclude_modules.text, "exclude_modules regex", source);
  std::vector<Regex> layer_regexes;
  const bool layer_filter = a.layers_to_transform && !a.layers_to_transform->empty();
  if (layer_filter) {
    for (int64_t l : *a.layers_to_transform)
      OOM_CHECK(l < c.L, "[adapter] ", source, ": layers_to_transform lists layer ", l, " but the model has ", c.L,
                " layers (0..", c.L - 1, ")");
    if (!a.layers_pattern || a.layers_pattern->empty()) {
      layer_regexes.emplace_back(layer_index_regex(std::nullopt), "layers_pattern", source);
    } else {
      for (const std::string& p : *a.layers_pattern) layer_regexes.emplace_back(layer_index_regex(p), "layers_pattern", source);
    }
  }
  if (target.kind == ModuleSelector::Kind::names)
    for (const std::string& t : target.names) {
      bool any = false;
      for (const std::string& n : names) any = any || name_matches(n, t);
      OOM_CHECK(any, "[adapter] ", source, ": target_modules entry ", json::quote(t), " matches no module of the model; ",
                linear_modules_listing(c));
    }

  auto excluded = [&](const std::string& n) {
    switch (a.exclude_modules.kind) {
      case ModuleSelector::Kind::none:
      case ModuleSelector::Kind::all_linear: return false;
      case ModuleSelector::Kind::regex: return exclude_regex->match(n, true);
      case ModuleSelector::Kind::names:
        for (const std::string& e : a.exclude_modules.names)
          if (name_matches(n, e)) return true;
        return false;
    }
    return false;
  };
  auto layer_listed = [&](const std::string& n) {
    std::string idx;
    bool found = false;
    for (const Regex& re : layer_regexes)
      if (re.match(n, false, "idx", &idx)) {
        found = true;
        break;
      }
    if (!found || idx.empty()) return false;
    int64_t l = -1;
    const auto [p, ec] = std::from_chars(idx.data(), idx.data() + idx.size(), l);
    if (ec != std::errc() || p != idx.data() + idx.size()) return false;
    return std::find(a.layers_to_transform->begin(), a.layers_to_transform->end(), l) != a.layers_to_transform->end();
  };
  auto targeted = [&](const std::string& n) {
    switch (target.kind) {
      case ModuleSelector::Kind::none: return false;
      case ModuleSelector::Kind::all_linear: return shapes.count(n) > 0 && n != "lm_head" && n != "model.embed_tokens";
      case ModuleSelector::Kind::regex: return target_regex->match(n, true);
      case ModuleSelector::Kind::names: {
        // An entry equal to the name is taken as is; a suffix match then goes through the layer filter.
        if (std::find(target.names.begin(), target.names.end(), n) != target.names.end()) return true;
        bool suffix = false;
        for (const std::string& t : target.names) suffix = suffix || name_matches(n, t);
        return suffix && (!layer_filter || layer_listed(n));
      }
    }
    return false;
  };

  size_t matched = 0;
  for (const std::string& n : names) {
    if (excluded(n)) continue;
    bool saved = false;
    for (const Regex& re : saved_exclusions) saved = saved || re.match(n, false);
    if (saved) continue;
    if (!targeted(n)) continue;
    ++matched;
    const auto proj = projection_of(n, c.L);
    if (!proj) {
      if (n == "lm_head" || n == "model.embed_tokens")
        fail("[adapter] ", source, ": target_modules selects ", n, "; LoRA on ", n == "lm_head" ? "lm_head" : "embed_tokens",
             " is not supported (train it in full with modules_to_save instead); ", linear_modules_listing(c));
      fail("[adapter] ", source, ": target_modules selects ", n, ", which is not a linear layer; ",
           linear_modules_listing(c));
    }
    LoraTarget t;
    t.layer = proj->first;
    t.module = proj->second;
    std::tie(t.out_features, t.in_features) = shapes.at(n);
    out.targets.push_back(t);
  }
  OOM_CHECK(!out.targets.empty(), "[adapter] ", source, ": target_modules ",
            target.kind == ModuleSelector::Kind::names ? "" : json::quote(target.text) + " ",
            matched == 0 && target.kind == ModuleSelector::Kind::regex ? "matches no module of the model"
                                                                      : "leaves no module to adapt",
            " (after exclude_modules, modules_to_save and layers_to_transform); ", linear_modules_listing(c));

  // rank_pattern / alpha_pattern (other.py get_pattern_key: the first key that matches, in order).
  std::vector<Regex> rank_re, alpha_re;
  for (const auto& [k, v] : a.rank_pattern) rank_re.emplace_back(pattern_key_regex(k), "rank_pattern key", source);
  for (const auto& [k, v] : a.alpha_pattern) alpha_re.emplace_back(pattern_key_regex(k), "alpha_pattern key", source);
  std::vector<bool> rank_used(rank_re.size()), alpha_used(alpha_re.size());
  for (LoraTarget& t : out.targets) {
    const std::string n = t.name();
    t.r = a.r;
    t.alpha = a.lora_alpha;
    for (size_t i = 0; i < rank_re.size(); ++i)
      if (rank_re[i].match(n, false)) {
        t.r = a.rank_pattern[i].second, rank_used[i] = true;
        break;
      }
    for (size_t i = 0; i < alpha_re.size(); ++i)
      if (alpha_re[i].match(n, false)) {
        t.alpha = a.alpha_pattern[i].second, alpha_used[i] = true;
        break;
      }
    OOM_CHECK(t.r > 0, "[adapter] ", source, ": r = ", t.r, " for ", n, " must be positive");
    OOM_CHECK(t.r <= std::min(t.in_features, t.out_features), "[adapter] ", source, ": r = ", t.r, " for ", n,
              " exceeds min(in_features ", t.in_features, ", out_features ", t.out_features, ") = ",
              std::min(t.in_features, t.out_features), "; lower r (or set a smaller one with rank_pattern)");
    t.scale = a.scale(t.r, t.alpha);
  }
  for (size_t i = 0; i < rank_re.size(); ++i)
    if (!rank_used[i])
      out.warnings.push_back(std::string(source) + ": rank_pattern key " + json::quote(a.rank_pattern[i].first) +
                             " matches no adapted module");
  for (size_t i = 0; i < alpha_re.size(); ++i)
    if (!alpha_used[i])
      out.warnings.push_back(std::string(source) + ": alpha_pattern key " + json::quote(a.alpha_pattern[i].first) +
                             " matches no adapted module");
  return out;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> AdapterLayout::tensors() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t;
  for (const LoraTarget& x : targets) {
    t.emplace_back(adapter_key(x.layer, x.module, LoraPart::lora_A), std::vector<int64_t>{x.r, x.in_features});
    t.emplace_back(adapter_key(x.layer, x.module, LoraPart::lora_B), std::vector<int64_t>{x.out_features, x.r});
    if (dora) t.emplace_back(adapter_key(x.layer, x.module, LoraPart::magnitude), std::vector<int64_t>{x.out_features});
  }
  if (train_embed_tokens) t.emplace_back(adapter_key(SavedModule::embed_tokens), std::vector<int64_t>{V, E});
  if (train_lm_head) t.emplace_back(adapter_key(SavedModule::lm_head), std::vector<int64_t>{V, E});
  std::sort(t.begin(), t.end());
  return t;
}

// ---------------------------------------------------------------- tensor keys

std::string adapter_key(int64_t layer, LinearModule m, LoraPart p) {
  const char* part = p == LoraPart::lora_A ? ".lora_A.weight" : p == LoraPart::lora_B ? ".lora_B.weight"
                                                                                     : ".lora_magnitude_vector";
  return kKeyPrefix + linear_module_full_name(layer, m) + part;
}

std::string adapter_key(SavedModule m) { return std::string(kKeyPrefix) + saved_module_full_name(m) + ".weight"; }

std::string adapter_key(const AdapterKey& k) {
  return k.kind == AdapterKey::Kind::saved ? adapter_key(k.saved) : adapter_key(k.layer, k.module, k.part);
}

AdapterKey parse_adapter_key(std::string_view key, std::string_view source) {
  const std::string where = source.empty() ? std::string() : std::string(source) + ": ";
  auto bad = [&](std::string_view why) -> AdapterKey {
    fail("[adapter] ", where, "tensor ", json::quote(key), " ", why);
  };
  constexpr std::string_view generic =
      "is not a key of a PEFT LoRA adapter that oomless reads (expected base_model.model.model.layers.N."
      "{self_attn.{q,k,v,o}_proj,mlp.{gate,up,down}_proj}.{lora_A.weight,lora_B.weight,lora_magnitude_vector}, "
      "base_model.model.model.embed_tokens.weight or base_model.model.lm_head.weight)";
  if (key.find(".lora_embedding_A") != std::string_view::npos || key.find(".lora_embedding_B") != std::string_view::npos)
    return bad("is a LoRA on an embedding (lora_embedding_A/B), which oomless does not support");
  if (ends_with(key, ".lora_B.bias")) return bad("is a bias on lora_B (lora_bias = true), which oomless does not support");
  if (ends_with(key, ".bias"))
    return bad("is a trained bias (bias = \"all\" or \"lora_only\"), which oomless does not support");
  if (key.find(".default.") != std::string_view::npos || ends_with(key, ".default"))
    return bad("holds PEFT's adapter name \"default\": a PeftModel.state_dict() key, not one save_pretrained writes");
  if (key.substr(0, std::string_view(kKeyPrefix).size()) != kKeyPrefix) return bad(generic);
  const std::string_view rest = key.substr(std::string_view(kKeyPrefix).size());
  AdapterKey k;
  if (rest == "model.embed_tokens.weight" || rest == "lm_head.weight") {
    k.kind = AdapterKey::Kind::saved;
    k.saved = rest == "lm_head.weight" ? SavedModule::lm_head : SavedModule::embed_tokens;
    return k;
  }
  constexpr std::string_view layers = "model.layers.";
  if (rest.substr(0, layers.size()) != layers) return bad(generic);
  std::string_view tail = rest.substr(layers.size());
  const size_t dot = tail.find('.');
  const std::string_view digits = tail.substr(0, dot);
  // transformers' ModuleList names: decimal, no sign, no leading zeros.
  if (dot == std::string_view::npos || digits.empty() || digits.size() > 9 || (digits.size() > 1 && digits[0] == '0') ||
      !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
    return bad(generic);
  std::from_chars(digits.data(), digits.data() + digits.size(), k.layer);
  tail = tail.substr(dot + 1);
  for (LinearModule m : kLinearModules) {
    const std::string_view path = linear_module_path(m);
    if (tail.substr(0, path.size()) != path || tail.size() <= path.size() || tail[path.size()] != '.') continue;
    const std::string_view part = tail.substr(path.size() + 1);
    k.module = m;
    if (part == "lora_A.weight") k.part = LoraPart::lora_A;
    else if (part == "lora_B.weight") k.part = LoraPart::lora_B;
    else if (part == "lora_magnitude_vector") k.part = LoraPart::magnitude;
    else if (part == "lora_magnitude_vector.weight")
      return bad("ends in lora_magnitude_vector.weight; PEFT writes DoRA magnitudes as ...lora_magnitude_vector");
    else return bad(generic);
    return k;
  }
  return bad(generic);
}

void check_adapter_tensors(const AdapterLayout& layout, const SafetensorsFile& f) {
  const auto expected = layout.tensors();
  std::map<std::string, const std::vector<int64_t>*> want;
  for (const auto& [k, s] : expected) want[k] = &s;
  std::set<std::string> seen;
  for (const StTensor& t : f.tensors()) {
    const auto it = want.find(t.name);
    if (it == want.end()) {
      const AdapterKey k = parse_adapter_key(t.name, f.path());  // a precise error for foreign keys
      fail("[adapter] ", f.path(), ": tensor ", json::quote(t.name), " is not part of this adapter (its config ",
           k.kind == AdapterKey::Kind::saved ? "does not list the module in modules_to_save"
           : k.part == LoraPart::magnitude   ? "does not set use_dora, or does not adapt that module"
                                             : "does not adapt that module",
           ")");
    }
    OOM_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16 || t.dtype == DType::f16,
              "[adapter] ", f.path(), ": tensor ", json::quote(t.name), " has dtype ", t.dtype_name,
              "; supported: F32, F64, BF16, F16");
    auto shape_str = [](const std::vector<int64_t>& s) {
      std::string o = "[";
      for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
      return o + "]";
    };
    OOM_CHECK(t.shape == *it->second, "[adapter] ", f.path(), ": tensor ", json::quote(t.name), " has shape ",
              shape_str(t.shape), ", expected ", shape_str(*it->second), " for this config and model");
    seen.insert(t.name);
  }
  for (const auto& [k, s] : expected)
    OOM_CHECK(seen.count(k), "[adapter] ", f.path(), ": tensor ", json::quote(k), " is missing (the config and the model ",
              "call for ", expected.size(), " tensors, the file has ", f.tensors().size(), ")");
}

}  // namespace oomless
