// PagedKvStore's parts shared by its three files (residency: paged_kv.cpp; attention over the history:
// history_attention.cpp; page selection: page_select.cpp).
#pragma once
#include <array>
#include <vector>

#include "kv/kv_views.h"
#include "kv/paged_kv.h"

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
