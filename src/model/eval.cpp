#include "model/eval.h"

#include <algorithm>
#include <array>

#include "core/error.h"

namespace oomless {

std::vector<PositionBucket> position_buckets(int64_t T) {
  std::vector<PositionBucket> b;
  const int64_t n = T - 1;  // predictions per window
  if (n <= 0) return b;
  b.push_back({0, 1});
  for (int64_t s = 1; s < n; s *= 2) b.push_back({s, std::min(2 * s, n)});
  return b;
}

namespace {

// One window: forward (with backward of grad_scale 1 / its count when grads), its loss added to r and its
// supervised targets' losses to the buckets their positions fall in. With a slice, its positions only.
void score_window(Model& model, const int32_t* ids, const int32_t* tg, int64_t T, ChunkKv* kv, int64_t C, bool grads,
                  EvalResult& r, EvalSlice slice) {
  const int64_t at = slice.len > 0 ? slice.at : 0, n = slice.len > 0 ? slice.len : T;
  // The pieces scored: [at, at + n), or two of n / 2 (their tokens side by side in `two`).
  const bool zig = slice.len > 0 && slice.at2 >= 0;
  const std::vector<std::array<int64_t, 2>> pieces =
      zig ? std::vector<std::array<int64_t, 2>>{{at, n / 2}, {slice.at2, n - n / 2}}
          : std::vector<std::array<int64_t, 2>>{{at, n}};
  std::vector<int32_t> two;
  if (zig) {
    for (const int32_t* src : {ids, tg})
      for (const auto& [p0, len] : pieces) two.insert(two.end(), src + p0, src + p0 + len);
  }
  const Tensor id_t(zig ? two.data() : const_cast<int32_t*>(ids) + at, DType::i32, {n}),
      tg_t(zig ? two.data() + n : const_cast<int32_t*>(tg) + at, DType::i32, {n});
  CeResult ce;
  std::vector<double> per;
  if (slice.len > 0) {
    for (const auto& [p0, len] : pieces)
      OOM_CHECK(kv && !grads && p0 + len <= T,
                "[eval] a slice of a window is scored through a store, without gradients");
    ce = model.chunked_eval(id_t, tg_t, n, *kv, &per, at, zig ? slice.at2 : -1);
  } else if (kv && C > 0) {
    // The gradient's count is known before backward: the supervised targets.
    if (grads) {
      int64_t n = 0;
      for (int64_t t = 0; t < T; ++t) n += tg[t] >= 0;
      model.chunked_step(id_t, tg_t, C, *kv, 1.0 / static_cast<double>(n));
    }
    ce = model.chunked_eval(id_t, tg_t, C, *kv, &per);
  } else {
    ce = model.forward(id_t, tg_t, grads);
    if (grads) model.backward(1.0 / static_cast<double>(ce.count));
    per = model.token_losses();
  }
  r.loss_sum += ce.loss_sum;
  r.predictions += ce.count;
  for (PositionBucket& b : r.buckets) {
    int64_t off = 0;  // the piece's first row in per
    for (const auto& [p0, len] : pieces) {
      for (int64_t t = std::max(b.start, p0); t < std::min(b.end, p0 + len); ++t)
        if (tg[t] >= 0) b.loss_sum += per[static_cast<size_t>(off + t - p0)], ++b.count;
      off += len;
    }
  }
}

}  // namespace

EvalResult evaluate(Model& model, const std::vector<int32_t>& stream, int64_t T, bool with_grads, ChunkKv* kv,
                    int64_t C, const EvalProgress& progress, EvalSlice slice) {
  OOM_CHECK(T >= 2, "[eval] --seq must be at least 2 (a window of T tokens makes T - 1 predictions), got ", T);
  const int64_t n = static_cast<int64_t>(stream.size());
  OOM_CHECK(n >= T, "[eval] the data holds ", n, " tokens, fewer than one window of --seq ", T,
            "; use a smaller --seq or more data");
  EvalResult r;
  r.windows = n / T;
  r.tokens = r.windows * T;
  r.buckets = position_buckets(T);
  const bool chunked = kv && (C > 0 || slice.len > 0);
  model.reserve(slice.len > 0 ? slice.len : chunked ? std::min(C, T) : T, with_grads, chunked);
  if (with_grads) model.zero_grads();
  std::vector<int32_t> targets(static_cast<size_t>(T));
  for (int64_t w = 0; w < r.windows; ++w) {
    const int32_t* ids = stream.data() + w * T;
    for (int64_t t = 0; t < T; ++t) targets[static_cast<size_t>(t)] = t + 1 < T ? ids[t + 1] : -100;
    score_window(model, ids, targets.data(), T, kv, C, with_grads && w == 0, r, slice);
    if (progress) progress(w + 1, r.windows);
  }
  return r;
}

EvalResult evaluate_sequences(Model& model, const std::vector<std::vector<int32_t>>& ids,
                              const std::vector<std::vector<int32_t>>& targets, ChunkKv* kv, int64_t C,
                              const EvalProgress& progress, EvalSlice slice) {
  OOM_CHECK(!ids.empty() && ids.size() == targets.size(), "[eval] no sequences to evaluate");
  const int64_t T = static_cast<int64_t>(ids[0].size());
  OOM_CHECK(T >= 2, "[eval] --seq must be at least 2, got ", T);
  EvalResult r;
  r.windows = static_cast<int64_t>(ids.size());
  r.tokens = r.windows * T;
  r.buckets = position_buckets(T + 1);  // targets at positions 0 .. T-1
  const bool chunked = kv && (C > 0 || slice.len > 0);
  model.reserve(slice.len > 0 ? slice.len : chunked ? std::min(C, T) : T, false, chunked);
  for (size_t w = 0; w < ids.size(); ++w) {
    OOM_CHECK(static_cast<int64_t>(ids[w].size()) == T && targets[w].size() == ids[w].size(),
              "[eval] every sequence holds ", T, " ids and as many targets");
    score_window(model, ids[w].data(), targets[w].data(), T, kv, C, false, r, slice);
    if (progress) progress(static_cast<int64_t>(w) + 1, r.windows);
  }
  return r;
}

}  // namespace oomless
