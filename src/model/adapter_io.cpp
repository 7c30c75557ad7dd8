#include "model/adapter_io.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "io/safetensors.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

}  // namespace

json::Value adapter_config_json(const LoraSettings& s, const std::string& base_model) {
  using json::Value;
  Value o = Value::object();
  Value targets = Value::array();
  for (Proj p : s.targets) {
    const std::string m = proj_module(p);
    targets.push_back(Value::string(m.substr(m.find('.') + 1)));
  }
  o.set("base_model_name_or_path", Value::string(base_model));
  o.set("bias", Value::string("none"));
  o.set("fan_in_fan_out", Value::boolean(false));
  o.set("inference_mode", Value::boolean(true));
  o.set("init_lora_weights", Value::boolean(true));
  o.set("lora_alpha", Value::number(s.alpha));
  o.set("lora_dropout", Value::number(s.dropout));
  o.set("modules_to_save", Value());
  o.set("peft_type", Value::string("LORA"));
  o.set("r", Value::integer(s.r));
  o.set("target_modules", std::move(targets));
  o.set("task_type", Value::string("CAUSAL_LM"));
  o.set("use_dora", Value::boolean(s.dora));
  o.set("use_rslora", Value::boolean(s.rslora));
  return o;
}

LoraSettings read_adapter_settings(const std::string& dir) {
  const std::string path = dir + "/" + kAdapterConfig;
  OOM_CHECK(fs::exists(path), "[adapter] ", dir, " holds no ", kAdapterConfig, ": an adapter folder is what PEFT's "
            "save_pretrained or oomless train --lora writes");
  const json::Value c = json::parse_file(path);
  OOM_CHECK(c.is_object(), "[adapter] ", path, ": not a JSON object");
  auto field = [&](const char* k) { return c.find(k); };
  const json::Value* type = field("peft_type");
  OOM_CHECK(type && type->is_string() && type->as_string() == "LORA", "[adapter] ", path,
            ": peft_type must be \"LORA\" (the only adapter type supported)");
  LoraSettings s;
  OOM_CHECK(field("r") && field("r")->is_number(), "[adapter] ", path, ": \"r\" (the rank) is missing");
  s.r = field("r")->as_int("r");
  s.alpha = field("lora_alpha") ? field("lora_alpha")->as_number("lora_alpha") : 8.0;
  s.dropout = field("lora_dropout") ? field("lora_dropout")->as_number("lora_dropout") : 0.0;
  s.rslora = field("use_rslora") && field("use_rslora")->as_bool("use_rslora");
  s.dora = field("use_dora") && field("use_dora")->as_bool("use_dora");
  const json::Value* t = field("target_modules");
  OOM_CHECK(t, "[adapter] ", path, ": target_modules is missing");
  std::string list;
  if (t->is_string()) {
    list = t->as_string();
  } else {
    for (const json::Value& x : t->as_array()) list += (list.empty() ? "" : ",") + x.as_string("target_modules");
  }
  s.targets = parse_lora_targets(list);
  return s;
}

void load_adapter(const std::string& dir, const ModelConfig& cfg, AdapterSet& a) {
  const LoraSettings want = read_adapter_settings(dir), have = a.settings();
  OOM_CHECK(want.r == have.r && want.targets == have.targets && want.alpha == have.alpha &&
                want.rslora == have.rslora && want.dora == have.dora,
            "[adapter] ", dir, ": its settings (r ", want.r, ", lora_alpha ", want.alpha, ", ", want.targets.size(),
            " target projections) differ from this run's (r ", have.r, ", alpha ", have.alpha, ", ",
            have.targets.size(), ")");
  const std::string path = dir + "/" + kAdapterWeights;
  SafetensorsFile f = SafetensorsFile::open(path);
  const ParamSet& set = a.tensors();
  for (const StTensor& t : f.tensors())
    OOM_CHECK(set.find(t.name), "[adapter] ", path, ": tensor '", t.name, "' is not part of a rank-", have.r,
              " LoRA of this model (", cfg.L, " layers) on the configured targets");
  for (size_t i = 0; i < set.specs().size(); ++i) {
    const ParamSpec& s = set.specs()[i];
    const StTensor* t = f.find(s.name);
    OOM_CHECK(t, "[adapter] ", path, ": tensor '", s.name, "' is missing");
    OOM_CHECK(t->shape == s.shape, "[adapter] ", path, ": tensor '", s.name, "' has shape ", shape_str(t->shape),
              ", this model needs ", shape_str(s.shape), " (another base model?)");
    OOM_CHECK(t->dtype == DType::f32 || t->dtype == DType::bf16 || t->dtype == DType::f16, "[adapter] ", path,
              ": tensor '", s.name, "' is ", t->dtype_name, "; supported: F32, BF16, F16");
    // Through an aligned copy: another writer's data may be unaligned.
    const Tensor& d = set.tensors()[i];
    std::vector<char> tmp(t->nbytes);
    std::memcpy(tmp.data(), t->data, t->nbytes);
    convert(d.data, d.dtype, tmp.data(), *t->dtype, d.numel());
  }
}

}  // namespace oomless
