// Views the key/value stores (PagedKvStore, and RingKv of context parallel) take of a chunk's tensors: row
// ranges of (T, ...) tensors, element spans, and the lse rows of some of a chunk's queries.
#pragma once
#include "backend/ops.h"
#include "core/tensor.h"

namespace oomless::kv_detail {

// Rows [r0, r0 + n) of a (T, ...) tensor.
inline Tensor rows(const Tensor& t, int64_t r0, int64_t n) {
  const int64_t per = t.numel() / t.dims[0];
  Tensor r = t;
  r.data = static_cast<char*>(t.data) + dtype_bytes(t.dtype, r0 * per);
  r.dims[0] = n;
  return r;
}

// Elements [first, first + n) of t, as a 1-D tensor on t's tier.
inline Tensor span(const Tensor& t, int64_t first, int64_t n) {
  return Tensor(static_cast<char*>(t.data) + dtype_bytes(t.dtype, first), t.dtype, {n}, t.tier);
}

// dst (H, n) = columns [r0, r0 + n) of lse (H, T): the lse of query rows r0.. for an attention_backward of some
// rows.
inline void lse_rows(Ops& ops, Tensor dst, const Tensor& lse, int64_t r0, int64_t n) {
  const int64_t H = lse.dims[0], T = lse.dims[1];
  ops.copy_rows(dst, n, span(lse, r0, (H - 1) * T + n), T, H, n);
}

}  // namespace oomless::kv_detail
