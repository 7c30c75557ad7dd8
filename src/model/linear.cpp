#include "model/linear.h"

namespace oomless {

Tensor rows_of(const Tensor& t, int64_t r0, int64_t n) {
  if (t.quant) {
    Tensor r(nullptr, t.dtype, {n, t.dims[1]});
    r.quant = t.quant, r.qrow0 = t.qrow0 + r0, r.as_bf16 = t.as_bf16;
    return r;
  }
  if (!t.data) return Tensor();
  const int64_t cols = t.dims[1];
  Tensor r(t, dtype_bytes(t.dtype, r0 * cols), t.dtype, {n, cols});
  r.as_bf16 = t.as_bf16;
  return r;
}

Tensor span_of(const Tensor& t, int64_t e0, int64_t n) {
  if (!t.data) return Tensor();
  return Tensor(t, dtype_bytes(t.dtype, e0), t.dtype, {n});
}

Linear Linear::rows(int64_t r0, int64_t count) const {
  Linear r = *this;
  r.w = rows_of(w, r0, count), r.gw = rows_of(gw, r0, count);
  r.b = span_of(b, r0, count), r.gb = span_of(gb, r0, count);
  r.bm = rows_of(bm, r0, count), r.gbm = rows_of(gbm, r0, count);
  r.g = span_of(g, r0, count), r.n = span_of(n, r0, count), r.gm = span_of(gm, r0, count);
  return r;
}

}  // namespace oomless
