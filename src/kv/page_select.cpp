// PagedKvStore: page-level top-k selection (page summaries, each query page's selection through
// Ops::page_summary / Ops::page_select) and the windows a chunk's history is read in.
#include <algorithm>

#include "kv/paged_kv.h"

namespace oomless {

// The summary of page lp of `layer` from the chunk's keys k (Hkv, Tc, D), rows [row0, row0 + P).
void PagedKvStore::summarize(int64_t layer, int64_t lp, const Tensor& k, int64_t row0) {
  const int64_t S = opt_.summary == PageSummary::mean ? 1 : 2;
  float* out = static_cast<float*>(summ_.data()) + ((layer * hist_pages_ + lp) * S) * cfg_.Hkv * cfg_.D;
  ops_.page_summary(Tensor(out, DType::f32, {S, cfg_.Hkv, cfg_.D}, summ_.tier()), k, row0, opt_.P);
}

// The selections of the current chunk in `layer` from its queries q (Tc, H, D), unless made already (a
// recompute or backward of a chunk whose forward selected, or keep_selection).
void PagedKvStore::select(int64_t layer, const Tensor& q) {
  uint8_t& made = made_[static_cast<size_t>(layer * max_chunks_ + chunk_)];
  if (made) return;
  const int64_t Tc = q.dims[0], P = opt_.P, ppc = pages_per_chunk();
  const int64_t hist = chunk_ * ppc, K = sel_width(), nq = (Tc + P - 1) / P;
  const int64_t S = opt_.summary == PageSummary::mean ? 1 : 2, HD = cfg_.Hkv * cfg_.D;
  float* summ = static_cast<float*>(summ_.data()) + layer * hist_pages_ * S * HD;
  int32_t* sel = static_cast<int32_t*>(sel_.data()) + (layer * max_chunks_ + chunk_) * ppc * K;
  int32_t* cnt = static_cast<int32_t*>(sel_n_.data()) + (layer * max_chunks_ + chunk_) * ppc;
  // Selected where the queries and summaries are, then brought to the host, which plans the windows from them.
  int32_t* dev = static_cast<int32_t*>(sel_dev_.data());
  const Tensor dsel(dev, DType::i32, {nq, K}, sel_dev_.tier()), dcnt(dev + ppc * K, DType::i32, {nq}, sel_dev_.tier());
  ops_.page_select(dsel, dcnt, q, Tensor(summ, DType::f32, {hist, S, cfg_.Hkv, cfg_.D}, summ_.tier()), P,
                   opt_.sink_pages);
  ops_.download(sel, dsel);
  ops_.download(cnt, dcnt);
  if (nq < ppc) std::fill(cnt + nq, cnt + ppc, 0);  // pages past a short last chunk: no queries
  made = 1;
}

std::vector<int64_t> PagedKvStore::selection(int64_t layer, int64_t c, int64_t qp) const {
  std::vector<int64_t> r;
  if (!sparse() || layer < 0 || layer >= cfg_.L || c < 0 || c >= max_chunks_ || qp < 0 || qp >= pages_per_chunk() ||
      !made_[static_cast<size_t>(layer * max_chunks_ + c)])
    return r;
  const int64_t i = (layer * max_chunks_ + c) * pages_per_chunk() + qp;
  const int32_t* sel = static_cast<const int32_t*>(sel_.data()) + i * sel_width();
  r.assign(sel, sel + static_cast<const int32_t*>(sel_n_.data())[i]);
  return r;
}

// The windows the current chunk's history is read in. Dense: the earlier chunks, every row reading all of
// each. Sparse: the union of the query pages' selections in page order, C/P pages per window; in each,
// consecutive query pages that read the same pages of it form one group.
std::vector<PagedKvStore::Step> PagedKvStore::plan(int64_t layer, int64_t Tc) const {
  const int64_t ppc = pages_per_chunk(), P = opt_.P;
  std::vector<Step> steps;
  if (!sparse()) {
    for (int64_t j = 0; j < chunk_; ++j) {
      Step s;
      Group g{0, Tc, {}};
      for (int64_t i = 0; i < ppc; ++i) {
        s.pages.push_back(j * ppc + i);
        g.idx.push_back(static_cast<int32_t>(i));
      }
      s.groups.push_back(std::move(g));
      steps.push_back(std::move(s));
    }
    return steps;
  }
  OOM_CHECK(made_[static_cast<size_t>(layer * max_chunks_ + chunk_)], "[kv] internal: layer ", layer, " chunk ",
            chunk_, " has no page selection");
  const int64_t nq = (Tc + P - 1) / P, K = sel_width();
  const int32_t* sel = static_cast<const int32_t*>(sel_.data()) + (layer * max_chunks_ + chunk_) * ppc * K;
  const int32_t* cnt = static_cast<const int32_t*>(sel_n_.data()) + (layer * max_chunks_ + chunk_) * ppc;
  std::vector<int64_t> all;
  for (int64_t qp = 0; qp < nq; ++qp) all.insert(all.end(), sel + qp * K, sel + qp * K + cnt[qp]);
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  for (size_t w0 = 0; w0 < all.size(); w0 += static_cast<size_t>(ppc)) {
    Step s;
    s.pages.assign(all.begin() + static_cast<std::ptrdiff_t>(w0),
                   all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), w0 + static_cast<size_t>(ppc))));
    for (int64_t qp = 0; qp < nq; ++qp) {
      std::vector<int32_t> idx;
      size_t i = 0;
      for (const int32_t* p = sel + qp * K; p < sel + qp * K + cnt[qp]; ++p) {
        while (i < s.pages.size() && s.pages[i] < *p) ++i;
        if (i < s.pages.size() && s.pages[i] == *p) idx.push_back(static_cast<int32_t>(i));
      }
      const int64_t r0 = qp * P, n = std::min(P, Tc - r0);
      if (idx.empty()) continue;
      if (!s.groups.empty() && s.groups.back().r0 + s.groups.back().n == r0 && s.groups.back().idx == idx) {
        s.groups.back().n += n;
      } else {
        s.groups.push_back({r0, n, std::move(idx)});
      }
    }
    steps.push_back(std::move(s));
  }
  return steps;
}

}  // namespace oomless
