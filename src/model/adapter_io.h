// Adapter folders on disk, in PEFT's format: adapter_config.json (peft_type LORA) and
// adapter_model.safetensors with PEFT's key names (model/lora.h). Written by `oomless train --lora` at
// every checkpoint, read by --adapter (train, eval, generate, merge).
#pragma once
#include <string>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/lora.h"

namespace oomless {

inline constexpr const char* kAdapterConfig = "adapter_config.json";
inline constexpr const char* kAdapterWeights = "adapter_model.safetensors";

// adapter_config.json's text as PEFT writes it for these settings (io/peft.h); base_model: --model as given.
std::string adapter_config_text(const LoraSettings& s, const std::string& base_model, bool tied);
// The settings of an adapter folder (ours or PEFT's), resolved against the model with PEFT's matching
// rules; anything oomless cannot honour is an error naming the file and the field.
LoraSettings read_adapter_settings(const std::string& dir, const ModelConfig& cfg);
// The tensors of adapter_model.safetensors: the adapter's, then the modules trained beside it from `base`
// (on a tied model both keys, the one matrix, as PEFT's ensure_weight_tying writes them).
std::vector<NamedTensor> adapter_tensors(const AdapterSet& a, const ParamSet& base, const ModelConfig& cfg);
// Reads DIR/adapter_model.safetensors into `a` (f32, bf16 or f16 tensors converted to a's dtype). DIR's
// settings must be a's (rank, targets, alpha, rsLoRA); a tensor missing, of another shape, or not part
// of a's layout is an error naming it.
// A modules_to_save tensor (embed_tokens, lm_head) goes into `base`.
void load_adapter(Ops& ops, const std::string& dir, const ModelConfig& cfg, AdapterSet& a, ParamSet& base);

}  // namespace oomless
