// Float64 reference of the fused LM head + cross-entropy: the full logits row of one token at a time
// (a V-long vector, fine for the oracle), softmax with the maximum subtracted.
//
//   logits_v = h_t . w_v,  lse_t = m + log sum_v exp(logits_v - m),  m = max_v logits_v
//   loss_t   = lse_t - logits_target
//   dlogits_v = grad_scale * (exp(logits_v - lse_t) - [v == target])
//   dh_t = sum_v dlogits_v w_v,  dw_v += dlogits_v h_t
#include <cmath>
#include <limits>
#include <vector>

#include "backend/checks.h"
#include "backend/ref/ref_load.h"
#include "backend/ref/ref_ops.h"

namespace oomless {

namespace {
constexpr DType kAct = DType::f64;
constexpr const char* kOp = "[cross_entropy]";
using ref_detail::load;

// logits (V) of row t.
void row_logits(std::vector<double>& logits, const double* h, const Tensor& w, int64_t t, int64_t E, int64_t V) {
  for (int64_t v = 0; v < V; ++v) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += h[t * E + e] * load(w, v * E + e);
    logits[v] = s;
  }
}
}  // namespace

CeResult RefOps::linear_cross_entropy_forward(Tensor lse, Tensor h, Tensor w, Tensor targets, int32_t ignore_index) {
  auto [T, E, V] = check_cross_entropy_host(kOp, lse, h, w, targets, ignore_index, kAct);
  const double* hp = static_cast<const double*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  double* lp = static_cast<double*>(lse.data);
  CeResult r;
  std::vector<double> logits(static_cast<size_t>(V));
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] == ignore_index) {
      lp[t] = 0.0;
      continue;
    }
    row_logits(logits, hp, w, t, E, V);
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) m = std::fmax(m, logits[v]);
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(logits[v] - m);
    lp[t] = m + std::log(s);
    r.loss_sum += lp[t] - logits[tg[t]];
    ++r.count;
  }
  return r;
}

std::vector<double> RefOps::target_logits(Tensor h, Tensor w, Tensor targets, int32_t ignore_index) {
  auto [T, E, V] = check_head_rows("[target_logits]", h, w, targets, ignore_index, kAct);
  check_targets("[target_logits]", static_cast<const int32_t*>(targets.data), targets.dims[0], w.dims[0], ignore_index);
  const double* hp = static_cast<const double*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  std::vector<double> out(static_cast<size_t>(T), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] == ignore_index) continue;
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += hp[t * E + e] * load(w, tg[t] * E + e);
    out[static_cast<size_t>(t)] = s;
  }
  return out;
}

void RefOps::linear_cross_entropy_backward(Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets, Tensor lse,
                                           int32_t ignore_index, double grad_scale) {
  const CeDims dims = check_cross_entropy_host(kOp, lse, h, w, targets, ignore_index, kAct);
  check_cross_entropy_backward(kOp, dims, dh, dw, kAct);
  auto [T, E, V] = dims;
  const double* hp = static_cast<const double*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  const double* lp = static_cast<const double*>(lse.data);
  double* dhp = static_cast<double*>(dh.data);
  double* dwp = static_cast<double*>(dw.data);
  std::vector<double> logits(static_cast<size_t>(V));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) dhp[t * E + e] = 0.0;
    if (tg[t] == ignore_index) continue;
    row_logits(logits, hp, w, t, E, V);
    for (int64_t v = 0; v < V; ++v) {
      double d = grad_scale * (std::exp(logits[v] - lp[t]) - (v == tg[t] ? 1.0 : 0.0));
      for (int64_t e = 0; e < E; ++e) {
        dhp[t * E + e] += d * load(w, v * E + e);
        if (dwp) dwp[v * E + e] += d * hp[t * E + e];
      }
    }
  }
}

}  // namespace oomless
