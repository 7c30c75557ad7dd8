#include "model/paged_kv.h"

#include <cmath>
#include <cstring>

namespace oomless {

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

// C/P pages of one earlier chunk and one layer, as attention reads them: in mode none the pages
// themselves (home pool ids), otherwise fixed Device pages (dev) that transfers fill and empty.
struct PagedKvStore::Window {
  std::vector<int64_t> dev;                 // Device page ids in the window pool (host/disk)
  std::vector<int64_t> pages;               // none: the home page ids read in place
  std::vector<Offloader::Ticket> pending;   // transfers into or out of dev not yet waited on
  std::vector<KvBlock> blocks;
  int64_t layer = -1, chunk = -1;
};

PagedKvStore::PagedKvStore(const ModelConfig& cfg, Ops& ops, Arena& device, Arena& host, const PagedKvOptions& opt,
                           int64_t max_T, bool backward)
    : cfg_(cfg), ops_(ops), opt_(opt), backward_(backward) {
  OOM_CHECK(opt.C >= 1 && opt.P >= 1 && opt.C % opt.P == 0, "[kv] the page length must divide the chunk length; got "
            "--chunk ", opt.C, " and --page ", opt.P);
  OOM_CHECK(max_T >= 1, "[kv] sequence length must be >= 1, got ", max_T);
  shape_ = PageShape{cfg.Hkv, opt.P, cfg.D, ops.act_dtype()};
  const int64_t ppc = pages_per_chunk();
  // Chunks whose keys are kept: all but the last of the longest sequence.
  const int64_t hist_pages = cfg.L * ((max_T - 1) / opt.C) * ppc;
  const Category KV = Category::kv, G = Category::kv_grad;
  if (opt.offload != KvOffload::disk) {
    Arena& a = opt.offload == KvOffload::none ? device : host;
    home_ = std::make_unique<PagePool>(a, KV, shape_, hist_pages, "key/value pages");
    home_->reserve(hist_pages);
    if (backward) {
      ghome_ = std::make_unique<PagePool>(a, G, shape_, hist_pages, "key-gradient pages");
      ghome_->reserve(hist_pages);
    }
  } else {
    spill_ = SpillFile::open(opt.spill_dir, shape_.page_bytes(), device.ledger(), KV, opt.io);
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
      gwin_ = std::make_unique<PagePool>(device, G, shape_, 4 * ppc, "key-gradient window");
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
  const size_t f = sizeof(float);
  OOM_CHECK(ops.act_dtype() == DType::f32, "[kv] the paged store runs on an f32 backend, not ", ops.name());
  scratch_ = device.alloc(static_cast<size_t>(2 * C * H * D + H * C) * f, Category::workspace, "attention merge");
  float* p = scratch_.as<float>();
  o2_ = Tensor(p, DType::f32, {C, H, D});
  dq2_ = Tensor(p + C * H * D, DType::f32, {C, H, D});
  lse2_ = Tensor(p + 2 * C * H * D, DType::f32, {H, C});
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
  end();
  T_ = T;
  chunk_ = 0;
}

void PagedKvStore::set_chunk(int64_t c) {
  OOM_CHECK(c >= 0 && c * opt_.C < T_, "[kv] chunk ", c, " is outside the sequence of ", T_, " tokens");
  chunk_ = c;
}

// Scatter rows: page i of a chunk holds positions [i P, (i + 1) P) of every kv head.
void PagedKvStore::store(int64_t layer, Tensor k, Tensor v) {
  const int64_t Hkv = cfg_.Hkv, D = cfg_.D, P = opt_.P, Tc = k.dims[1], ppc = pages_per_chunk();
  OOM_CHECK(Tc == opt_.C, "[kv] only whole chunks are kept (", Tc, " tokens given, chunks are ", opt_.C, ")");
  Window& s = *stage_[static_cast<size_t>(next_stage_)];
  next_stage_ ^= 1;
  if (off_) settle(s.pending);
  const size_t row = static_cast<size_t>(P * D) * sizeof(float), half = shape_.half_bytes();
  for (int64_t i = 0; i < ppc; ++i) {
    const int64_t lp = chunk_ * ppc + i;
    PageRef ref{Tier::Device, 0, static_cast<int32_t>(lp * P), static_cast<int32_t>(P)};
    char* dst;
    if (opt_.offload == KvOffload::none) {
      ref.slot = home_->alloc();
      dst = static_cast<char*>(home_->k(ref.slot));
    } else {
      dst = static_cast<char*>(win_->k(s.dev[static_cast<size_t>(i)]));
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(dst + static_cast<size_t>(h) * row, static_cast<const float*>(k.data) + (h * Tc + i * P) * D, row);
      std::memcpy(dst + half + static_cast<size_t>(h) * row, static_cast<const float*>(v.data) + (h * Tc + i * P) * D,
                  row);
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

void PagedKvStore::start_fetch(Window& w, int64_t layer, int64_t chunk, bool grads) {
  const int64_t ppc = pages_per_chunk(), seq = grads ? kGrad : kKv;
  w.layer = layer;
  w.chunk = chunk;
  w.pages.clear();
  PagePool* home = grads ? ghome_.get() : home_.get();
  for (int64_t i = 0; i < ppc; ++i) {
    const int64_t lp = chunk * ppc + i;
    const PageRef* ref = table_.find(seq, static_cast<int32_t>(layer), lp);
    if (!ref) {
      // A gradient page no chunk has touched yet starts at zero.
      OOM_CHECK(grads, "[kv] internal: layer ", layer, " page ", lp, " was never stored");
      PageRef nr{Tier::Device, 0, static_cast<int32_t>(lp * opt_.P), static_cast<int32_t>(opt_.P)};
      if (opt_.offload == KvOffload::disk) {
        nr.tier = Tier::Disk;
        nr.slot = spill_->alloc_slot();
      } else {
        nr.tier = opt_.offload == KvOffload::none ? Tier::Device : Tier::Host;
        nr.slot = ghome_->alloc();
      }
      if (opt_.offload == KvOffload::none) {
        ghome_->zero(nr.slot);
        w.pages.push_back(nr.slot);
      } else {
        settle(w.pending);  // a write-back may still be reading this window
        gwin_->zero(w.dev[static_cast<size_t>(i)]);
      }
      table_.set(seq, static_cast<int32_t>(layer), lp, nr);
      continue;
    }
    if (opt_.offload == KvOffload::none) {
      w.pages.push_back(ref->slot);
    } else {
      PagePool* pool = grads ? gwin_.get() : win_.get();
      void* dst = pool->k(w.dev[static_cast<size_t>(i)]);
      // FIFO: this runs after any write-back still reading the window.
      w.pending.push_back(ref->tier == Tier::Disk
                              ? off_->from_disk(dst, ref->slot, shape_.page_bytes(), 0, Tier::Device)
                              : off_->copy(dst, home->k(ref->slot), shape_.page_bytes(), Tier::Host, Tier::Device));
    }
  }
}

void PagedKvStore::finish_fetch(Window& w) {
  if (off_) settle(w.pending);
}

KvBlocks PagedKvStore::blocks_of(Window& w, bool grads) {
  const int64_t ppc = pages_per_chunk(), P = opt_.P;
  w.blocks.clear();
  for (int64_t i = 0; i < ppc; ++i) {
    const int32_t start = static_cast<int32_t>((w.chunk * ppc + i) * P);
    if (opt_.offload == KvOffload::none) {
      PagePool& pool = grads ? *ghome_ : *home_;
      w.blocks.push_back(pool.block(w.pages[static_cast<size_t>(i)], start, static_cast<int32_t>(P)));
    } else {
      PagePool& pool = grads ? *gwin_ : *win_;
      w.blocks.push_back(pool.block(w.dev[static_cast<size_t>(i)], start, static_cast<int32_t>(P)));
    }
  }
  return KvBlocks{w.blocks.data(), ppc, cfg_.Hkv, P, cfg_.D, shape_.dtype};
}

void PagedKvStore::write_back_grads(Window& w) {
  if (opt_.offload == KvOffload::none) return;  // accumulated in place
  const int64_t ppc = pages_per_chunk();
  for (int64_t i = 0; i < ppc; ++i) {
    const PageRef& ref = table_.at(kGrad, static_cast<int32_t>(w.layer), w.chunk * ppc + i);
    void* src = gwin_->k(w.dev[static_cast<size_t>(i)]);
    w.pending.push_back(ref.tier == Tier::Disk
                            ? off_->to_disk(ref.slot, src, shape_.page_bytes(), 0, Tier::Device)
                            : off_->copy(ghome_->k(ref.slot), src, shape_.page_bytes(), Tier::Device, Tier::Host));
  }
}

void PagedKvStore::forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) {
  const int64_t Tc = q.dims[0], H = cfg_.H, D = cfg_.D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  KvBlock own{k.data, v.data, static_cast<int32_t>(chunk_ * opt_.C), static_cast<int32_t>(Tc)};
  ops_.attention_forward(o, lse, q, KvBlocks{&own, 1, cfg_.Hkv, Tc, D, k.dtype}, pos, scale);
  if (chunk_ == 0) return;
  Tensor o2(o2_.data, DType::f32, {Tc, H, D}), l2(lse2_.data, DType::f32, {H, Tc});
  start_fetch(*kv_win_[0], layer, 0, false);
  for (int64_t j = 0; j < chunk_; ++j) {
    Window& w = *kv_win_[static_cast<size_t>(j % 2)];
    if (j + 1 < chunk_) start_fetch(*kv_win_[static_cast<size_t>((j + 1) % 2)], layer, j + 1, false);
    finish_fetch(w);
    ops_.attention_forward(o2, l2, q, blocks_of(w, false), pos, scale);
    ops_.attention_merge(o, lse, o2, l2);
  }
}

void PagedKvStore::backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                            Tensor o, Tensor lse, Tensor pos) {
  OOM_CHECK(backward_, "[kv] this store was set up without key gradients (evaluation only)");
  const int64_t Tc = q.dims[0], H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D, P = opt_.P, ppc = pages_per_chunk();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // The chunk's own key gradients that later chunks left in the store (none for the last chunk): dk, dv
  // start at zero, so taking them is a copy; this chunk's share is added on top by the kernel.
  if (table_.find(kGrad, static_cast<int32_t>(layer), chunk_ * ppc)) {
    Window& w = *own_win_[0];
    start_fetch(w, layer, chunk_, true);
    finish_fetch(w);
    const KvBlocks g = blocks_of(w, true);
    const size_t row = static_cast<size_t>(P * D) * sizeof(float);
    for (int64_t i = 0; i < ppc && i * P < Tc; ++i)
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(static_cast<float*>(dk.data) + (h * Tc + i * P) * D,
                    static_cast<const char*>(g.blocks[i].k) + static_cast<size_t>(h) * row, row);
        std::memcpy(static_cast<float*>(dv.data) + (h * Tc + i * P) * D,
                    static_cast<const char*>(g.blocks[i].v) + static_cast<size_t>(h) * row, row);
      }
  }
  KvBlock own{k.data, v.data, static_cast<int32_t>(chunk_ * opt_.C), static_cast<int32_t>(Tc)};
  KvBlock down{dk.data, dv.data, own.start, own.len};
  ops_.attention_backward(dq, KvBlocks{&down, 1, Hkv, Tc, D, dk.dtype}, dout, q, KvBlocks{&own, 1, Hkv, Tc, D, k.dtype},
                          o, lse, pos, scale);
  if (chunk_ == 0) return;
  Tensor dq2(dq2_.data, DType::f32, {Tc, H, D});
  start_fetch(*kv_win_[0], layer, 0, false);
  start_fetch(*grad_win_[0], layer, 0, true);
  for (int64_t j = 0; j < chunk_; ++j) {
    Window& w = *kv_win_[static_cast<size_t>(j % 2)];
    Window& g = *grad_win_[static_cast<size_t>(j % 3)];
    if (j + 1 < chunk_) {
      start_fetch(*kv_win_[static_cast<size_t>((j + 1) % 2)], layer, j + 1, false);
      start_fetch(*grad_win_[static_cast<size_t>((j + 1) % 3)], layer, j + 1, true);
    }
    finish_fetch(w);
    finish_fetch(g);
    ops_.attention_backward(dq2, blocks_of(g, true), dout, q, blocks_of(w, false), o, lse, pos, scale);
    ops_.add(dq, dq, dq2);
    write_back_grads(g);
  }
}

void PagedKvStore::release(int64_t seq, int32_t layer, int64_t lpage) {
  const PageRef* ref = table_.find(seq, layer, lpage);
  if (!ref) return;
  if (ref->tier == Tier::Disk) {
    spill_->free_slot(ref->slot);
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
        spill_->free_slot(ref.slot);
      } else {
        (seq == kGrad ? *ghome_ : *home_).free(ref.slot);
      }
    }
  T_ = 0;
  chunk_ = 0;
}

}  // namespace oomless
