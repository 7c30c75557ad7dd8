// Gradient clipping by global L2 norm, as torch.nn.utils.clip_grad_norm_ does it: when the norm of all
// gradients together exceeds max_norm, every gradient is scaled by max_norm / (norm + 1e-6).
//
// The norm and the clip are separate calls so that the caller sees the norm first: a nonfinite norm
// means the step is skipped (and reported), and clip_grads refuses it rather than spread NaN/Inf into
// every gradient.
#pragma once
#include "backend/ops.h"
#include "model/trainable.h"

namespace oomless {

// sqrt of the sum over the set's gradients, in order, of ops.sum_squares: each term is a double combined
// in a fixed order, so the norm is bit-identical for any thread count. NaN or Inf when any gradient is.
double global_grad_norm(Ops& ops, const TrainableSet& set);

// Scales every gradient by max_norm / (norm + 1e-6) when norm > max_norm; leaves them unchanged
// otherwise. norm is global_grad_norm(set). Throws for a nonfinite norm or a non-positive max_norm.
void clip_grads(Ops& ops, const TrainableSet& set, double max_norm, double norm);

}  // namespace oomless
