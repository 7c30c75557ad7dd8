#include "model/engine.h"

#include <cmath>

#include "core/error.h"
#include "model/adapter_io.h"

namespace oomless {

Engine build_engine(const EngineOptions& o) {
  OOM_CHECK(o.backend == "cpu" || o.backend == "cuda", "[engine] --backend ", o.backend,
            " is not a backend oomless has; use cpu or cuda");
  Engine e;
  e.src = open_model(o.model, o.seed);
  if (o.rope_theta > 0) {
    OOM_CHECK(std::isfinite(o.rope_theta), "[model] --rope-theta must be a positive number, got ", o.rope_theta);
    e.src.cfg.rope.theta = o.rope_theta;  // and so into every config.json written from this model
  }
  if (!o.rope_scaling.empty()) apply_rope_scaling(e.src.cfg, o.rope_scaling, "--rope-scaling");
  std::string embed_dtype = o.embed_dtype;
  std::optional<LoraSettings> saved;  // the settings of an adapter loaded as it is
  if (!o.lora && !o.adapter.empty()) {
    saved = read_adapter_settings(o.adapter, e.src.cfg);
    // An adapter that trained the embedding or head (modules_to_save) replaces them: they are held in fp32.
    if (saved->train_embed || saved->train_head) {
      OOM_CHECK(embed_dtype == "auto" || embed_dtype == "fp32", "[model] --embed-dtype ", embed_dtype, ": the adapter ",
                o.adapter, " holds a trained embedding or LM head (modules_to_save), which stay fp32");
      embed_dtype = "fp32";
    }
  }
  e.mem = std::make_unique<CpuMemory>(o.budget);
  e.ops = make_ops(o.backend, &e.mem->device);
  e.host_ops = make_ops(o.backend == "ref" ? "ref" : "cpu", &e.mem->host);
  std::vector<bool> held;
  if (o.held) held = o.held(param_specs(e.src.cfg));
  BaseWeights base = load_base(e.src, *e.ops, e.mem->device, o.keep_quantised, o.base_dtype, embed_dtype,
                               o.held ? &held : nullptr, o.gathered_copies);
  e.params = std::move(base.params);
  e.gathered = std::move(base.gathered);
  e.quant = std::move(base.quant);
  if (e.quant && o.int8_decode) e.quant->set_int8_activations(true);
  e.src.release_weights();
  if (o.lora) {
    e.adapters = std::make_unique<AdapterSet>(e.src.cfg, *o.lora, DType::f32, e.mem->device, Category::adapter);
    init_lora(*e.ops, *e.adapters, o.lora_seed);
    init_dora(*e.ops, *e.adapters, *e.params);
    if (!o.adapter.empty()) load_adapter(*e.ops, o.adapter, e.src.cfg, *e.adapters, *e.params);
  } else if (!o.adapter.empty()) {
    e.adapters = std::make_unique<AdapterSet>(e.src.cfg, *saved, DType::f32, e.mem->device, Category::adapter);
    load_adapter(*e.ops, o.adapter, e.src.cfg, *e.adapters, *e.params);
  }
  ModelOptions mo{o.dtype, SavePolicy::all, e.adapters.get(), o.act_store};
  mo.save_layers = parse_save_policies(o.save_policy, e.src.cfg.L);
  mo.act_offload = o.act_offload;
  if (!o.act_tiers.empty()) mo.act_tiers = parse_act_tiers(o.act_tiers, e.src.cfg.L);
  mo.act_host = &e.mem->host;
  mo.spill_dir = o.spill_dir;
  e.model = std::make_unique<Model>(e.src.cfg, *e.ops, *e.params, e.mem->device, mo);
  return e;
}

}  // namespace oomless
