// PEFT's LoRA adapter format, as peft 0.21.2 reads and writes it: adapter_config.json, the tensor keys of
// adapter_model.safetensors, and which modules of a model an adapter adapts.
//
// An adapter folder (PeftModel.save_pretrained) holds
//   adapter_config.json        a LoraConfig: json.dumps(asdict(config), indent=2, sort_keys=True), every field
//   adapter_model.safetensors  the trainable tensors in the training dtype (float32), metadata {"format": "pt"}:
//     base_model.model.<module>.lora_A.weight         (r, in)
//     base_model.model.<module>.lora_B.weight         (out, r)
//     base_model.model.<module>.lora_magnitude_vector (out)    DoRA; no ".weight" suffix
//     base_model.model.model.embed_tokens.weight      (V, E)   modules_to_save: a trained full copy
//     base_model.model.lm_head.weight                 (V, E)
//   where <module> is the transformers module name, e.g. model.layers.0.self_attn.q_proj (its parameter is
//   <module>.weight in param_specs()).
//
// For an adapted projection y = W x + b, W (out, in), with s = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)):
//   LoRA: y = W x + b + s B (A x)
//   DoRA: y = b + m / n (W x + s B (A x)),  n = ||W + s B A|| per output row, held constant (no gradient)
//         m = lora_magnitude_vector
//
// Which modules are adapted follows PEFT's matching on module names N (model.layers.L.self_attn.q_proj, ...):
//   target_modules  a list: N == t or N ends with "." + t for some entry t. "all-linear" (any case): every
//                   linear layer but lm_head (PEFT saves the expansion: the full names below 20 modules, the
//                   shortest distinguishing suffixes from 20 on). Any other string: a regex, full-matched
//                   against N. null: PEFT's default for these architectures, q_proj and v_proj.
//   exclude_modules the same forms (no all-linear); an excluded module is never adapted.
//   layers_to_transform / layers_pattern: with a list target, a suffix match is kept only when N's layer
//                   index (its first numbered segment, or the one after layers_pattern) is listed; an entry
//                   equal to N itself bypasses the filter (PEFT's order of checks).
//   rank_pattern / alpha_pattern: the first key k (in file order) with re.match("(.*\.)?(k)$", N) gives N's
//                   r / lora_alpha.
//   modules_to_save entries select the modules whose name ends with the entry (no dot needed); those are
//                   trained in full and never adapted. On a tied model PEFT unties them unless
//                   ensure_weight_tying is true, when both keys are saved with the same matrix.
// Regexes are PCRE2, which reads the Python re syntax these fields use (alternation, classes, groups,
// quantifiers, anchors) the same way on module names.
//
// Parsing accepts every field PEFT 0.21.2 writes. Fields that change nothing oomless computes are recorded
// or ignored (revision, inference_mode, peft_version, auto_mapping, megatron_core, qalora_group_size, and
// the eva/corda/lora_ga/loftq configs PEFT itself ignores when init_lora_weights does not name them, each
// then noted in `warnings`). A field whose value oomless cannot honour is an oomless::Error naming the file,
// the field, the value and what is supported. Unknown fields (a newer PEFT's): a null, false, 0, "" or
// empty value is taken as "feature off" and noted in `warnings` (PEFT too ignores unknown fields, with a
// warning); any other value is an error, since training without a feature the file asks for would
// silently give a different adapter.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/json.h"
#include "model/config.h"

namespace oomless {

class SafetensorsFile;

// The projections of one decoder layer that LoRA adapts, in param_specs order.
enum class LinearModule : uint8_t { q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj };
inline constexpr LinearModule kLinearModules[] = {LinearModule::q_proj,    LinearModule::k_proj,
                                                  LinearModule::v_proj,    LinearModule::o_proj,
                                                  LinearModule::gate_proj, LinearModule::up_proj,
                                                  LinearModule::down_proj};
const char* linear_module_name(LinearModule m);  // "q_proj"
const char* linear_module_path(LinearModule m);  // "self_attn.q_proj", "mlp.gate_proj"
std::optional<LinearModule> linear_module_from_name(std::string_view name);  // "q_proj" -> q_proj
// "model.layers.3.self_attn.q_proj": the transformers module name; its parameter is NAME + ".weight".
std::string linear_module_full_name(int64_t layer, LinearModule m);

// Modules modules_to_save may train in full.
enum class SavedModule : uint8_t { embed_tokens, lm_head };
const char* saved_module_full_name(SavedModule m);  // "model.embed_tokens", "lm_head"

enum class LoraPart : uint8_t { lora_A, lora_B, magnitude };

// init_lora_weights: how a new adapter starts (no effect on a loaded one). kaiming (true): A as nn.Linear's
// default (kaiming-uniform, a = sqrt(5)), B = 0; random (false): A and B both so (not a no-op at start);
// gaussian ("gaussian"): A ~ N(0, 1/r^2), B = 0.
enum class LoraInit : uint8_t { kaiming, random, gaussian };

// A target_modules or exclude_modules value.
struct ModuleSelector {
  enum class Kind : uint8_t { none, names, all_linear, regex };
  Kind kind = Kind::none;
  std::vector<std::string> names;  // names: in file order
  std::string text;                // all_linear: as written ("all-linear"); regex: the pattern
  friend bool operator==(const ModuleSelector&, const ModuleSelector&) = default;
};

struct AdapterConfig {
  int64_t r = 8;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;  // 0 <= p < 1; on the input of A, training only
  ModuleSelector target_modules;
  ModuleSelector exclude_modules;
  std::optional<std::vector<int64_t>> layers_to_transform;  // an int in the file reads as a one-element list
  std::optional<std::vector<std::string>> layers_pattern;   // a string reads as a one-element list
  std::vector<std::pair<std::string, int64_t>> rank_pattern;  // regex key -> r, file order
  std::vector<std::pair<std::string, double>> alpha_pattern;  // regex key -> lora_alpha
  bool use_rslora = false;
  bool use_dora = false;
  std::optional<std::vector<std::string>> modules_to_save;
  bool ensure_weight_tying = false;
  LoraInit init = LoraInit::kaiming;
  std::optional<std::string> base_model_name_or_path;
  std::optional<std::string> revision;
  std::string peft_version = "0.21.2";  // of the writer; to_json writes 0.21.2, the format written
  std::vector<std::string> warnings;    // from_json: fields accepted but ignored (not written back)

  // The adapter's output scale for rank r: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
  double scale(int64_t rank) const { return scale(rank, lora_alpha); }
  double scale(int64_t rank, double alpha) const;

  // `source` names the file in errors ("[adapter] SOURCE: field = value ...").
  static AdapterConfig from_json(const json::Value& v, std::string_view source);
  // path: an adapter folder or its adapter_config.json.
  static AdapterConfig from_file(const std::string& path);

  // Every field PEFT 0.21.2 writes, keys sorted as it sorts them; fields oomless does not implement take
  // PEFT's defaults. A list-form layers_to_transform / layers_pattern is written as a list.
  json::Value to_json() const;
  // adapter_config.json's text, byte for byte what PEFT writes for the same settings (2-space indent,
  // sorted keys, no final newline; non-ASCII stays UTF-8 where Python would escape it).
  std::string to_text() const;

  // This config with an all-linear target replaced by the names PEFT writes for model c (sorted: PEFT's
  // order comes from a Python set). Unchanged for other targets.
  AdapterConfig with_all_linear_expanded(const ModelConfig& c) const;
};

// One adapted projection: W (out_features, in_features), A (r, in_features), B (out_features, r).
struct LoraTarget {
  int64_t layer = 0;
  LinearModule module = LinearModule::q_proj;
  int64_t out_features = 0, in_features = 0;
  int64_t r = 0;
  double alpha = 0, scale = 0;
  std::string name() const { return linear_module_full_name(layer, module); }
};

// What an adapter config means for one model.
struct AdapterLayout {
  std::vector<LoraTarget> targets;  // layer by layer, q, k, v, o, gate, up, down within a layer
  bool dora = false;
  bool train_embed_tokens = false;  // modules_to_save; on a tied model both are set and share one matrix
  bool train_lm_head = false;
  bool tied = false;
  int64_t V = 0, E = 0;
  std::vector<std::string> warnings;  // rank_pattern / alpha_pattern keys that matched no adapted module

  // Every tensor adapter_model.safetensors holds for this layout, as (key, shape), sorted by key.
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors() const;
};

// Resolves `a` against model c. Errors (naming `source`): a target entry or regex that matches no module
// of the model (listing the model's linear modules), one that selects a module other than the seven
// projections (norms, attention blocks, lm_head or embed_tokens as a LoRA target), nothing adapted at all,
// r <= 0 or r > min(in, out) (naming the module), a layers_to_transform index outside the model, a
// modules_to_save entry selecting nothing or anything but embed_tokens / lm_head, and modules_to_save on a
// tied model without ensure_weight_tying (PEFT would train a separate copy and untie the model).
AdapterLayout resolve_adapter(const AdapterConfig& a, const ModelConfig& c, std::string_view source);

// transformers' named_modules() of the model c describes (without the root ""), in its order.
std::vector<std::string> hf_module_names(const ModelConfig& c);

// A key of adapter_model.safetensors.
struct AdapterKey {
  enum class Kind : uint8_t { lora, saved };
  Kind kind = Kind::lora;
  int64_t layer = 0;                              // lora
  LinearModule module = LinearModule::q_proj;     // lora
  LoraPart part = LoraPart::lora_A;               // lora
  SavedModule saved = SavedModule::embed_tokens;  // saved
  friend bool operator==(const AdapterKey&, const AdapterKey&) = default;
};
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "...lora_magnitude_vector".
std::string adapter_key(int64_t layer, LinearModule m, LoraPart p);
// "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight".
std::string adapter_key(SavedModule m);
std::string adapter_key(const AdapterKey& k);
// The inverse; anything else is an error naming the key (and `source`) and, for the keys PEFT writes for
// features oomless does not implement (lora_B.bias, lora_embedding_A/B, base_layer.bias), the feature.
AdapterKey parse_adapter_key(std::string_view key, std::string_view source = {});

// Checks an adapter_model.safetensors against a layout: every expected tensor present with its shape and a
// float dtype (F32, F64, BF16, F16), nothing else. Errors name the file and the key.
void check_adapter_tensors(const AdapterLayout& layout, const SafetensorsFile& f);

}  // namespace oomless
