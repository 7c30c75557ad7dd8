// What a run trains: a list of (name, parameter, gradient, decay) built by the model. Full fine-tuning
// lists every parameter of the ParamSet in param_specs order (HF names); an adapter run lists the
// adapter tensors (PEFT names) and whatever base tensors were asked to train (modules_to_save). The
// optimizer, gradient clipping and checkpoints work on this list only, so a frozen base costs no
// gradient or optimizer bytes.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"

namespace oomless {

struct Trainable {
  std::string name;  // the name it is saved under
  Tensor param;      // (any shape) in the backend's act dtype
  Tensor grad;       // same shape and dtype
  bool decay = true; // weight decay applies (matrices and embeddings; not norms, biases, DoRA magnitudes)
  // When backward finishes its gradient (Model::on_grads_final): layer 0..L-1, kHeadGroup (the final norm
  // and an untied head) or kEmbedGroup (the embedding, and the head tied to it).
  int64_t group = 0;
};

inline constexpr int64_t kEmbedGroup = -1;
inline constexpr int64_t kHeadGroup = 1 << 30;

using TrainableSet = std::vector<Trainable>;

inline int64_t trainable_numel(const TrainableSet& s) {
  int64_t n = 0;
  for (const Trainable& t : s) n += t.param.numel();
  return n;
}

}  // namespace oomless
