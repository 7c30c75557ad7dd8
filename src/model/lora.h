// LoRA adapters (Hu et al. 2021; rsLoRA: Kalajdzievski 2023) on the decoder's linear projections, laid
// out and named as PEFT saves them, so an adapter folder moves between oomless and PEFT as it is.
//
// For an adapted projection with base weight W (N, K) and bias b:
//   y = x W^T + b + s * (x A^T) B^T,  A (r, K), B (N, r),  s = alpha / r  (rsLoRA: alpha / sqrt(r)).
// A starts as PEFT's default (kaiming-uniform with a = sqrt(5): U(-1/sqrt(K), 1/sqrt(K))), B at zero, so
// an untrained adapter leaves the model unchanged.
//
// DoRA (Liu et al. 2024) adds a magnitude m (N) per adapted projection, PEFT's lora_magnitude_vector:
//   y = b + g * (x W^T + s (x A^T) B^T),  g = m / n,  n_j = ||W_j + s (B A)_j||  (row j of the adapted weight).
// As in PEFT the norm n is a constant of the step (detached: no gradient flows through it); m starts at
// ||W_j||, so an untrained DoRA adapter leaves the model unchanged too. n is computed without forming
// B A: n_j^2 = ||W_j||^2 + 2 s B_j . (A W^T)_j + s^2 B_j (A A^T) B_j^T (Ops::dora_scale).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "backend/ops.h"
#include "memory/arena.h"
#include "model/config.h"
#include "model/params.h"

namespace oomless {

// The linear projections of a block, in block order.
enum class Proj : int { q, k, v, o, gate, up, down };
inline constexpr int kProjCount = 7;
const char* proj_short_name(Proj p);  // "q", "k", ... (the --lora-targets names)
const char* proj_module(Proj p);      // "self_attn.q_proj", "mlp.gate_proj", ...
int64_t proj_out(const ModelConfig& c, Proj p);  // N
int64_t proj_in(const ModelConfig& c, Proj p);   // K
Tensor proj_weight(const LayerParams& w, Proj p); // wq, ..., wd
Tensor proj_bias(const LayerParams& w, Proj p);   // bq, bk, bv, bo, or empty

struct LoraSettings {
  int64_t r = 0;           // rank; 0: no adapters
  double alpha = 0;        // lora_alpha
  double dropout = 0;      // lora_dropout (on the adapter's input)
  std::vector<Proj> targets;
  bool rslora = false;     // s = alpha / sqrt(r)
  bool dora = false;       // DoRA: a magnitude vector per adapted projection
  // PEFT's modules_to_save: the embedding / LM head trained in full beside the adapters (on a tied model
  // either means the one shared matrix).
  bool train_embed = false, train_head = false;
  double scale() const;
};

// "q,k,v,o,gate,up,down" (short names, or the module names q_proj, ..., down_proj, in any order) or
// "all-linear" (every projection of the blocks; the LM head is not adapted, as in PEFT).
std::vector<Proj> parse_lora_targets(std::string_view list);
// The adapter tensors of every layer in PEFT order: per layer and target lora_A (r, K), lora_B (N, r) and
// with DoRA lora_magnitude_vector (N).
std::vector<ParamSpec> adapter_specs(const ModelConfig& c, const LoraSettings& s);
// Checks r, alpha and dropout against the model: r <= min(N, K) of every target.
void validate_lora(const LoraSettings& s, const ModelConfig& c);

// One projection's adapter tensors: a (r, K), b (N, r), DoRA's magnitude m (N); empty when the
// projection is not adapted (m: without DoRA).
struct LoraTensors {
  Tensor a, b, m;
};
struct LayerLora {
  LoraTensors p[kProjCount];
  const LoraTensors& operator[](Proj x) const { return p[static_cast<int>(x)]; }
};

// PEFT's key of a projection's adapter tensor: part "lora_A.weight", "lora_B.weight" or
// "lora_magnitude_vector".
std::string lora_key(int64_t layer, Proj p, std::string_view part);

// Every adapter tensor of a model in one buffer (a ParamSet under PEFT's names, in layer then projection
// order, A before B before DoRA's magnitude), with per-layer views. The same layout serves the gradients (Category::grads).
class AdapterSet {
 public:
  AdapterSet(const ModelConfig& cfg, const LoraSettings& s, DType dtype, Arena& arena, Category cat);
  const LoraSettings& settings() const { return settings_; }
  ParamSet& tensors() { return set_; }
  const ParamSet& tensors() const { return set_; }
  const LayerLora& layer(int64_t l) const { return layers_[static_cast<size_t>(l)]; }
  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  LoraSettings settings_;
  ParamSet set_;
  std::vector<LayerLora> layers_;
};

// Folds the adapters into the base: W += s * B A for every adapted projection, and with DoRA then
// W_j *= m_j / ||W_j|| (what PEFT's merge_and_unload computes). params and adapters share a dtype; the
// scratch is charged to `arena`.
void merge_lora(Ops& ops, ParamSet& params, const AdapterSet& a, Arena& arena);

// PEFT's default initialisation: A ~ U(-1/sqrt(K), 1/sqrt(K)) from a seeded generator, B = 0.
void init_lora(Ops& ops, AdapterSet& a, uint64_t seed);
// DoRA's magnitudes at their initial value, m = row norms of the base weights (any storage) through `ops`.
void init_dora(Ops& ops, AdapterSet& a, const ParamSet& base);

}  // namespace oomless
