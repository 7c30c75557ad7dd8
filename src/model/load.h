// Opening a model given as `--model`: a Hugging Face folder (config.json, *.safetensors or a sharded
// index, tokenizer.json), a .gguf file, or `preset:NAME` (random init; micro and tiny carry the bundled
// KJV tokenizer, smollm2-135m SmolLM2's own vocabulary). Everything is validated when opened; weights are read when load_weights is called.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "io/gguf_model.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/params.h"
#include "tokenizer/tokenizer.h"

namespace oomless {

class Ops;

struct ModelSource {
  std::string spec;                  // as given
  std::string kind;                  // "preset", "hf", "gguf" or "config" (a config.json alone: random init)
  ModelConfig cfg;
  std::optional<Tokenizer> tokenizer;
  std::string tokenizer_json;        // its tokenizer.json text, for checkpoints (empty if none)
  json::Value tokenizer_config;      // tokenizer_config.json (or its GGUF equivalent); null if none
  json::Value generation_config;     // generation_config.json of a Hugging Face folder; null if none
  // Fills every parameter (any float dtype), checking names and shapes against the config.
  std::function<void(Ops&, ParamSet&)> load_weights;
  // One parameter as f32 (out: its numel floats), for loaders that convert tensor by tensor (an NF4 base
  // quantised at load); empty for presets, whose random init is drawn over the whole set in order.
  std::function<void(const ParamSpec&, float*)> read_f32;
  std::shared_ptr<void> keep_open;   // the mapped files load_weights reads from
  // A GGUF's tensors (HF names) into its mapping, for a base kept in its blocks (model/quant_base.h);
  // null for other sources. Valid while keep_open is.
  std::shared_ptr<const std::vector<GgufHfTensor>> gguf_tensors;
  // A Hugging Face folder saved with bitsandbytes 4-bit weights (quantization_config load_in_4bit): its
  // files, for the NF4 base (model/quant_base.h); null otherwise.
  std::shared_ptr<const SafetensorsSet> bnb4;

  const Tokenizer& require_tokenizer() const;  // error naming the model when it has none
  // Unmaps the weight files once load_weights has run: their pages would otherwise stay in the process's
  // resident set (as much again as the weights) for as long as the source is kept.
  void release_weights() {
    load_weights = nullptr;
    read_f32 = nullptr;
    gguf_tensors.reset();
    bnb4.reset();
    keep_open.reset();
  }
};

// seed: random init of presets.
ModelSource open_model(const std::string& spec, uint64_t seed = 0);

// The bundled byte-level BPE tokenizer (V = 8192) trained on the KJV corpus in data/, embedded in the
// binary.
const Tokenizer& bundled_tokenizer();
json::Value bundled_tokenizer_config();
// The bundled corpus (data/kjv/train.txt and eval.txt), embedded in the binary.
std::string_view bundled_train_text();
std::string_view bundled_eval_text();

// generation_config.json for a folder written from `src`: the source's own (its sampling defaults kept),
// else what transformers derives from the config (bos/eos token ids).
json::Value generation_config(const ModelSource& src);

// Writes a model folder transformers loads as it is: config.json + model.safetensors (F32, HF names;
// tied models store only the embedding) + generation_config.json + src's tokenizer.json and
// tokenizer_config.json when it has them.
// dir must not exist or be empty; files are written under dir and fsynced. The tensors come to the host through
// `ops` (the backend that holds params).
void save_hf_model(Ops& ops, const std::string& dir, const ModelSource& src, const ParamSet& params,
                   DType dtype = DType::f32);

}  // namespace oomless
