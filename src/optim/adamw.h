// AdamW over a ParamSet, with torch.optim.AdamW's semantics: Adam moments with bias correction, and
// decoupled weight decay (p -= lr * wd * p, applied beside the Adam update rather than added to the
// gradient). Decay applies only to parameters whose ParamSpec::decay is set: matrices and embeddings
// decay, norm weights and biases do not (the usual "no_decay" group). A tied embedding is one entry of
// the ParamSet, so it gets one update per step from its summed gradient.
//
// The moments m and v are ParamSets in the parameters' dtype, allocated once in the constructor from
// the arena as Category::optimizer: step() allocates nothing. m() and v() expose them for checkpoints.
#pragma once
#include <cstdint>

#include "backend/ops.h"
#include "memory/arena.h"
#include "model/config.h"
#include "model/params.h"

namespace oomless {

struct AdamWSettings {
  double lr = 1e-3;  // the peak rate; step() takes the scheduled rate of each step
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class AdamW {
 public:
  // `params` fixes the dtype and layout of the state; cfg must be the config it was built from.
  AdamW(const ModelConfig& cfg, const ParamSet& params, Arena& arena, const AdamWSettings& settings);

  // One update of every parameter from grads at rate lr; step counts optimizer steps from 1 (bias
  // correction). params and grads must have the state's layout and dtype.
  void step(Ops& ops, ParamSet& params, const ParamSet& grads, double lr, int64_t step);

  const AdamWSettings& settings() const { return settings_; }
  ParamSet& m() { return m_; }  // first moments, for checkpoints
  ParamSet& v() { return v_; }  // second moments
  const ParamSet& m() const { return m_; }
  const ParamSet& v() const { return v_; }

 private:
  AdamWSettings settings_;
  ParamSet m_, v_;
};

}  // namespace oomless
