// ModelConfig: the one decoder's switches, read from a Hugging Face config.json the way transformers
// reads it for LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM (SmolLM and
// TinyLlama are Llama). Missing keys take that architecture's transformers defaults; unknown keys are
// ignored; values the decoder does not implement are an error that says what is supported.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/ops.h"
#include "io/json.h"

namespace oomless {

enum class Arch { llama, qwen2, qwen3, mistral };
const char* arch_name(Arch a);            // "llama", ...
const char* arch_hf_class(Arch a);        // "LlamaForCausalLM", ...

struct ModelConfig {
  static constexpr int64_t kMaxLayers = 4096;  // validate() refuses deeper configs
  Arch arch = Arch::llama;
  int64_t L = 0;       // layers
  int64_t E = 0;       // hidden size
  int64_t F = 0;       // MLP width
  int64_t H = 0;       // query heads
  int64_t Hkv = 0;     // key/value heads
  int64_t D = 0;       // head dim (Qwen3: explicit, may differ from E / H)
  int64_t V = 0;       // vocabulary
  double rms_eps = 1e-6;
  RopeConfig rope;
  bool tied = false;       // lm_head shares model.embed_tokens.weight
  bool qkv_bias = false;   // Qwen2 always; Llama/Qwen3 with attention_bias
  bool o_bias = false;     // Llama/Qwen3 with attention_bias
  bool qk_norm = false;    // Qwen3: RMSNorm over D on each query and key head
  int64_t max_position = 2048;
  int64_t sliding_window = 0;  // 0: none; otherwise sequences longer than it are refused
  std::optional<int32_t> bos_id, eos_id;

  int64_t q_dim() const { return H * D; }
  int64_t kv_dim() const { return Hkv * D; }
  int64_t param_count() const;
  // Throws when a dimension is non-positive or inconsistent (H % Hkv, odd D).
  void validate(std::string_view source) const;
  // Refuses sequences the model cannot attend over as transformers would (sliding window).
  void check_sequence(int64_t T) const;

  static ModelConfig from_json(const json::Value& cfg, std::string_view source);
  static ModelConfig from_file(const std::string& path);
  // config.json as transformers writes it for this architecture (loadable by from_pretrained).
  json::Value to_json() const;
};

// Overrides c's rotary scaling (--rope-scaling) for training or evaluating past the model's native
// context: "none"; "TYPE:FACTOR" with TYPE linear, llama3 or yarn (the original context is the model's
// max_position_embeddings, which becomes FACTOR times longer); or a JSON object in config.json's rope_scaling
// form. The result is what to_json() writes. Throws naming the accepted forms.
void apply_rope_scaling(ModelConfig& c, std::string_view spec, std::string_view source);

// Random-init presets: "micro", "tiny", "smollm2-135m". Throws naming the known presets.
ModelConfig preset_config(std::string_view name);
std::vector<std::string> preset_names();

// One parameter: its Hugging Face name and shape, in the order the model lays them out.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool decay = true;  // false for norms and biases (no weight decay)
};
std::vector<ParamSpec> param_specs(const ModelConfig& c);
// Elements of a parameter of this shape.
int64_t numel_of(const std::vector<int64_t>& shape);
// The layer of a model.layers.N.* name (rest: what follows N, from its '.'), or -1.
int64_t layer_of_name(std::string_view name, std::string* rest = nullptr);

}  // namespace oomless
