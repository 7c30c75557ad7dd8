#include "model/adapter_io.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "io/peft.h"
#include "io/safetensors.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {

// lora.h's projections and peft.h's modules are the same seven, in the same order.
static_assert(static_cast<int>(LinearModule::q_proj) == static_cast<int>(Proj::q) &&
              static_cast<int>(LinearModule::o_proj) == static_cast<int>(Proj::o) &&
              static_cast<int>(LinearModule::down_proj) == static_cast<int>(Proj::down));

struct Resolved {
  LoraSettings settings;
  AdapterLayout layout;
};

// A folder's adapter_config.json, resolved against the model, as the uniform LoRA oomless trains: the
// same projections with the same rank and alpha in every layer.
Resolved resolve_dir(const std::string& dir, const ModelConfig& cfg) {
  const std::string path = (fs::path(dir) / kAdapterConfig).string();
  OOM_CHECK(fs::exists(path), "[adapter] ", dir, " holds no ", kAdapterConfig, ": an adapter folder is what PEFT's "
            "save_pretrained or oomless train --lora writes");
  const AdapterConfig a = AdapterConfig::from_file(path);
  for (const std::string& w : a.warnings) std::fprintf(stderr, "oomless: warning: %s: %s\n", path.c_str(), w.c_str());
  Resolved r;
  r.layout = resolve_adapter(a, cfg, path);
  const AdapterLayout& L = r.layout;
  LoraSettings& s = r.settings;
  s.train_embed = L.train_embed_tokens;
  s.train_head = L.train_lm_head;
  s.r = L.targets.front().r;
  s.alpha = L.targets.front().alpha;
  s.dropout = a.lora_dropout;
  s.rslora = a.use_rslora;
  s.dora = L.dora;
  for (const LoraTarget& t : L.targets)
    if (t.layer == 0) s.targets.push_back(static_cast<Proj>(static_cast<int>(t.module)));
  const size_t per_layer = s.targets.size();
  bool uniform = L.targets.size() == per_layer * static_cast<size_t>(cfg.L);
  for (size_t i = 0; uniform && i < L.targets.size(); ++i) {
    const LoraTarget& t = L.targets[i];
    uniform = t.layer == static_cast<int64_t>(i / per_layer) && t.r == s.r && t.alpha == s.alpha &&
              static_cast<int>(t.module) == static_cast<int>(s.targets[i % per_layer]);
  }
  OOM_CHECK(uniform, "[adapter] ", path, ": its projections, ranks or alphas differ between layers (rank_pattern, "
            "alpha_pattern, layers_to_transform or per-layer target names); supported: the same projections with one "
            "r and lora_alpha in every layer");
  return r;
}

}  // namespace

std::string adapter_config_text(const LoraSettings& s, const std::string& base_model, bool tied) {
  AdapterConfig a;
  a.r = s.r;
  a.lora_alpha = s.alpha;
  a.lora_dropout = s.dropout;
  a.use_rslora = s.rslora;
  a.use_dora = s.dora;
  a.target_modules.kind = ModuleSelector::Kind::names;
  for (Proj p : s.targets) a.target_modules.names.push_back(linear_module_name(static_cast<LinearModule>(p)));
  a.base_model_name_or_path = base_model;
  if (s.train_embed || s.train_head) {
    a.modules_to_save = std::vector<std::string>();
    if (s.train_embed) a.modules_to_save->push_back("embed_tokens");
    if (s.train_head) a.modules_to_save->push_back("lm_head");
    a.ensure_weight_tying = tied;
  }
  return a.to_text();
}

LoraSettings read_adapter_settings(const std::string& dir, const ModelConfig& cfg) { return resolve_dir(dir, cfg).settings; }

std::vector<NamedTensor> adapter_tensors(const AdapterSet& a, const ParamSet& base, const ModelConfig& cfg) {
  std::vector<NamedTensor> w = a.tensors().named();
  const LoraSettings& s = a.settings();
  const bool embed = s.train_embed || (cfg.tied && s.train_head), head = s.train_head || (cfg.tied && s.train_embed);
  if (embed) w.push_back({adapter_key(SavedModule::embed_tokens), base.embed});
  if (head) w.push_back({adapter_key(SavedModule::lm_head), base.lm_head});
  return w;
}

void load_adapter(Ops& ops, const std::string& dir, const ModelConfig& cfg, AdapterSet& a, ParamSet& base) {
  const Resolved r = resolve_dir(dir, cfg);
  const LoraSettings& want = r.settings;
  const LoraSettings& have = a.settings();
  OOM_CHECK(want.r == have.r && want.targets == have.targets && want.alpha == have.alpha &&
                want.rslora == have.rslora && want.dora == have.dora && want.train_embed == have.train_embed &&
                want.train_head == have.train_head,
            "[adapter] ", dir, ": its settings (r ", want.r, ", lora_alpha ", want.alpha, ", ", want.targets.size(),
            " projections per layer", want.rslora ? ", rsLoRA" : "", want.dora ? ", DoRA" : "", ") differ from this run's (r ",
            have.r, ", lora_alpha ", have.alpha, ", ", have.targets.size(), have.rslora ? ", rsLoRA" : "",
            have.dora ? ", DoRA" : "", ")");
  const std::string path = (fs::path(dir) / kAdapterWeights).string();
  SafetensorsFile f = SafetensorsFile::open(path);
  check_adapter_tensors(r.layout, f);  // every tensor present, shapes, float dtypes, nothing else
  auto read = [&](const std::string& key, const Tensor& d) {
    const StTensor* t = f.find(key);
    OOM_CHECK(t && t->dtype && t->numel() == d.numel() && d.data, "[adapter] ", path, ": tensor '", key,
              "' is missing or has another shape");
    // Through an aligned copy (another writer's data may be unaligned), converted on the host, then uploaded.
    std::vector<char> tmp(t->nbytes), host(static_cast<size_t>(d.nbytes()));
    std::memcpy(tmp.data(), t->data, t->nbytes);
    convert(host.data(), d.dtype, tmp.data(), *t->dtype, d.numel());
    ops.upload(d, host.data());
  };
  const ParamSet& set = a.tensors();
  for (size_t i = 0; i < set.specs().size(); ++i) read(set.specs()[i].name, set.tensors()[i]);
  // modules_to_save: the trained matrices replace the base's (a tied pair is one matrix: its embed key).
  if (r.layout.train_embed_tokens) read(adapter_key(SavedModule::embed_tokens), base.embed);
  if (r.layout.train_lm_head && !cfg.tied) read(adapter_key(SavedModule::lm_head), base.lm_head);
}

}  // namespace oomless
