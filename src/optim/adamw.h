// AdamW over a TrainableSet, with torch.optim.AdamW's semantics: Adam moments with bias correction, and
// decoupled weight decay (p -= lr * wd * p, applied beside the Adam update rather than added to the
// gradient). Decay applies only to tensors whose Trainable::decay is set: matrices and embeddings decay,
// norm weights and biases do not (the usual "no_decay" group). A tied embedding is one entry, so it gets
// one update per step from its summed gradient.
//
// The moments m and v are ParamSets laid out like the trainable set, in its dtype, allocated once in the
// constructor from the arena as Category::optimizer: step() allocates nothing. Their checkpoint names are
// "m." and "v." before each trainable tensor's name.
#pragma once
#include <cstdint>

#include "memory/arena.h"
#include "model/params.h"
#include "optim/optimizer.h"

namespace oomless {

struct AdamWSettings {
  double lr = 1e-3;  // the peak rate; step() takes the scheduled rate of each step
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // galore_torch's AdamW (transformers' form): the weight decay after the Adam step, and eps added to
  // sqrt(v) before the bias correction (step size lr sqrt(1 - b2^t) / (1 - b1^t)); torch's form when false.
  bool transformers_form = false;
};

// The settings every Adam variant writes: {"optimizer", "beta1", "beta2", "eps", "weight-decay"}.
json::Value adam_settings_json(const char* optimizer, const AdamWSettings& s);

class AdamW final : public Optimizer {
 public:
  // `params` fixes the names, shapes and dtype of the state.
  AdamW(const TrainableSet& params, Arena& arena, const AdamWSettings& settings);

  const char* name() const override { return "adamw"; }
  void step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                    int64_t step) override;
  std::vector<NamedTensor> state() override;
  json::Value settings_json() const override;

  const AdamWSettings& settings() const { return settings_; }
  ParamSet& m() { return m_; }  // first moments
  ParamSet& v() { return v_; }  // second moments

 private:
  AdamWSettings settings_;
  ParamSet m_, v_;
};

}  // namespace oomless
