// Evaluation of a token stream: non-overlapping windows of T tokens (the last partial window dropped),
// loss = sum of cross-entropy / number of predictions (T - 1 per window), with the loss broken down by
// position in the window, and optionally the gradient of window 0's mean loss; or of sequences with
// their own targets (chat data).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/model.h"

namespace oomless {

struct PositionBucket {
  int64_t start = 0, end = 0;  // predicting positions [start, end) in the window
  double loss_sum = 0.0;
  int64_t count = 0;
};

struct EvalResult {
  double loss_sum = 0.0;
  int64_t predictions = 0;
  int64_t windows = 0;
  int64_t tokens = 0;  // tokens evaluated (windows x T)
  std::vector<PositionBucket> buckets;
  double loss() const { return predictions ? loss_sum / static_cast<double>(predictions) : 0.0; }
};

// Buckets [0, 1), [1, 2), [2, 4), [4, 8), ... up to T - 1 predictions.
std::vector<PositionBucket> position_buckets(int64_t T);

// with_grads: window 0 runs forward + backward with grad_scale 1 / (T - 1), so model.grads() holds the
// gradient of its mean loss (what transformers computes with labels = input_ids).
// kv (with C > 0): each window runs chunk by chunk through that store (Model::chunked_eval, or
// chunked_step for the gradient), for windows longer than the activations one pass can hold.
// progress (optional): called after each window with (windows done, windows in all).
// slice (len > 0, with kv): only positions [at, at + len) of each window are scored, as one chunk at its
// positions (a context-parallel rank's share; the ranks' sums make the whole); no gradient.
using EvalProgress = std::function<void(int64_t, int64_t)>;
struct EvalSlice {
  int64_t at = 0, len = 0;
  int64_t at2 = -1;  // >= 0: two pieces of len / 2, at `at` and `at2` (a zigzag slice)
};
EvalResult evaluate(Model& model, const std::vector<int32_t>& stream, int64_t T, bool with_grads,
                    ChunkKv* kv = nullptr, int64_t C = 0, const EvalProgress& progress = {}, EvalSlice slice = {});

// Evaluation of given sequences (ids and targets of T tokens each, -100 = not supervised), as training
// scores them: loss = sum of cross-entropy over the supervised targets / their count; buckets by the
// target's position in its sequence. Chat data (only assistant turns supervised) is scored this way.
EvalResult evaluate_sequences(Model& model, const std::vector<std::vector<int32_t>>& ids,
                              const std::vector<std::vector<int32_t>>& targets, ChunkKv* kv = nullptr, int64_t C = 0,
                              const EvalProgress& progress = {}, EvalSlice slice = {});

}  // namespace oomless
