// ParamSet: every parameter of a model in one arena buffer, with a Tensor view per parameter in
// param_specs() order and named accessors per layer. The same type holds weights (category weights),
// their gradients (category grads) and bf16 working copies of the matrices.
#pragma once
#include <functional>
#include <string_view>
#include <vector>

#include "backend/ops.h"
#include "memory/arena.h"
#include "model/config.h"
#include "model/trainable.h"

namespace oomless {

struct LayerParams {
  Tensor in_norm;            // (E)
  Tensor wq, bq;             // (H*D, E), (H*D) or empty
  Tensor wk, bk;             // (Hkv*D, E), (Hkv*D) or empty
  Tensor wv, bv;             // (Hkv*D, E), (Hkv*D) or empty
  Tensor wo, bo;             // (E, H*D), (E) or empty
  Tensor q_norm, k_norm;     // (D) or empty (Qwen3)
  Tensor post_norm;          // (E)
  Tensor wg, wu;             // (F, E)
  Tensor wd;                 // (E, F)
};

class ParamSet {
 public:
  ParamSet() = default;
  // Allocates every parameter of `cfg` in `dtype` from `arena`, zero-filled.
  ParamSet(const ModelConfig& cfg, DType dtype, Arena& arena, Category cat);
  // Every parameter except those `stored` refuses (views without data, e.g. matrices a quantised base
  // holds elsewhere: set_view points them at it).
  ParamSet(const ModelConfig& cfg, DType dtype, Arena& arena, Category cat,
           const std::function<bool(const ParamSpec&)>& stored);
  // Any named set of tensors (adapters, optimizer state) in one zero-filled buffer; the named model
  // accessors below stay empty.
  ParamSet(std::vector<ParamSpec> specs, DType dtype, Arena& arena, Category cat, const char* what);
  // Replaces the view of parameter `hf_name` (same shape), and the named accessor that shows it.
  void set_view(std::string_view hf_name, const Tensor& t);

  const std::vector<ParamSpec>& specs() const { return specs_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const Tensor* find(std::string_view hf_name) const;
  DType dtype() const { return dtype_; }
  size_t bytes() const { return storage_.size(); }
  void* data() const { return storage_.data(); }
  // Every byte of the set as one u8 tensor, in its tier (zeroing, comparing).
  Tensor raw() const { return storage_.view(DType::u8, {static_cast<int64_t>(storage_.size())}); }
  // Every tensor under its name (prefix + Hugging Face name), in specs order, for checkpoints.
  std::vector<NamedTensor> named(const std::string& prefix = "") const;

  Tensor embed;                   // (V, E)
  std::vector<LayerParams> layers;
  Tensor final_norm;              // (E)
  Tensor lm_head;                 // (V, E); the embedding itself when tied

 private:
  void wire(const ModelConfig& cfg);  // the named accessors, from the layer table by name
  std::vector<ParamSpec> specs_;
  std::vector<Tensor> tensors_;
  bool model_ = false;  // built from a ModelConfig (has named accessors)
  ModelConfig cfg_;
  DType dtype_ = DType::f32;
  Buffer storage_;
};

// Every tensor of `params` with its gradient in `grads` (the same layout), in order: full training.
TrainableSet trainable_set(const ParamSet& params, const ParamSet& grads);

// N(0, std) for matrices and embeddings, 1 for norms, 0 for biases; deterministic for a seed.
void init_random(Ops& ops, ParamSet& p, uint64_t seed, double std = 0.02);
// dst = src element-wise (float dtypes), e.g. f64 copies of f32 parameters.
void convert_params(Ops& ops, ParamSet& dst, const ParamSet& src);

}  // namespace oomless
