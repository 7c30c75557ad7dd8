// The engine builder: memory, ops, the base's parameters (in whatever storage they are kept), adapters
// and the model over them, built the same way for every command (train, eval, generate, merge), the
// trainer, the tests and the benches.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "backend/ops.h"
#include "memory/arena.h"
#include "model/load.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/quant_base.h"

namespace oomless {

struct EngineOptions {
  std::string model;                 // --model: a Hugging Face folder, a .gguf, a config.json or preset:NAME
  std::string backend = "cpu";       // --backend: cpu, or cuda (refused with a clear error: no kernels yet)
  uint64_t seed = 0;                 // random init of presets and config-only models
  size_t budget = size_t{1} << 46;   // --budget (bytes) of the Device and Host arenas together
  double rope_theta = 0;             // > 0: overrides the model's RoPE base
  std::string rope_scaling;          // non-empty: overrides the model's RoPE scaling (apply_rope_scaling)
  // Keep a GGUF's projections in its blocks / a bitsandbytes folder in NF4 (frozen-base runs: adapters,
  // eval, generate); false: every parameter in f32 (full training, convert, merge).
  bool keep_quantised = false;
  std::string base_dtype = "fp32";   // fp32, bf16, nf4 or nf4-dq: the frozen projections stored at load
  std::string embed_dtype = "auto";  // auto, fp32, bf16 or nf4: storage of a frozen embedding and head
  // generate --decode-dot int8: one-row products over a GGUF's Q4_0 / Q4_1 / Q8_0 blocks with the
  // activations quantised to 8 bits (QuantBase::set_int8_activations); false (the default): in f32,
  // bitwise a many-row product's rows.
  bool int8_decode = false;
  // New adapters with these settings (PEFT's init from lora_seed, DoRA's magnitudes from the base), then
  // `adapter`'s tensors when given. Without settings, `adapter` (if any) brings its own from its config.
  std::optional<LoraSettings> lora;
  uint64_t lora_seed = 1;
  std::string adapter;               // an adapter folder (oomless's or PEFT's)
  ComputeDType dtype = ComputeDType::f32;
  std::string save_policy = "all";   // --save-policy: one policy, or one per layer (parse_save_policies)
  DType act_store = DType::f32;      // --act-dtype: storage of saved activations (ModelOptions::act_store)
  Tier act_offload = Tier::Device;   // --act-offload none|host|disk (ModelOptions::act_offload)
  std::string act_tiers;             // --act-offload as a per-layer list (parse_act_tiers); empty: act_offload
  std::string spill_dir;             // its spill file's folder (disk)
  // ZeRO-3 (an f32 base, trained or frozen): given the model's parameters in param_specs order, whether this rank
  // keeps each; the layers' others share one gathered layer (load_base's `held`). Empty: every parameter kept.
  std::function<std::vector<bool>(const std::vector<ParamSpec>&)> held;
  int gathered_copies = 1;  // held: k + 1 gives the layers' others k + 1 storages (load_base), for prefetching k
};

// Members are declared in destruction order: memory last, after everything holding its buffers.
struct Engine {
  ModelSource src;                   // the model's config (with the options' RoPE overrides), tokenizer
  std::unique_ptr<CpuMemory> mem;
  std::unique_ptr<Ops> ops;
  // The host's backend, over the Host arena: what computes on host memory (an optimizer whose state is
  // there, optim/host_placed.h). The CPU backend (ref when the engine runs ref).
  std::unique_ptr<Ops> host_ops;
  std::unique_ptr<ParamSet> params;  // the base (frozen when adapters are on)
  Buffer gathered;                   // ZeRO-3: the layer storage params' tensors of other ranks view
  std::unique_ptr<QuantBase> quant;  // projections kept quantised (null: none)
  std::unique_ptr<AdapterSet> adapters;
  std::unique_ptr<Model> model;

  // Bytes of the base as held: parameters in f32/bf16 plus quantised storage.
  size_t base_bytes() const { return params->bytes() + (quant ? quant->bytes() : 0); }
};

// Opens the model and builds everything over it (weights read and released from their files).
Engine build_engine(const EngineOptions& o);

}  // namespace oomless
