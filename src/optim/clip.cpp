#include "optim/clip.h"

#include <cmath>

namespace oomless {

double global_grad_norm(Ops& ops, const TrainableSet& set) {
  double sum = 0.0;
  for (const Trainable& t : set) sum += ops.sum_squares(t.grad);
  return std::sqrt(sum);
}

void clip_grads(Ops& ops, const TrainableSet& set, double max_norm, double norm) {
  OOM_CHECK(max_norm > 0 && std::isfinite(max_norm), "[optim] max_norm for clipping must be positive and finite, got ",
            max_norm);
  OOM_CHECK(std::isfinite(norm), "[optim] gradient norm is ", norm,
            ": skip the step instead of clipping (scaling would spread it into every gradient)");
  if (norm <= max_norm) return;
  // torch adds 1e-6 to the norm so the clipped norm lands just under max_norm.
  const double s = max_norm / (norm + 1e-6);
  for (const Trainable& t : set) ops.scale(t.grad, s);
}

}  // namespace oomless
