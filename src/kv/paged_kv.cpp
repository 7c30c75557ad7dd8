#include "kv/paged_kv.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "io/amax_history.h"
#include "kv/paged_kv_detail.h"

namespace oomless {

using kv_detail::rows;
using kv_detail::span;

PageSummary parse_page_summary(std::string_view s) {
  if (s == "mean") return PageSummary::mean;
  if (s == "minmax") return PageSummary::minmax;
  fail("[kv] unknown --page-summary '", s, "'; use mean or minmax");
}

const char* page_summary_name(PageSummary s) { return s == PageSummary::mean ? "mean" : "minmax"; }

KvOffload parse_kv_offload(std::string_view s) {
  if (s == "none") return KvOffload::none;
  if (s == "host") return KvOffload::host;
  if (s == "disk") return KvOffload::disk;
  fail("[kv] unknown --kv-offload '", s, "'; use none, host or disk");
}

const char* kv_offload_name(KvOffload m) {
  switch (m) {
    case KvOffload::none: return "none";
    case KvOffload::host: return "host";
    case KvOffload::disk: return "disk";
  }
  return "?";
}

PagedKvStore::PagedKvStore(const KvDims& cfg, Ops& ops, Arena& device, Arena& host, const PagedKvOptions& opt,
                           int64_t max_T, bool backward)
    : cfg_(cfg), ops_(ops), opt_(opt), backward_(backward) {
  OOM_CHECK(opt.C >= 1 && opt.P >= 1 && opt.C % opt.P == 0, "[kv] the page length must divide the chunk length; got "
            "--chunk ", opt.C, " and --page ", opt.P);
  OOM_CHECK(max_T >= 1, "[kv] sequence length must be >= 1, got ", max_T);
  OOM_CHECK(opt.sparse_pages >= 0 && opt.sink_pages >= 0, "[kv] --sparse-pages and --sink-pages must be >= 0, got ",
            opt.sparse_pages, " and ", opt.sink_pages);
  const DType act = ops.act_dtype();
  OOM_CHECK(act == DType::f32 || act == DType::f64, "[kv] the paged store needs an f32 or f64 backend, not ",
            ops.name());
  OOM_CHECK(opt.kv_dtype == DType::f32 || opt.kv_dtype == DType::bf16 || opt.kv_dtype == DType::f8_e4m3, "[kv] --kv-dtype ",
            dtype_name(opt.kv_dtype), " is not a storage the paged store has; use fp32, bf16 or fp8");
  OOM_CHECK(opt.kv_dtype == DType::f32 || act == DType::f32, "[kv] ", dtype_name(opt.kv_dtype), " key/value pages need "
            "the f32 (cpu) backend, not ", ops.name());
  shape_ = PageShape{cfg.Hkv, opt.P, cfg.D, opt.kv_dtype == DType::f32 ? act : opt.kv_dtype};
  if (opt.kv_dtype == DType::f8_e4m3) amax_.assign(static_cast<size_t>(2 * cfg.L), {});
  gshape_ = PageShape{cfg.Hkv, opt.P, cfg.D, act};
  const int64_t ppc = pages_per_chunk();
  max_T_ = max_T;
  max_chunks_ = (max_T + opt.C - 1) / opt.C;
  // Chunks whose keys are kept: all but the last of the longest sequence.
  hist_pages_ = ((max_T - 1) / opt.C) * ppc;
  const int64_t hist_pages = cfg.L * hist_pages_;
  const Category KV = Category::kv, G = Category::kv_grad;
  if (opt.offload != KvOffload::disk) {
    Arena& a = opt.offload == KvOffload::none ? device : host;
    home_ = std::make_unique<PagePool>(a, KV, shape_, hist_pages, "key/value pages");
    home_->reserve(hist_pages);
    if (backward) {
      ghome_ = std::make_unique<PagePool>(a, G, gshape_, hist_pages, "key-gradient pages");
      ghome_->reserve(hist_pages);
    }
  } else {
    spill_ = SpillFile::open(opt.spill_dir, shape_.page_bytes(), device.ledger(), KV, opt.io);
    if (backward) gspill_ = SpillFile::open(opt.spill_dir, gshape_.page_bytes(), device.ledger(), G, opt.io);
  }
  auto windows = [&](std::vector<std::unique_ptr<Window>>& ws, int n, PagePool* pool) {
    for (int i = 0; i < n; ++i) {
      ws.push_back(std::make_unique<Window>());
      if (pool)
        for (int64_t p = 0; p < ppc; ++p) ws.back()->dev.push_back(pool->alloc());
    }
  };
  if (opt.offload != KvOffload::none) {
    win_ = std::make_unique<PagePool>(device, KV, shape_, 4 * ppc, "key/value window");
    win_->reserve(4 * ppc);
    if (backward) {
      gwin_ = std::make_unique<PagePool>(device, G, gshape_, 4 * ppc, "key-gradient window");
      gwin_->reserve(4 * ppc);
    }
    off_ = std::make_unique<Offloader>(spill_.get());
  }
  // Two windows for keys (fetch the next while computing one), three for their gradients (the write-back
  // of a window may still run while the next two are used), one for the chunk's own gradients, two for
  // staging a chunk's keys on their way out.
  windows(kv_win_, 2, win_.get());
  windows(stage_, 2, win_.get());
  if (backward) {
    windows(grad_win_, 3, gwin_.get());
    windows(own_win_, 1, gwin_.get());
  }
  const int64_t C = opt.C, H = cfg.H, D = cfg.D;
  scratch_ = device.alloc(static_cast<size_t>(dtype_bytes(act, 2 * C * H * D + H * C)), Category::workspace,
                          "attention merge");
  o2_ = scratch_.view(act, {C, H, D});
  dq2_ = Tensor(o2_, dtype_bytes(act, C * H * D), act, {C, H, D});
  lse2_ = Tensor(o2_, dtype_bytes(act, 2 * C * H * D), act, {H, C});
  if (sparse()) {
    const int64_t S = opt.summary == PageSummary::mean ? 1 : 2;
    const int64_t summaries = std::max<int64_t>(1, cfg.L * hist_pages_ * S * cfg.Hkv * D);
    summ_ = device.alloc(static_cast<size_t>(summaries) * sizeof(float), KV, "page summaries");
    const int64_t n = cfg.L * max_chunks_ * ppc;
    sel_ = host.alloc(static_cast<size_t>(n * sel_width() + 1) * sizeof(int32_t), KV, "page selections");
    sel_n_ = host.alloc(static_cast<size_t>(n) * sizeof(int32_t), KV, "page selection counts");
    std::memset(sel_n_.data(), 0, static_cast<size_t>(n) * sizeof(int32_t));
    sel_dev_ = device.alloc(static_cast<size_t>(ppc * (sel_width() + 1)) * sizeof(int32_t), Category::workspace,
                            "page selection of a chunk");
    made_.assign(static_cast<size_t>(cfg.L * max_chunks_), 0);
  }
}

PagedKvStore::~PagedKvStore() {
  try {
    end();
  } catch (...) {
    // Destruction frees; a transfer error was (or will be) reported where it was waited on.
  }
  off_.reset();  // joins the worker before the pages it may touch go away
}

OffloadStats PagedKvStore::stats() const { return off_ ? off_->stats() : OffloadStats{}; }
const char* PagedKvStore::io_name() const { return spill_ ? spill_->io_name() : ""; }
int64_t PagedKvStore::pages_in_use() const { return table_.count(); }

void PagedKvStore::settle(std::vector<Offloader::Ticket>& tickets) {
  for (Offloader::Ticket t : tickets) off_->wait(t);
  tickets.clear();
}

void PagedKvStore::begin(int64_t T, int64_t C) {
  OOM_CHECK(C == opt_.C, "[kv] the store was set up for chunks of ", opt_.C, " tokens, not ", C);
  OOM_CHECK(T >= 1 && T <= max_T_, "[kv] the store was set up for sequences of up to ", max_T_, " tokens, not ", T);
  end();
  T_ = T;
  chunk_ = 0;
  if (!opt_.keep_selection) std::fill(made_.begin(), made_.end(), 0);
}

void PagedKvStore::set_chunk(int64_t c) {
  OOM_CHECK(c >= 0 && c * opt_.C < T_, "[kv] chunk ", c, " is outside the sequence of ", T_, " tokens");
  chunk_ = c;
}

// Scatter rows: page i of a chunk holds positions [i P, (i + 1) P) of every kv head.
float PagedKvStore::quantize_chunk(int64_t layer, int kind, const Tensor& x) {
  // The largest |x| of the chunk (NaN when any element is not finite), by the backend.
  const float amax = static_cast<float>(ops_.abs_max(x));
  const bool finite = std::isfinite(amax);
  std::vector<float>& hist = amax_[static_cast<size_t>(2 * layer + kind)];
  Fp8Counts& cnt = kind == 0 ? fp8_.k : fp8_.v;
  float ref = amax;
  if (!hist.empty()) ref = *std::max_element(hist.begin(), hist.end());
  if (finite) {
    hist.push_back(amax);
    if (hist.size() > static_cast<size_t>(kAmaxHistory)) hist.erase(hist.begin());
  } else {
    ++cnt.nonfinite_chunks;
  }
  return ref > 0 && std::isfinite(ref) ? 448.0f / ref : 1.0f;
}

void PagedKvStore::store(int64_t layer, Tensor k, Tensor v) {
  const int64_t Hkv = cfg_.Hkv, D = cfg_.D, P = opt_.P, Tc = k.dims[1], ppc = pages_per_chunk();
  OOM_CHECK(Tc == opt_.C, "[kv] only whole chunks are kept (", Tc, " tokens given, chunks are ", opt_.C, ")");
  Window& s = *stage_[static_cast<size_t>(next_stage_)];
  next_stage_ ^= 1;
  if (off_) settle(s.pending);
  const size_t row = static_cast<size_t>(dtype_bytes(shape_.dtype, P * D)), half = shape_.half_bytes();
  // Rows [r, r + P) of kv head h of a chunk's keys or values (Hkv, Tc, D), as a tensor.
  const auto rows = [&](const Tensor& t, int64_t h, int64_t r) {
    return Tensor(static_cast<char*>(t.data) + dtype_bytes(t.dtype, (h * Tc + r) * D), t.dtype, {P * D}, t.tier);
  };
  const bool fp8 = shape_.dtype == DType::f8_e4m3;
  OOM_CHECK(!fp8 || k.dtype == DType::f32, "[kv] fp8 pages are made from f32 keys and values");
  const float ks = fp8 ? quantize_chunk(layer, 0, k) : 1.0f, vs = fp8 ? quantize_chunk(layer, 1, v) : 1.0f;
  // A page's rows into its storage: as they are, x * scale rounded to E4M3 (saturating; counted), or rounded to
  // the storage dtype.
  const auto write_page = [&](char* dst, const Tensor& src, float scale, Fp8Counts& cnt) {
    const Tensor d(dst, shape_.dtype, {P * D}, Tier::Device);
    if (!fp8) return ops_.convert(d, src);
    const CastStats st = ops_.cast_scaled(d, src, scale);
    cnt.saturated += static_cast<uint64_t>(st.saturated);
    cnt.flushed += static_cast<uint64_t>(st.flushed);
    cnt.values += static_cast<uint64_t>(P * D);
  };
  for (int64_t i = 0; i < ppc; ++i) {
    const int64_t lp = chunk_ * ppc + i;
    if (sparse()) summarize(layer, lp, k, i * P);
    PageRef ref{Tier::Device, 0, static_cast<int32_t>(lp * P), static_cast<int32_t>(P)};
    ref.k_scale = 1.0f / ks, ref.v_scale = 1.0f / vs;
    char* dst;
    if (opt_.offload == KvOffload::none) {
      ref.slot = home_->alloc();
      dst = static_cast<char*>(home_->k(ref.slot));
    } else {
      dst = static_cast<char*>(win_->k(s.dev[static_cast<size_t>(i)]));
    }
    if (shape_.dtype == k.dtype && shape_.dtype == v.dtype) {
      // Rows [i P, (i + 1) P) of every kv head: one strided copy for K, one for V.
      const int64_t n = (Hkv - 1) * Tc * D + P * D;
      const auto from = [&](const Tensor& t) {
        return Tensor(static_cast<char*>(t.data) + dtype_bytes(t.dtype, i * P * D), t.dtype, {n}, t.tier);
      };
      ops_.copy_rows(Tensor(dst, shape_.dtype, {Hkv * P * D}, Tier::Device), P * D, from(k), Tc * D, Hkv, P * D);
      ops_.copy_rows(Tensor(dst + half, shape_.dtype, {Hkv * P * D}, Tier::Device), P * D, from(v), Tc * D, Hkv, P * D);
    } else {
      for (int64_t h = 0; h < Hkv; ++h) {
        write_page(dst + static_cast<size_t>(h) * row, rows(k, h, i * P), ks, fp8_.k);
        write_page(dst + half + static_cast<size_t>(h) * row, rows(v, h, i * P), vs, fp8_.v);
      }
    }
    if (opt_.offload == KvOffload::host) {
      ref.tier = Tier::Host;
      ref.slot = home_->alloc();
      s.pending.push_back(off_->copy(home_->k(ref.slot), dst, shape_.page_bytes(), Tier::Device, Tier::Host));
    } else if (opt_.offload == KvOffload::disk) {
      ref.tier = Tier::Disk;
      ref.slot = spill_->alloc_slot();
      s.pending.push_back(off_->to_disk(ref.slot, dst, shape_.page_bytes(), 0, Tier::Device));
    }
    table_.set(kKv, static_cast<int32_t>(layer), lp, ref);
  }
}

json::Value PagedKvStore::amax_state() const { return amax_history_json(amax_); }

void PagedKvStore::restore_amax(const json::Value& state) { restore_amax_history(amax_, state, "[kv]", "2 per layer"); }
void PagedKvStore::start_fetch(Window& w, int64_t layer, const std::vector<int64_t>& lps, bool grads) {
  const int64_t seq = grads ? kGrad : kKv;
  w.layer = layer;
  w.lps = lps;
  w.pages.clear();
  w.scales.assign(lps.size(), {1.0f, 1.0f});
  PagePool* home = grads ? ghome_.get() : home_.get();
  for (size_t i = 0; i < lps.size(); ++i) {
    const int64_t lp = lps[i];
    const PageRef* ref = table_.find(seq, static_cast<int32_t>(layer), lp);
    if (!ref) {
      // A gradient page no chunk has touched yet starts at zero.
      OOM_CHECK(grads, "[kv] internal: layer ", layer, " page ", lp, " was never stored");
      PageRef nr{Tier::Device, 0, static_cast<int32_t>(lp * opt_.P), static_cast<int32_t>(opt_.P)};
      if (opt_.offload == KvOffload::disk) {
        nr.tier = Tier::Disk;
        nr.slot = gspill_->alloc_slot();
      } else {
        nr.tier = opt_.offload == KvOffload::none ? Tier::Device : Tier::Host;
        nr.slot = ghome_->alloc();
      }
      if (opt_.offload == KvOffload::none) {
        ghome_->zero(nr.slot);
        w.pages.push_back(nr.slot);
      } else {
        settle(w.pending);  // a write-back may still be reading this window
        gwin_->zero(w.dev[i]);
      }
      table_.set(seq, static_cast<int32_t>(layer), lp, nr);
      continue;
    }
    w.scales[i] = {ref->k_scale, ref->v_scale};
    if (opt_.offload == KvOffload::none) {
      w.pages.push_back(ref->slot);
    } else {
      PagePool* pool = grads ? gwin_.get() : win_.get();
      void* dst = pool->k(w.dev[i]);
      const size_t bytes = (grads ? gshape_ : shape_).page_bytes();
      // FIFO: this runs after any write-back still reading the window.
      w.pending.push_back(ref->tier == Tier::Disk
                              ? off_->from_disk(dst, ref->slot, bytes, 0, Tier::Device, grads ? gspill_.get() : nullptr)
                              : off_->copy(dst, home->k(ref->slot), bytes, Tier::Host, Tier::Device));
    }
  }
}

void PagedKvStore::finish_fetch(Window& w) {
  if (off_) settle(w.pending);
}

KvBlocks PagedKvStore::blocks_of(Window& w, bool grads, const std::vector<int32_t>& idx) {
  const int64_t P = opt_.P;
  w.blocks.clear();
  for (int32_t i : idx) {
    const size_t u = static_cast<size_t>(i);
    const int32_t start = static_cast<int32_t>(w.lps[u] * P);
    if (opt_.offload == KvOffload::none) {
      PagePool& pool = grads ? *ghome_ : *home_;
      w.blocks.push_back(pool.block(w.pages[u], start, static_cast<int32_t>(P)));
    } else {
      PagePool& pool = grads ? *gwin_ : *win_;
      w.blocks.push_back(pool.block(w.dev[u], start, static_cast<int32_t>(P)));
    }
    w.blocks.back().k_scale = w.scales[u][0], w.blocks.back().v_scale = w.scales[u][1];
  }
  return KvBlocks{w.blocks.data(), static_cast<int64_t>(idx.size()), cfg_.Hkv, P, cfg_.D,
                  grads ? gshape_.dtype : shape_.dtype, bf16_products_};
}

void PagedKvStore::write_back_grads(Window& w) {
  if (opt_.offload == KvOffload::none) return;  // accumulated in place
  for (size_t i = 0; i < w.lps.size(); ++i) {
    const PageRef& ref = table_.at(kGrad, static_cast<int32_t>(w.layer), w.lps[i]);
    void* src = gwin_->k(w.dev[i]);
    w.pending.push_back(ref.tier == Tier::Disk
                            ? off_->to_disk(ref.slot, src, gshape_.page_bytes(), 0, Tier::Device, gspill_.get())
                            : off_->copy(ghome_->k(ref.slot), src, gshape_.page_bytes(), Tier::Device, Tier::Host));
  }
}

void PagedKvStore::release(int64_t seq, int32_t layer, int64_t lpage) {
  const PageRef* ref = table_.find(seq, layer, lpage);
  if (!ref) return;
  if (ref->tier == Tier::Disk) {
    (seq == kGrad ? *gspill_ : *spill_).free_slot(ref->slot);
  } else {
    (seq == kGrad ? *ghome_ : *home_).free(ref->slot);
  }
  table_.erase(seq, layer, lpage);
}

void PagedKvStore::chunk_done(int64_t c) {
  // Transfers in flight may still touch this chunk's pages: let them finish first.
  if (off_)
    for (auto* ws : {&kv_win_, &grad_win_, &own_win_, &stage_})
      for (auto& w : *ws) settle(w->pending);
  const int64_t ppc = pages_per_chunk();
  for (int32_t l = 0; l < cfg_.L; ++l)
    for (int64_t i = 0; i < ppc; ++i) {
      release(kKv, l, c * ppc + i);
      release(kGrad, l, c * ppc + i);
    }
}

void PagedKvStore::end() {
  if (off_)
    for (auto* ws : {&kv_win_, &grad_win_, &own_win_, &stage_})
      for (auto& w : *ws) settle(w->pending);
  for (int64_t seq : {kKv, kGrad})
    for (const PageRef& ref : table_.drop_sequence(seq)) {
      if (ref.tier == Tier::Disk) {
        (seq == kGrad ? *gspill_ : *spill_).free_slot(ref.slot);
      } else {
        (seq == kGrad ? *ghome_ : *home_).free(ref.slot);
      }
    }
  T_ = 0;
  chunk_ = 0;
}

}  // namespace oomless
