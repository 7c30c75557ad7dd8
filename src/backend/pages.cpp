// Ops::page_summary and Ops::page_select: the host forms (cpu and ref), for page-level top-k sparse attention.
// They are the paged K/V store's former host loops, moved below backend/ unchanged: the same double sums in
// the same order, so the selections are the same pages.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/ops.h"

namespace oomless {

namespace {

// Element i of an f32 or f64 tensor, as double.
inline double at(const Tensor& t, int64_t i) {
  return t.dtype == DType::f64 ? static_cast<const double*>(t.data)[i] : static_cast<const float*>(t.data)[i];
}

}  // namespace

void Ops::page_summary(Tensor out, Tensor k, int64_t row0, int64_t P) {
  const char* op = "[page_summary]";
  OOM_CHECK(k.ndim == 3, op, " k must be (Hkv, Tc, D), got ", k.str());
  check_dtype(op, "k", k, {DType::f32, DType::f64});
  check_dtype(op, "out", out, {DType::f32});
  const int64_t Hkv = k.dims[0], Tc = k.dims[1], D = k.dims[2];
  OOM_CHECK(out.ndim == 3 && (out.dims[0] == 1 || out.dims[0] == 2), op, " out must be (1 or 2, Hkv, D), got ",
            out.str());
  const int64_t S = out.dims[0];
  check_shape(op, "out", out, {S, Hkv, D});
  OOM_CHECK(P > 0 && row0 >= 0 && row0 + P <= Tc, op, " rows [", row0, ", ", row0 + P, ") are outside the ", Tc,
            " rows of k");
  float* o = static_cast<float*>(out.data);
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t d = 0; d < D; ++d) {
      double sum = 0, lo = std::numeric_limits<double>::infinity(), hi = -lo;
      for (int64_t t = 0; t < P; ++t) {
        const double x = at(k, (h * Tc + row0 + t) * D + d);
        sum += x;
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      if (S == 1) {
        o[h * D + d] = static_cast<float>(sum / static_cast<double>(P));
      } else {
        o[h * D + d] = static_cast<float>(lo);
        o[(Hkv + h) * D + d] = static_cast<float>(hi);
      }
    }
}

void Ops::page_select(Tensor sel, Tensor counts, Tensor q, Tensor summaries, int64_t P, int64_t sinks) {
  const char* op = "[page_select]";
  OOM_CHECK(q.ndim == 3, op, " q must be (Tc, H, D), got ", q.str());
  check_dtype(op, "q", q, {DType::f32, DType::f64});
  OOM_CHECK(summaries.ndim == 4 && (summaries.dims[1] == 1 || summaries.dims[1] == 2), op,
            " summaries must be (pages, 1 or 2, Hkv, D), got ", summaries.str());
  check_dtype(op, "summaries", summaries, {DType::f32});
  const int64_t Tc = q.dims[0], H = q.dims[1], D = q.dims[2];
  const int64_t hist = summaries.dims[0], S = summaries.dims[1], Hkv = summaries.dims[2];
  OOM_CHECK(summaries.dims[3] == D && Hkv > 0 && H % Hkv == 0, op, " summaries ", summaries.str(),
            " do not match q ", q.str(), " (D, and H a multiple of Hkv)");
  OOM_CHECK(P > 0, op, " P must be positive, got ", P);
  const int64_t nq = (Tc + P - 1) / P;
  OOM_CHECK(sel.ndim == 2 && sel.dims[0] == nq, op, " sel must be (", nq, " query pages, width), got ", sel.str());
  check_dtype(op, "sel", sel, {DType::i32});
  check_dtype(op, "counts", counts, {DType::i32});
  check_shape(op, "counts", counts, {nq});
  const int64_t W = sel.dims[1];
  OOM_CHECK(sinks >= 0 && sinks <= W, op, " sinks ", sinks, " must be within the selection's width ", W);
  const int64_t group = H / Hkv, sk = std::min(sinks, hist), k = std::min(W - sinks, hist - sk);
  const float* summ = static_cast<const float*>(summaries.data);
  int32_t* sel_all = static_cast<int32_t*>(sel.data);
  int32_t* cnt = static_cast<int32_t*>(counts.data);
#pragma omp parallel
  {
    std::vector<double> qs(static_cast<size_t>(H * D));
    std::vector<double> score(static_cast<size_t>(hist));
    std::vector<int32_t> order;
#pragma omp for schedule(static)
    for (int64_t qp = 0; qp < nq; ++qp) {
      int32_t* out = sel_all + qp * W;
      if (hist <= W) {
        for (int64_t j = 0; j < hist; ++j) out[j] = static_cast<int32_t>(j);
        cnt[qp] = static_cast<int32_t>(hist);
        continue;
      }
      std::fill(qs.begin(), qs.end(), 0.0);
      for (int64_t t = qp * P; t < std::min(Tc, (qp + 1) * P); ++t)
        for (int64_t i = 0; i < H * D; ++i) qs[static_cast<size_t>(i)] += at(q, t * H * D + i);
      for (int64_t j = sk; j < hist; ++j) {
        const float* m = summ + j * S * Hkv * D;
        double sc = 0;
        for (int64_t h = 0; h < H; ++h) {
          const double* x = qs.data() + h * D;
          const float* lo = m + (h / group) * D;
          if (S == 1) {
            for (int64_t d = 0; d < D; ++d) sc += x[d] * lo[d];
          } else {
            const float* hi = m + (Hkv + h / group) * D;
            for (int64_t d = 0; d < D; ++d) sc += std::max(x[d] * lo[d], x[d] * hi[d]);
          }
        }
        score[static_cast<size_t>(j)] = std::isnan(sc) ? -std::numeric_limits<double>::infinity() : sc;
      }
      order.resize(static_cast<size_t>(hist - sk));
      for (int64_t j = sk; j < hist; ++j) order[static_cast<size_t>(j - sk)] = static_cast<int32_t>(j);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        const double sa = score[static_cast<size_t>(a)], sb = score[static_cast<size_t>(b)];
        return sa > sb || (sa == sb && a < b);
      });
      for (int64_t j = 0; j < sk; ++j) out[j] = static_cast<int32_t>(j);
      std::copy(order.begin(), order.begin() + k, out + sk);
      std::sort(out, out + sk + k);
      cnt[qp] = static_cast<int32_t>(sk + k);
    }
  }
}

}  // namespace oomless
