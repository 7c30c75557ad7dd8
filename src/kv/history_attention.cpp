// PagedKvStore: attention of a chunk over its own keys and its history, forward and backward (the windows
// the residency part fetches, merged with attention_merge; dK/dV into the window's gradient pages).
#include <cmath>

#include "kv/paged_kv.h"
#include "kv/paged_kv_detail.h"

namespace oomless {

using kv_detail::rows;
using kv_detail::span;

void PagedKvStore::forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) {
  const int64_t Tc = q.dims[0], H = cfg_.H, D = cfg_.D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  KvBlock own{k.data, v.data, static_cast<int32_t>(chunk_ * opt_.C), static_cast<int32_t>(Tc)};
  ops_.attention_forward(o, lse, q, KvBlocks{&own, 1, cfg_.Hkv, Tc, D, k.dtype, bf16_products_}, pos, scale);
  if (chunk_ == 0) return;
  if (sparse()) select(layer, q);
  const std::vector<Step> steps = plan(layer, Tc);
  if (steps.empty()) return;
  start_fetch(*kv_win_[0], layer, steps[0].pages, false);
  for (size_t j = 0; j < steps.size(); ++j) {
    Window& w = *kv_win_[j % 2];
    if (j + 1 < steps.size()) start_fetch(*kv_win_[(j + 1) % 2], layer, steps[j + 1].pages, false);
    finish_fetch(w);
    for (const Group& g : steps[j].groups) {
      Tensor o2(o2_, o.dtype, {g.n, H, D}), l2(lse2_, lse.dtype, {H, g.n});
      ops_.attention_forward(o2, l2, rows(q, g.r0, g.n), blocks_of(w, false, g.idx), rows(pos, g.r0, g.n), scale);
      ops_.attention_merge(o, lse, o2, l2, g.r0);
    }
  }
}

void PagedKvStore::backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                            Tensor o, Tensor lse, Tensor pos) {
  OOM_CHECK(backward_, "[kv] this store was set up without key gradients (evaluation only)");
  const int64_t Tc = q.dims[0], H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D, P = opt_.P, ppc = pages_per_chunk();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // The chunk's own key gradients that later chunks left in the store (none for the last chunk): dk, dv
  // start at zero, so taking them is a copy; this chunk's share is added on top by the kernel. A page no
  // later chunk read (sparse) has none: its rows stay zero.
  const int64_t own0 = chunk_ * ppc;
  std::vector<int64_t> left;
  for (int64_t i = 0; i < ppc && i * P < Tc; ++i)
    if (table_.find(kGrad, static_cast<int32_t>(layer), own0 + i)) left.push_back(own0 + i);
  if (!left.empty()) {
    Window& w = *own_win_[0];
    start_fetch(w, layer, left, true);
    finish_fetch(w);
    std::vector<int32_t> idx(left.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i);
    const KvBlocks g = blocks_of(w, true, idx);
    for (size_t b = 0; b < left.size(); ++b) {
      const int64_t i = left[b] - own0;
      // The page's (Hkv, P, D) rows to rows [i P, (i + 1) P) of every kv head of (Hkv, Tc, D).
      const int64_t n = (Hkv - 1) * Tc * D + P * D;
      const Tensor pk(g.blocks[b].k, dk.dtype, {Hkv * P * D}, Tier::Device),
          pv(g.blocks[b].v, dv.dtype, {Hkv * P * D}, Tier::Device);
      ops_.copy_rows(span(dk, i * P * D, n), Tc * D, pk, P * D, Hkv, P * D);
      ops_.copy_rows(span(dv, i * P * D, n), Tc * D, pv, P * D, Hkv, P * D);
    }
  }
  KvBlock own{k.data, v.data, static_cast<int32_t>(chunk_ * opt_.C), static_cast<int32_t>(Tc)};
  KvBlock down{dk.data, dv.data, own.start, own.len};
  ops_.attention_backward(dq, KvBlocks{&down, 1, Hkv, Tc, D, dk.dtype}, dout, q, KvBlocks{&own, 1, Hkv, Tc, D, k.dtype, bf16_products_},
                          o, lse, pos, scale);
  if (chunk_ == 0) return;
  const std::vector<Step> steps = plan(layer, Tc);
  if (steps.empty()) return;
  start_fetch(*kv_win_[0], layer, steps[0].pages, false);
  start_fetch(*grad_win_[0], layer, steps[0].pages, true);
  for (size_t j = 0; j < steps.size(); ++j) {
    Window& w = *kv_win_[j % 2];
    Window& g = *grad_win_[j % 3];
    if (j + 1 < steps.size()) {
      start_fetch(*kv_win_[(j + 1) % 2], layer, steps[j + 1].pages, false);
      start_fetch(*grad_win_[(j + 1) % 3], layer, steps[j + 1].pages, true);
    }
    finish_fetch(w);
    finish_fetch(g);
    for (const Group& gr : steps[j].groups) {
      if (gr.n == Tc) {
        Tensor dq2(dq2_, dq.dtype, {Tc, H, D});
        ops_.attention_backward(dq2, blocks_of(g, true, gr.idx), dout, q, blocks_of(w, false, gr.idx), o, lse, pos,
                                scale);
        ops_.add(dq, dq, dq2);
        continue;
      }
      // Some rows: their lse gathered into (H, n).
      Tensor l(lse2_, lse.dtype, {H, gr.n}), dq2(dq2_, dq.dtype, {gr.n, H, D});
      kv_detail::lse_rows(ops_, l, lse, gr.r0, gr.n);
      const Tensor dq_rows = rows(dq, gr.r0, gr.n);
      ops_.attention_backward(dq2, blocks_of(g, true, gr.idx), rows(dout, gr.r0, gr.n), rows(q, gr.r0, gr.n),
                              blocks_of(w, false, gr.idx), rows(o, gr.r0, gr.n), l, rows(pos, gr.r0, gr.n), scale);
      ops_.add(dq_rows, dq_rows, dq2);
    }
    write_back_grads(g);
  }
}

}  // namespace oomless
