// PagedKvStore's parts shared by its three files (residency: paged_kv.cpp; attention over the history:
// history_attention.cpp; page selection: page_select.cpp).
#pragma once
#include <array>
#include <vector>

#include "kv/paged_kv.h"

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

}  // namespace oomless::kv_detail

namespace oomless {

// Up to C/P earlier pages of one layer, as attention reads them: in mode none the pages themselves (home
// pool ids), otherwise fixed Device pages (dev) that transfers fill and empty.
struct PagedKvStore::Window {
  std::vector<int64_t> dev;                 // Device page ids in the window pool (host/disk)
  std::vector<std::array<float, 2>> scales; // fp8: each held page's K and V scales
  std::vector<int64_t> lps;                 // the logical pages held, in order
  std::vector<int64_t> pages;               // none: the home page ids read in place
  std::vector<Offloader::Ticket> pending;   // transfers into or out of dev not yet waited on
  std::vector<KvBlock> blocks;
  int64_t layer = -1;
};

}  // namespace oomless
